"""A child forked into its job group ahead of its exec, held until the host releases it.

Owns `Held`: the preexec a `Popen` runs in the child, and the release. Why: joining a cgroup takes the kernel's
cgroup_threadgroup_rwsem for writing, which waits out an RCU grace period when no other join came just before
(13-18 ms of every job on this hybrid v1/v2 host; a clone3 straight into the group would avoid it, and Python
cannot make one). A held child pays that wait while the host walks the disk baseline, not after it.

What the held child may do between fork and exec is what makes it safe to keep for that long:
- it first drops every fd it inherited but its own three and its two pipes, so no other thread's pipe (and no
  other job's) waits on it for an EOF; that also closes Popen's error pipe, so `Popen` returns at once;
- it puts back the default action of every signal the host handles in Python (the host blocks signals across
  the fork, so none is handled in between): a TERM meant for the host ends the held child as a signal
  (exit -15), never through the host's handler into an exit of 0;
- it joins the group, reads one byte ("1": exec; anything else, or an EOF when the host is gone: `_exit`),
  and execs itself, searching PATH as Popen does; an exec that fails writes its errno back on a
  close-on-exec pipe, which the host turns into the OSError Popen would have raised (a failed join, or
  anything else that fails in the child after its fds are gone, comes back the same way: a spawn error,
  never a launched run that exited 255).
"""

from __future__ import annotations

import errno as errnos
import fcntl
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence

from proctor.mechanisms.confine.cgroup import JobGroup

NOT_LAUNCHED = 255  # the held child's exit when it is told not to exec, or its exec failed


def _above_stdio(fd: int) -> int:
    """`fd` moved to 3 or above: a host started with 0, 1 or 2 closed gets them back from pipe2, and Popen's
    dup2 onto the child's stdio would overwrite them."""
    if fd >= 3:
        return fd
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
    os.close(fd)
    return moved


class Held:
    """One held child: built and forked (`preexec` as Popen's preexec_fn) under the runner's lock, `forked`
    once Popen returned, then `release`d with a go or a no; `abandon` when Popen failed."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str], group: JobGroup) -> None:
        self.argv = list(argv)
        self.env = dict(env)
        exe = self.argv[0]
        # Popen's own search: a name without a slash is looked for on the child's PATH, in order.
        self._paths = [exe] if os.path.dirname(exe) else [os.path.join(d, exe) for d in os.get_exec_path(self.env)]
        self._group = group
        self._gate_r, self._gate_w = map(_above_stdio, os.pipe2(os.O_CLOEXEC))
        self._report_r, self._report_w = map(_above_stdio, os.pipe2(os.O_CLOEXEC))
        self._max_fd = max(os.sysconf("SC_OPEN_MAX"), 1024)
        self._mask: set[signal.Signals] = set()

    def block_signals(self) -> None:
        """In the host, right before Popen: a signal that reached the child between its fork and the reset of
        its handlers would run the host's handler there (signal.signal runs what is pending). Held back until
        the child's handlers are the defaults; `unblock_signals` after Popen returns."""
        self._mask = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())

    def unblock_signals(self) -> None:
        signal.pthread_sigmask(signal.SIG_SETMASK, self._mask)

    def preexec(self) -> None:
        """Runs in the forked child (after Popen's dup2, chdir and setsid); returns only by exec or _exit. What
        fails before the fds are closed is Popen's to report; after, it is written on the report pipe."""
        for sig in signal.valid_signals():
            try:
                if callable(signal.getsignal(sig)):
                    signal.signal(sig, signal.SIG_DFL)
            except (OSError, ValueError):
                pass
        signal.pthread_sigmask(signal.SIG_SETMASK, self._mask)
        keep = sorted(fd for fd in {self._gate_r, self._report_w, *self._group.fds()} if fd >= 3)
        low = 3
        for fd in keep:
            os.closerange(low, fd)
            low = fd + 1
        os.closerange(low, self._max_fd)
        report = b"X"
        try:
            try:
                self._group.join_child()
            except OSError as exc:
                report = b"J%d" % (exc.errno or errnos.EIO)
                raise
            for fd in self._group.fds():
                os.close(fd)
            go = os.read(self._gate_r, 1)
            if go != b"1":
                report = b""
                os._exit(NOT_LAUNCHED)
            failed = last = 0
            for path in self._paths:
                try:
                    os.execve(path, self.argv, self.env)
                except OSError as exc:
                    # The first error that is not "not here" is the one reported, as Popen's child does.
                    if exc.errno not in (errnos.ENOENT, errnos.ENOTDIR) and not failed:
                        failed = exc.errno
                    last = exc.errno or 0
            report = b"E%d" % (failed or last or errnos.ENOENT)
        except BaseException:  # noqa: BLE001 - nothing may return into the host's code from here
            pass
        try:
            if report:
                os.write(self._report_w, report)
        finally:
            os._exit(NOT_LAUNCHED)

    def forked(self) -> None:
        """In the host, once Popen returned: its copies of the child's ends go."""
        os.close(self._gate_r)
        os.close(self._report_w)

    def release(self, go: bool) -> OSError | subprocess.SubprocessError | None:
        """Tell the child to exec (`go`) or to end. After a go: None once it exec'd, or why it did not (it has
        exited; the caller reaps it): the OSError its exec failed with, as Popen raises it, or the failure
        of its group join or of anything else in it."""
        try:
            os.write(self._gate_w, b"1" if go else b"0")
        except OSError:
            pass  # the child is gone already: its exit status says how
        finally:
            os.close(self._gate_w)
        try:
            report = b""
            while go:
                chunk = os.read(self._report_r, 64)
                if not chunk:
                    break
                report += chunk
        finally:
            os.close(self._report_r)
        if report[:1] == b"E" and report[1:].isdigit():
            code = int(report[1:])
            return OSError(code, os.strerror(code), self.argv[0])
        if report[:1] == b"J" and report[1:].isdigit():
            code = int(report[1:])
            return subprocess.SubprocessError(f"joining the job group failed: [Errno {code}] {os.strerror(code)}")
        if report:
            return subprocess.SubprocessError("the held child failed before its exec")
        return None

    def abandon(self) -> None:
        """Popen failed before the child could take its ends: all four go."""
        for fd in (self._gate_r, self._gate_w, self._report_r, self._report_w):
            try:
                os.close(fd)
            except OSError:
                pass
