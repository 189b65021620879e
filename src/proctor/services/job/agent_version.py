"""Pinning the agent CLI's version in each result (`agent_version`): behaviour changes between versions.

Owns asking the CLI once per executable (path, mtime) and caching the answer for the life of the host.
It never fails a job (an unanswered version is None) and never runs the CLI itself: `--version` runs the
agent's code, so the host hands it to the same runner and confinement as the agent (found in review: a
job rewrote code inside its writable state dir, and the next job's unconfined probe ran it as root, with
a daemon that outlived the job). An executable inside a state dir is never cached: a job can rewrite it.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from proctor.mechanisms.adapters.spec import AdapterSpec

VERSION_TIMEOUT_S = 15
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
    code, out, err = probe([exe, *spec.version_args])
    line = (out or err).decode("utf-8", "replace").strip().splitlines()
    answer = line[0][:200] if code == 0 and line else None
    if not inside(exe, writable):
        _cache[key] = answer
    return answer
