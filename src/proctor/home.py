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


class PrivateFileError(Exception):
    """A secret file of the state dir that cannot be used: unreadable, another user's, open to others."""


def private_secret(path: Path, make: str, most: int = 4096) -> str:
    """The stripped content of a secret file (a token) that only this user may read: made with `make` first
    when missing (O_EXCL, mode 0600), never read through a symlink, refused when another user owns it or
    others may read it (then it is not a secret any more: remove it, and a new one is made)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        pass
    except OSError as exc:
        raise PrivateFileError(f"cannot create {path}: {exc}") from None
    else:
        with os.fdopen(fd, "w") as fh:
            fh.write(make)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise PrivateFileError(f"cannot read {path}: {exc}") from None
    with os.fdopen(fd) as fh:
        st = os.fstat(fh.fileno())
        if st.st_uid != os.getuid():
            raise PrivateFileError(f"{path} belongs to uid {st.st_uid}, not to this user: remove it and start again")
        if st.st_mode & 0o077:
            raise PrivateFileError(f"{path} is readable by others (mode {st.st_mode & 0o777:o}): remove it and "
                                   "start again; a new one is made")
        return fh.read(most).strip()
