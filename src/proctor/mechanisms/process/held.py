"""A child forked into its job group ahead of its exec, held until the host releases it.

Owns `Held`: the preexec a `Popen` runs in the child, and the release. Why: joining a cgroup takes the kernel's
cgroup_threadgroup_rwsem for writing, which waits out an RCU grace period when no other join came just before
(13-18 ms of every job on this hybrid v1/v2 host; a clone3 straight into the group would avoid it, and Python
cannot make one). A held child pays that wait while the host walks the disk baseline, not after it.

What the held child may do between fork and exec is what makes it safe to keep for that long:
- it first drops every fd it inherited but its own three and its two pipes, so no other thread's pipe (and no
  other job's) waits on it for an EOF; that also closes Popen's error pipe, so `Popen` returns at once;
- it puts back the default action of every signal the host handles in Python: a TERM meant for the host ends
  the held child as a signal (exit -15), never through the host's handler into an exit of 0;
- it joins the group, reads one byte ("1": exec; anything else, or an EOF when the host is gone: `_exit`),
  and execs itself, searching PATH as Popen does; an exec that fails writes its errno back on a
  close-on-exec pipe, which the host turns into the OSError Popen would have raised.
"""

from __future__ import annotations

import errno as errnos
import os
import signal
from collections.abc import Mapping, Sequence

from proctor.mechanisms.confine.cgroup import JobGroup

NOT_LAUNCHED = 255  # the held child's exit when it is told not to exec, or its exec failed


class Held:
    def __init__(self, argv: Sequence[str], env: Mapping[str, str], group: JobGroup) -> None:
        self.argv = list(argv)
        self.env = dict(env)
        exe = self.argv[0]
        # Popen's own search: a name without a slash is looked for on the child's PATH, in order.
        self._paths = [exe] if os.path.dirname(exe) else [os.path.join(d, exe) for d in os.get_exec_path(self.env)]
        self._group = group
        self._gate_r, self._gate_w = os.pipe2(os.O_CLOEXEC)
        self._report_r, self._report_w = os.pipe2(os.O_CLOEXEC)
        self._max_fd = max(os.sysconf("SC_OPEN_MAX"), 1024)

    def preexec(self) -> None:
        """Runs in the forked child (after Popen's dup2, chdir and setsid); returns only by exec or _exit."""
        for sig in signal.valid_signals():
            try:
                if callable(signal.getsignal(sig)):
                    signal.signal(sig, signal.SIG_DFL)
            except (OSError, ValueError):
                pass
        keep = sorted({self._gate_r, self._report_w, *self._group.fds()})
        low = 3
        for fd in keep:
            os.closerange(low, fd)
            low = fd + 1
        os.closerange(low, self._max_fd)
        self._group.join_child()
        for fd in self._group.fds():
            os.close(fd)
        try:
            go = os.read(self._gate_r, 1)
        except OSError:
            go = b""
        if go != b"1":
            os._exit(NOT_LAUNCHED)
        failed = last = 0
        for path in self._paths:
            try:
                os.execve(path, self.argv, self.env)
            except OSError as exc:
                # The first error that is not "not here" is the one reported, as Popen's child does.
                if exc.errno not in (errnos.ENOENT, errnos.ENOTDIR) and not failed:
                    failed = exc.errno
                last = exc.errno
        try:
            os.write(self._report_w, str(failed or last or errnos.ENOENT).encode())
        finally:
            os._exit(NOT_LAUNCHED)

    def forked(self) -> None:
        """In the host, once Popen returned: its copies of the child's ends go."""
        os.close(self._gate_r)
        os.close(self._report_w)

    def release(self, go: bool) -> OSError | None:
        """Tell the child to exec (`go`) or to end. After a go: None once it exec'd, or the error its exec
        failed with (it has exited; the caller reaps it). Also the cleanup when Popen itself failed."""
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
        if report.isdigit():
            code = int(report)
            return OSError(code, os.strerror(code), self.argv[0])
        return None

    def abandon(self) -> None:
        """Popen failed before the child could take its ends: all four go."""
        for fd in (self._gate_r, self._gate_w, self._report_r, self._report_w):
            try:
                os.close(fd)
            except OSError:
                pass
