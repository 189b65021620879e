"""What this machine can enforce, found by trying each mechanism once per process.

Owns Capabilities and detect(). It never decides what a job gets (plan.py does) and never creates anything
but the cached Landlock helper and the cgroup probe that proctor.mechanisms.confine.cgroup makes and removes.

Trying, not looking (research/sandbox.md, "Detection at startup"): a bwrap binary can exist while user
namespaces are disabled by sysctl, AppArmor or a container; the Landlock syscall can be compiled in and
disabled at boot. So bwrap runs a real sandbox, the helper confines a real `true`, the cgroup is a real mkdir.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from proctor.mechanisms.confine import cgroup
from proctor.mechanisms.confine import helper as helper_mod
from proctor.mechanisms.confine import landlock
from proctor.home import ensure_home

TRIAL_TIMEOUT_S = 10


@dataclass(frozen=True)
class Capabilities:
    bwrap: str | None  # path of a bwrap that ran a trial sandbox
    bwrap_version: str | None
    bwrap_reason: str
    landlock_abi: int  # 0: unusable
    landlock_reason: str
    helper: Path | None  # the Landlock exec helper, when it confined a trial `true`
    helper_reason: str
    helper_netns: bool  # the helper could make a network namespace (root without bwrap: UDP denial)
    cgroup: Path | None  # parent of job cgroups, when a trial mkdir worked
    uid: int

    @property
    def landlock(self) -> bool:
        return self.landlock_abi > 0 and self.helper is not None


def _run(argv: list[str]) -> tuple[bool, str]:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=TRIAL_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError) as exc:
        return False, str(exc)
    return p.returncode == 0, (p.stdout + p.stderr).strip()[:300]


def _bwrap() -> tuple[str | None, str | None, str]:
    path = shutil.which("bwrap")
    if path is None:
        return None, None, "bwrap not installed (Debian package bubblewrap)"
    ok, out = _run([path, "--version"])
    version = out.split()[-1] if ok and out else None
    ok, out = _run([path, "--ro-bind", "/", "/", "--unshare-all", "--unshare-user", "--cap-drop", "ALL", "true"])
    if not ok:
        return None, version, f"bwrap trial sandbox failed: {out or 'no output'}"
    return path, version, "trial sandbox ran"


def _helper(abi: int) -> tuple[Path | None, str, bool]:
    if abi == 0:
        return None, "no Landlock", False
    try:
        home = ensure_home()
    except OSError as exc:
        return None, f"cannot create $PROCTOR_HOME for the helper: {exc}", False
    built = helper_mod.build(home)
    if built.path is None:
        return None, built.reason, False
    trial = [str(built.path), str(landlock.handled_fs(abi)), "0", "0"]
    ok, out = _run([*trial, "0", f"{landlock.READ_ONLY}:/", "--", "true"])
    if not ok:
        return None, f"helper trial failed: {out}", False
    netns, _ = _run([*trial, "1", f"{landlock.READ_ONLY}:/", "--", "true"])
    return built.path, built.reason, netns


@cache
def detect() -> Capabilities:
    """Try every mechanism once; cached for the life of the process."""
    bwrap, version, bwrap_reason = _bwrap()
    abi, abi_reason = landlock.abi()
    helper, helper_reason, netns = _helper(abi)
    return Capabilities(bwrap, version, bwrap_reason, abi, abi_reason, helper, helper_reason, netns,
                        cgroup.parent_dir(), os.geteuid())
