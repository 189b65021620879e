"""The `proctor` console script: thin commands that parse, call one service function and print.

No policy lives here. Each command module registers itself on `main`; results go to stdout as JSON,
human progress to stderr; a refused or unusable call is a clear message and exit 2, never a traceback.
"""

from __future__ import annotations

from proctor.surfaces.cli.main import main

# Command modules: each adds itself to `main` on import. One line per module, keep sorted.
from proctor.surfaces.cli import adapters as _adapters  # noqa: F401
from proctor.surfaces.cli import commands as _commands  # noqa: F401
from proctor.surfaces.cli import keys as _keys  # noqa: F401
from proctor.surfaces.cli import mcp as _mcp  # noqa: F401
from proctor.surfaces.cli import policy as _policy  # noqa: F401
from proctor.surfaces.cli import queue as _queue  # noqa: F401
from proctor.surfaces.cli import review as _review  # noqa: F401
from proctor.surfaces.cli import run_agent as _run_agent  # noqa: F401
from proctor.surfaces.cli import schema as _schema  # noqa: F401
from proctor.surfaces.cli import serve as _serve  # noqa: F401
from proctor.surfaces.cli import usage as _usage  # noqa: F401

__all__ = ["main"]
