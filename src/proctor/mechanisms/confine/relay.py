"""The egress relay for bwrap without the Landlock helper: the system python3 runs a small script inside
the sandbox that listens on 127.0.0.1:PORT, forks a relay to the proxy's Unix socket, and execs the agent.

Owns that script and its argv, the relay's port, and the proxy variables that point a CLI at whichever relay
runs (`proxy_env`). With the helper (bwrap+landlock, landlock) the helper's own relay (landlock_exec.c) is
used instead: 1.7 ms against ~20 ms for a python start. The script is passed with
`-c`, never as a file: proctor's source may sit under /tmp, which the sandbox replaces with a private tmpfs.
The relay dies with the sandbox: bwrap's pid namespace ends when the agent (its first process) exits.
"""

from __future__ import annotations

import shutil

RELAY_PORT = 3128  # the relay's port inside a private network namespace

SCRIPT = r"""
import os, socket, sys, threading
port, path, argv = int(sys.argv[1]), sys.argv[2], sys.argv[4:]
ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
ls.bind(("127.0.0.1", port))
ls.listen(64)
if os.fork() == 0:
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.closerange(3, ls.fileno())
    os.closerange(ls.fileno() + 1, 65536)

    def pump(a, b):
        try:
            while True:
                data = a.recv(65536)
                if not data:
                    break
                b.sendall(data)
        except OSError:
            pass
        try:
            b.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def serve(c):
        u = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            u.connect(path)
        except OSError:
            c.close()
            return
        t = threading.Thread(target=pump, args=(u, c), daemon=True)
        t.start()
        pump(c, u)
        t.join()
        c.close()
        u.close()

    while True:
        try:
            c, _ = ls.accept()
        except OSError:
            continue
        threading.Thread(target=serve, args=(c,), daemon=True).start()
ls.close()
os.execvp(argv[0], argv)
"""


def system_python() -> str | None:
    """A python3 the read-only root shows inside the sandbox (never the venv's, which may be hidden)."""
    return shutil.which("python3", path="/usr/bin:/bin")


def relay_argv(python: str, port: int, socket_path: str) -> list[str]:
    """The prefix that starts the relay, then execs what follows (the caller appends the agent argv)."""
    return [python, "-I", "-S", "-c", SCRIPT, str(port), socket_path, "--"]


PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def proxy_env(port: int | None) -> dict[str, str]:
    """What points a CLI at the relay: every spelling of the proxy variables, and no bypass list. With port
    None (the relay takes any free port) the Landlock helper sets the proxy variables itself before exec."""
    env = {"NO_PROXY": "", "no_proxy": "", "NODE_USE_ENV_PROXY": "1"}
    if port is not None:
        env.update({k: f"http://127.0.0.1:{port}" for k in PROXY_VARS})
    return env
