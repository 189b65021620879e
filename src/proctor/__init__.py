"""proctor: have a coding agent do a task in a git repo under limits, and judge the result on evidence."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from proctor.contract import Code, RunAgentRequest, RunAgentResult, Status
    from proctor.services.job.run_agent import run_agent

__all__ = ["Code", "RunAgentRequest", "RunAgentResult", "Status", "run_agent"]

# Loaded on first use (PEP 562): every `proctor` command imports this package, and the job path behind
# `run_agent` is most of the CLI's start-up (0.4 of its 0.6 s), which `proctor jobs` or `stop` never need.
_WHERE = {"Code": "proctor.contract", "RunAgentRequest": "proctor.contract", "RunAgentResult": "proctor.contract",
          "Status": "proctor.contract", "run_agent": "proctor.services.job.run_agent"}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'proctor' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value
