"""Control files put back as they were: their bytes are read before a command runs and restored after it.

Owns pinning (`Pins.take`) and restoring (`Pins.restore`) a small set of files and folders whose change would
outlive the run as a foothold: proctor's trust and configuration (signers.toml, config.toml, policy.toml,
commands.toml, keys/), the allowlist file and the briefs, and the git files that run code at the user's next
`git` (config, config.worktree, hooks/, commondir, gitdir, a worktree's `.git` file). Where bwrap runs they
are read-only or hidden already; this is the floor everywhere else, and the proof afterwards.

Restoring never follows a link the command may have planted: each pinned file's folder must still be the
folder it was (same device and inode, same real path) or it is moved back first, found through a descriptor
held since before the run; a replaced file is written to a temporary name in that folder and renamed over.
A restore that cannot be made is reported (`failed`), never skipped silently. It never decides what a change
means (run does) and never touches the ledger (a rolled-back ledger would hide a real row).
"""

from __future__ import annotations

import os
import shutil
import stat
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

MAX_PIN_BYTES = 4 * 1024 * 1024
MAX_TREE_ENTRIES = 500

# kind, mode, content (file bytes or link target); None for a folder
Item = tuple[str, int, bytes | None]


def _read_item(path: str) -> Item | None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        return ("l", 0, os.fsencode(os.readlink(path)))
    if stat.S_ISDIR(st.st_mode):
        return ("d", stat.S_IMODE(st.st_mode), None)
    if stat.S_ISREG(st.st_mode):
        if st.st_size > MAX_PIN_BYTES:
            raise OSError(f"{path} is larger than {MAX_PIN_BYTES} bytes")
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            chunks = []
            while chunk := os.read(fd, 1 << 20):
                chunks.append(chunk)
        finally:
            os.close(fd)
        return ("f", stat.S_IMODE(st.st_mode), b"".join(chunks))
    return ("o", stat.S_IMODE(st.st_mode), None)


def _read_tree(path: str) -> dict[str, Item] | None:
    """A pinned thing: a file (key ""), or a folder with everything under it, links not followed."""
    top = _read_item(path)
    if top is None:
        return None
    items: dict[str, Item] = {"": top}
    if top[0] != "d":
        return items
    for dirpath, dirnames, filenames in os.walk(path, followlinks=False):
        for name in [*dirnames, *filenames]:
            full = os.path.join(dirpath, name)
            item = _read_item(full)
            if item is not None:
                items[os.path.relpath(full, path)] = item
            if len(items) > MAX_TREE_ENTRIES:
                raise OSError(f"{path} holds more than {MAX_TREE_ENTRIES} entries")
    return items


@dataclass
class _Folder:
    path: Path
    real: str
    dev_ino: tuple[int, int]
    fd: int


@dataclass
class Pins:
    folders: dict[Path, _Folder] = field(default_factory=dict)
    pinned: dict[Path, dict[str, Item] | None] = field(default_factory=dict)
    unpinned: list[str] = field(default_factory=list)
    """Paths that could not be pinned (too large, unreadable): reported as gaps."""

    @classmethod
    def take(cls, paths: Iterable[Path]) -> Pins:
        pins = cls()
        for p in dict.fromkeys(paths):
            parent = p.parent
            try:
                if parent not in pins.folders:
                    st = os.lstat(parent)
                    if not stat.S_ISDIR(st.st_mode):
                        continue  # no folder, nothing to pin in it (the path cannot exist either)
                    fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
                    pins.folders[parent] = _Folder(parent, os.path.realpath(parent), (st.st_dev, st.st_ino), fd)
                pins.pinned[p] = _read_tree(str(p))
            except OSError as exc:
                pins.unpinned.append(f"{p}: {exc.strerror or exc}")
        return pins

    def close(self) -> None:
        for f in self.folders.values():
            try:
                os.close(f.fd)
            except OSError:
                pass
        self.folders.clear()

    def changed(self) -> list[Path]:
        out = []
        for p, before in self.pinned.items():
            try:
                now = _read_tree(str(p)) if self._folder_intact(self.folders[p.parent]) else "moved"
            except OSError:
                now = "unreadable"
            if now != before:
                out.append(p)
        return out

    def restore(self) -> tuple[list[str], list[str]]:
        """Put every changed pin back. Returns (restored paths, failures with why)."""
        restored: list[str] = []
        failed: dict[str, str] = {}
        for folder in self.folders.values():
            if not self._folder_intact(folder):
                why = self._move_back(folder)
                if why:
                    failed[str(folder.path)] = why
                else:
                    restored.append(str(folder.path))
        for p in self.changed():
            if not self._folder_intact(self.folders[p.parent]):
                failed.setdefault(str(p), "its folder is not the one it was")
                continue
            try:
                aside = _put_back(p, self.pinned[p])
                restored.append(f"{p} (what the command left is at {aside})" if aside else str(p))
            except OSError as exc:
                failed[str(p)] = str(exc.strerror or exc)
        for p in self.changed():
            failed.setdefault(str(p), "still differs after the restore")
        return restored, [f"{k}: {v}" for k, v in sorted(failed.items())]

    @staticmethod
    def _folder_intact(folder: _Folder) -> bool:
        try:
            st = os.lstat(folder.path)
        except OSError:
            return False
        return stat.S_ISDIR(st.st_mode) and (st.st_dev, st.st_ino) == folder.dev_ino and \
            os.path.realpath(folder.path) == folder.real

    @staticmethod
    def _move_back(folder: _Folder) -> str | None:
        """The folder was renamed, removed or replaced: move whatever is there aside, the original back."""
        try:
            where = os.readlink(f"/proc/self/fd/{folder.fd}")
        except OSError as exc:
            return f"replaced, and the original cannot be found ({exc.strerror})"
        if where.endswith(" (deleted)"):
            return "removed; its pinned files cannot be put back in it"
        try:
            if os.path.lexists(folder.path):
                os.rename(folder.path, _aside(folder.path))
            os.rename(where, folder.path)
        except OSError as exc:
            return f"replaced, and moving the original back from {where} failed: {exc.strerror}"
        return None if Pins._folder_intact(folder) else "moved back, yet still not the original folder"


def _aside(path: Path) -> Path:
    return path.with_name(f"{path.name}.proctor-planted-{uuid.uuid4().hex[:8]}")


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def _put_back(path: Path, tree: dict[str, Item] | None) -> Path | None:
    """Put the pinned tree (or nothing) at `path`; what the command left there is moved aside, never deleted
    (a new key may be someone's), under a name nothing reads. Returns where it went. The folder is intact."""
    target = str(path)
    tmp = str(path.with_name(f".{path.name}.proctor-restore-{uuid.uuid4().hex[:8]}"))
    try:
        if tree is not None:
            for rel, (kind, _mode, content) in sorted(tree.items(), key=lambda kv: kv[0].count(os.sep)):
                dest = tmp if rel == "" else os.path.join(tmp, rel)
                if kind == "d":
                    os.mkdir(dest, 0o700)
                elif kind == "l":
                    os.symlink(os.fsdecode(content or b""), dest)
                elif kind == "f":
                    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                    try:
                        os.write(fd, content or b"")
                    finally:
                        os.close(fd)
            for rel, (kind, mode, _) in tree.items():
                if kind in ("d", "f"):
                    os.chmod(tmp if rel == "" else os.path.join(tmp, rel), mode)
        aside = None
        if os.path.lexists(target):
            aside = _aside(path)
            os.rename(target, aside)
        if tree is not None:
            os.rename(tmp, target)
        return aside
    finally:
        if os.path.lexists(tmp):
            _remove(tmp)
