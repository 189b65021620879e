"""Pinning the agent CLI's version in each result (`agent_version`): behaviour changes between versions.

Owns asking the CLI once per executable (path, mtime) and caching the answer for the life of the host, and
beyond it in $PROCTOR_HOME/agent-versions.json, keyed on the executable's identity (real path, device, inode,
size, mtime and ctime, which no unprivileged process can set back): each `proctor run-agent` is a process of
its own, and `gemini --version` alone took 1.7 s of every gemini job (issue 25). It never fails a job (an
unanswered version is None, and is not kept in the file: a probe that timed out under load is asked again)
and never runs the CLI itself: `--version` runs the agent's code, so the host hands it to the same runner
and confinement as the agent (found in review: a job rewrote code inside its writable state dir, and the next
job's unconfined probe ran it as root, with a daemon that outlived the job). An executable inside a state
dir is never cached: a job can rewrite it.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from proctor.home import proctor_home
from proctor.mechanisms import atomic
from proctor.mechanisms.adapters.spec import AdapterSpec
from proctor.mechanisms.validation.capped import read_capped
from proctor.services.job.record import unsafe_home

VERSION_TIMEOUT_S = 15
KEPT = 64  # executables whose answer the file keeps (the newest)
MAX_FILE = 256 * 1024
# (argv) -> (exit code or None, stdout + stderr); the host's confined, cgroup-joined, stop-checked spawn.
Probe = Callable[[list[str]], tuple[int | None, bytes, bytes]]
_cache: dict[tuple[str, int, tuple[str, ...]], str | None] = {}


def executable(spec: AdapterSpec, env: Mapping[str, str]) -> str | None:
    return shutil.which(spec.command[0], path=env.get("PATH"))


def inside(path: str, dirs: Sequence[Path]) -> bool:
    real = Path(os.path.realpath(path))
    return any(real == d or d in real.parents for d in (Path(os.path.realpath(x)) for x in dirs))


def agent_version(spec: AdapterSpec, env: Mapping[str, str], probe: Probe,
                  writable: Sequence[Path] = ()) -> str | None:
    if spec.version_args is None:
        return None
    exe = executable(spec, env)
    if exe is None:
        return None
    try:
        key = (exe, os.stat(exe).st_mtime_ns, spec.version_args)
    except OSError:
        return None
    if key in _cache:
        return _cache[key]
    cacheable = not inside(exe, writable)
    kept = _identity(exe, spec.version_args) if cacheable else None
    if kept is not None:
        answer = _read().get(kept)
        if isinstance(answer, str):
            _cache[key] = answer
            return answer
    code, out, err = probe([exe, *spec.version_args])
    line = (out or err).decode("utf-8", "replace").strip().splitlines()
    answer = line[0][:200] if code == 0 and line else None
    if cacheable:
        _cache[key] = answer
        if kept is not None and answer is not None:
            _keep(kept, answer)
    return answer


def _identity(exe: str, version_args: Sequence[str]) -> str | None:
    try:
        real = os.path.realpath(exe)
        st = os.stat(real)
    except OSError:
        return None
    return json.dumps([real, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, *version_args])


def _file() -> Path:
    return proctor_home() / "agent-versions.json"


def _read() -> dict[str, object]:
    """The kept answers; {} when the file is missing, not a regular file, too big or not a JSON object."""
    data = read_capped(_file(), MAX_FILE)
    try:
        value = json.loads(data) if data else None
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _keep(kept: str, answer: str) -> None:
    """Add one answer, replacing the file atomically; only into a state dir that is this user's alone (a
    shared one could feed the next job a version). A write that fails costs the next job a probe, no more."""
    if unsafe_home() is not None:
        return
    entries = {k: v for k, v in _read().items() if k != kept and isinstance(v, str)}
    entries[kept] = answer
    entries = dict(list(entries.items())[-KEPT:])
    try:
        atomic.write(_file(), json.dumps(entries).encode("utf-8"))
    except OSError:
        pass
