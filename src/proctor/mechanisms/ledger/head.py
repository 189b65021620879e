"""`ledger.head`: the last row's id and hash beside the ledger file, so that a cut tail shows.

Owns the head file, the copies a writer stages before its rows go in (the new head, and the old one to put
back by a rename, which needs no free space), finding what a dead writer staged, and judging the head against
the rows. It never opens the ledger's database: proctor.mechanisms.ledger.store calls each of these inside its
own transaction, under its lock.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from pathlib import Path

from proctor.mechanisms.ledger.rows import canonical_json


class Head:
    def __init__(self, path: Path) -> None:
        self.path = path

    def stage(self, row_id: int, digest: str, which: str) -> Path:
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{threading.get_ident()}.{which}.tmp")
        try:
            tmp.write_text(canonical_json({"id": row_id, "hash": digest}) + "\n", encoding="utf-8")
        except BaseException:
            discard(tmp)
            raise
        return tmp

    def put_back(self, old_head: Path | None) -> None:
        """The head as it was before a write: its staged copy renamed back, or none when there was none."""
        if old_head is not None:
            os.replace(old_head, self.path)
        else:
            self.path.unlink(missing_ok=True)

    def dead_writers(self) -> list[tuple[Path, str]]:
        """What writers no longer alive staged (`.ledger.head.<pid>.<tid>.<new|old>.tmp`), with which head
        each is. Staged files of writers still alive are not listed."""
        prefix = f".{self.path.name}."
        try:
            leftovers = [t for t in self.path.parent.iterdir()
                         if t.name.startswith(prefix) and t.name.endswith(".tmp")]
        except OSError:
            return []
        out = []
        for tmp in leftovers:
            parts = tmp.name[len(prefix):].split(".")
            try:
                pid, which = int(parts[0]), parts[2]
            except (ValueError, IndexError):
                continue
            if pid == os.getpid() or _pid_alive(pid):
                continue
            out.append((tmp, which))
        return out

    def restore(self, staged: Path, last: tuple[int, str] | None) -> None:
        """Put a staged old head back when it names the last row (`last`: its id and hash) and the head is
        past it. Raises (OSError, ValueError, KeyError, TypeError) on a file it cannot read."""
        old = json.loads(staged.read_text(encoding="utf-8"))
        head = json.loads(self.path.read_text(encoding="utf-8"))
        if last is not None and (int(old["id"]), str(old["hash"])) == (last[0], last[1]) \
                and int(head["id"]) > last[0]:
            os.replace(staged, self.path)

    def against(self, last_id: int, hash_of: Callable[[int], str | None]) -> list[str]:
        """What is wrong with the head against the rows: `last_id` is the last row's id (0: none), `hash_of`
        reads a row's stored hash."""
        try:
            head = json.loads(self.path.read_text(encoding="utf-8"))
            head_id, head_hash = int(head["id"]), str(head["hash"])
        except FileNotFoundError:
            if not last_id:
                return []
            return [f"row {last_id}: {self.path.name} is missing, so a cut tail cannot be ruled out"]
        except (OSError, ValueError, KeyError, TypeError):
            return [f"row {last_id}: {self.path.name} is unreadable"]
        if head_id > last_id:
            return [f"row {last_id + 1}: missing ({self.path.name} names row {head_id}; the tail was cut)"]
        if hash_of(head_id) != head_hash:
            return [f"row {head_id}: does not match {self.path.name} (edited or replaced)"]
        if head_id < last_id:
            return [f"row {head_id + 1}: after {self.path.name}'s row {head_id} (appended outside proctor?)"]
        return []


def discard(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: alive, and not ours to judge
    return True
