"""Where proctor keeps its own state: `$PROCTOR_HOME`, else `~/.proctor`.

Owns the paths of the state dir (config, policy, ledger, stop file, keys). It never creates anything an
agent could be pointed at: workspaces and worktrees live beside the user's repos, not here.
"""

from __future__ import annotations

import os
from pathlib import Path


def proctor_home() -> Path:
    raw = os.environ.get("PROCTOR_HOME")
    return Path(raw).expanduser().absolute() if raw else Path.home() / ".proctor"


def ensure_home() -> Path:
    home = proctor_home()
    home.mkdir(parents=True, exist_ok=True, mode=0o700)
    return home
