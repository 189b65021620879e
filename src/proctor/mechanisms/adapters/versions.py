"""Whether an agent CLI's version is one proctor was tested with: a built-in adapter's `tested` list (the
versions the real-CLI suite passed with, as the CLI's own `--version` names them) against the version the
job's probe read. A CLI changes what it writes, which flags it takes and which tools it has between
releases (claude 2.1.332 wrote a usage store where 2.1.197 wrote none), so a version nobody ran the suite
against is said on the job; `cli_versions = "strict"` refuses it before anything launches.

It never runs the CLI: the job's confined probe does (proctor.services.job.agent_version).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

# The version in a CLI's `--version` line: "2.1.332 (Claude Code)", "codex-cli 0.171.0", "1.18.33".
_VERSION = re.compile(r"(?<![\w.])v?(\d+\.\d+\.\d+(?:[-+][0-9A-Za-z.-]+)?)(?![\w.])")


def version_of(answer: str | None) -> str | None:
    """The first x.y.z version in a CLI's `--version` answer, without a leading "v"; None without one."""
    m = _VERSION.search(answer or "")
    return m.group(1) if m else None


def untested(name: str, tested: Sequence[str], answer: str | None) -> str | None:
    """Why the job's CLI is not a version proctor was tested with, or None when it is, or when the adapter
    lists no tested versions (a user's own adapter: nothing to compare with)."""
    if not tested:
        return None
    versions = ", ".join(tested)
    got = version_of(answer)
    if got is None:
        return (f"{name}'s version could not be read ({answer!r} from its --version), so it cannot be told "
                f"from the ones proctor was tested with ({versions})")
    if got in tested:
        return None
    return (f"{name} {got} is not a version proctor was tested with ({versions}): its flags, tools and the "
            "files it writes may differ from what the gate and the state watch know")
