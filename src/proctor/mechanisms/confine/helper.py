"""The Landlock exec helper binary: compiled from landlock_exec.c with the system cc on first use, cached.

Owns finding or building `$PROCTOR_HOME/bin/landlock-exec-<source hash>`. It never runs the helper.

Why a compiled helper (measured on this machine, bench/confine.py and research/sandbox.md 2a): Landlock
must be applied inside bwrap (a Landlock-restricted process may not mount, so bwrap cannot start under it),
so `preexec_fn` is out for the bwrap path (and it is thread-unsafe). Measured for `true`, 100 interleaved
runs: plain 1.1 ms, this C helper 1.7 ms, a `python -I -S` helper with ctypes 16.0 ms; `preexec_fn` costs
2.8 ms empty and 2.9 ms applying Landlock, so it would only have served landlock-only jobs.
The cache lives under $PROCTOR_HOME, which jobs cannot write (and under bwrap see only this file of).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

SOURCE = Path(__file__).with_name("landlock_exec.c")
COMPILE_TIMEOUT_S = 60


@dataclass(frozen=True)
class Helper:
    path: Path | None
    reason: str  # why it is missing, or where it came from


def _trusted(path: Path) -> bool:
    st = path.stat()
    return st.st_uid == os.geteuid() and not st.st_mode & 0o022


def build(home: Path) -> Helper:
    try:
        source = SOURCE.read_bytes()
    except OSError as exc:
        return Helper(None, f"helper source missing: {exc}")
    target = home / "bin" / f"landlock-exec-{hashlib.sha256(source).hexdigest()[:16]}"
    try:
        if target.exists():
            return Helper(target, "cached") if _trusted(target) else Helper(None, f"{target} not trusted")
    except OSError as exc:
        return Helper(None, f"cannot stat {target}: {exc}")
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        return Helper(None, "no C compiler (cc) to build the Landlock helper")
    try:
        target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".landlock-exec-")
        os.close(fd)
        proc = subprocess.run([cc, "-O2", "-o", tmp, str(SOURCE)], capture_output=True, text=True,
                              timeout=COMPILE_TIMEOUT_S)
        if proc.returncode != 0:
            os.unlink(tmp)
            return Helper(None, f"cc failed: {proc.stderr.strip()[:300]}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)  # atomic: concurrent first uses all see a whole binary
    except (OSError, subprocess.SubprocessError) as exc:
        return Helper(None, f"cannot build the Landlock helper: {exc}")
    return Helper(target, f"built with {cc}")
