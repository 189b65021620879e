"""Pinning the agent CLI's version in each result (`agent_version`): behaviour changes between versions.

Owns asking the CLI once per executable (path, mtime) and caching the answer for the life of the host.
It never fails a job: an unanswered version is None.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

from proctor.adapters.spec import AdapterSpec

VERSION_TIMEOUT_S = 15
_cache: dict[tuple[str, int, tuple[str, ...]], str | None] = {}


def agent_version(spec: AdapterSpec, env: Mapping[str, str], cwd: Path) -> str | None:
    """Asked in `cwd` (the job's private temp dir): even `--version` runs the agent's code, never in the
    host's own working directory."""
    if spec.version_args is None:
        return None
    exe = shutil.which(spec.command[0], path=env.get("PATH"))
    if exe is None:
        return None
    try:
        key = (exe, os.stat(exe).st_mtime_ns, spec.version_args)
    except OSError:
        return None
    if key not in _cache:
        try:
            p = subprocess.run([exe, *spec.version_args], cwd=cwd, env=dict(env), stdin=subprocess.DEVNULL,
                               capture_output=True, timeout=VERSION_TIMEOUT_S, start_new_session=True)
            line = (p.stdout or p.stderr).decode("utf-8", "replace").strip().splitlines()
            _cache[key] = line[0][:200] if p.returncode == 0 and line else None
        except (OSError, subprocess.SubprocessError):
            _cache[key] = None
    return _cache[key]
