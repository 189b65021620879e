"""Fakes for testing code that uses the queue (ours and yours): a trusted home and a probe agent.

Owns test scaffolding only: keys and a signers.toml written into a throw-away PROCTOR_HOME, and a fake agent
CLI that records when each run starts and ends, so a test can prove two runs never overlapped. It never
starts a server (use `proctor.mechanisms.queue.server.start`) and is never imported by the product.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from proctor.mechanisms.queue import keys
from proctor.mechanisms.queue.envelope import Ed25519Signer, HmacKey

PROBE_AGENT = '''#!{python}
"""Probe agent: argv[1] is the task; "sleep N" makes it run N seconds. Appends start/end lines (O_APPEND,
one write each, so concurrent runs interleave whole lines) to $PROBE_FILE and writes a file in its cwd."""
import json, os, signal, sys, time
probe = os.environ.get("PROBE_FILE") or {probe!r}
def mark(event, how=""):
    line = json.dumps({{"event": event, "how": how, "pid": os.getpid(), "t": time.time(), "cwd": os.getcwd()}})
    fd = os.open(probe, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, (line + "\\n").encode())
    os.close(fd)
def on_term(signum, frame):
    mark("end", "sigterm")  # the host kills with TERM first, so a killed run still records its end
    os._exit(143)
signal.signal(signal.SIGTERM, on_term)
mark("start")
words = sys.argv[1].split() if len(sys.argv) > 1 else []
seconds = float(words[words.index("sleep") + 1]) if "sleep" in words else 0.0
deadline = time.time() + seconds
while time.time() < deadline:
    time.sleep(0.05)
with open("agent-output.txt", "w") as fh:
    fh.write("done\\n")
mark("end", "completed")
print("finished")
'''


@dataclass(frozen=True)
class TrustedHome:
    home: Path
    sender: Ed25519Signer | HmacKey  # key "default": trusted for run_agent and noop, not validateCommand
    admin: Ed25519Signer | HmacKey  # key "admin": trusted for everything, validateCommand included
    stranger: Ed25519Signer | HmacKey  # key "stranger": not in signers.toml
    host: Ed25519Signer | HmacKey  # key "host": signs the listener's results


def trusted_home(home: Path) -> TrustedHome:
    made = {name: keys.generate(name, home=home) for name in ("default", "admin", "stranger", "host")}
    shared = keys.generate("fleet", alg="hmac-sha256", home=home)
    (home / "signers.toml").write_text(
        made["default"].signers_toml(("run_agent", "noop"))
        + "\n" + made["admin"].signers_toml(("run_agent", "noop"), may_set_validate_command=True)
        + "\n" + shared.signers_toml(("noop",))
    )
    return TrustedHome(home, *(keys.load(n, home) for n in ("default", "admin", "stranger", "host")))


def write_probe_agent(path: Path, probe_file: Path) -> Path:
    path.write_text(PROBE_AGENT.format(python=sys.executable, probe=str(probe_file)))
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def write_agent_config(path: Path, agent: Path) -> Path:
    # Confinement off: the probe file sits outside the worktree, and the tests are about the queue.
    path.write_text(f'confine = "off"\n\n[agents.fake]\ncommand = [{json.dumps(str(agent))}, "{{prompt}}"]\n'
                    'prompt = "argv"\n')
    return path


def read_probe(probe_file: Path) -> list[dict[str, object]]:
    if not probe_file.exists():
        return []
    return [json.loads(line) for line in probe_file.read_text().splitlines() if line.strip()]


def overlapping_runs(events: list[dict[str, object]]) -> bool:
    """True if some run started while another had started and not ended. A run that never recorded its
    end (SIGKILL without TERM) counts as running forever, so it fails the check: that is the safe side."""
    live: set[object] = set()
    for e in sorted(events, key=lambda e: float(e["t"])):  # type: ignore[arg-type]
        if e["event"] == "start":
            if live:
                return True
            live.add(e["pid"])
        else:
            live.discard(e["pid"])
    return False


@dataclass(frozen=True)
class ThrowawayCa:
    """A CA made for one test run, a server certificate for 127.0.0.1/localhost, a client certificate."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def throwaway_ca(folder: Path, *, client_name: str = "client") -> ThrowawayCa:
    """Files in `folder` (keys 0600): EC P-256, valid for a day, the server's for IP 127.0.0.1 and localhost."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write(stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> tuple[Path, Path]:
        cp, kp = folder / f"{stem}.pem", folder / f"{stem}-key.pem"
        cp.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        kp.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                         serialization.NoEncryption()))
        kp.chmod(0o600)
        return cp, kp

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (x509.CertificateBuilder().subject_name(name("proctor test CA")).issuer_name(name("proctor test CA"))
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                            content_commitment=False, key_encipherment=False, data_encipherment=False,
                                            key_agreement=False, encipher_only=False, decipher_only=False),
                              critical=True)
               .sign(ca_key, hashes.SHA256()))
    ca_path, _ = write("ca", ca_cert, ca_key)

    def leaf(cn: str, usage: x509.ObjectIdentifier, san: list[x509.GeneralName]) -> tuple[Path, Path]:
        key = ec.generate_private_key(ec.SECP256R1())
        b = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(ca_cert.subject)
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        if san:
            b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return write(cn, b.sign(ca_key, hashes.SHA256()), key)

    server_cert, server_key = leaf("server", ExtendedKeyUsageOID.SERVER_AUTH,
                                   [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")])
    client_cert, client_key = leaf(client_name, ExtendedKeyUsageOID.CLIENT_AUTH, [])
    return ThrowawayCa(ca_path, server_cert, server_key, client_cert, client_key)


def wait_for(pred, timeout_s: float, what: str):  # type: ignore[no-untyped-def]
    """`pred()`'s first truthy value, polled every 50 ms; an AssertionError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def runs_started(probe_file: Path) -> list[dict[str, object]]:
    return [e for e in read_probe(probe_file) if e["event"] == "start"]


def nkey_user(folder: Path, name: str) -> tuple[Path, str]:
    """A new NKEY user: its seed file (0600) in `folder` and its public key (U...), for a server's config."""
    import nkeys  # only here: a test of NKEY auth needs it, the rest of this module does not

    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    path = folder / f"{name}.nk"
    path.write_bytes(seed)
    path.chmod(0o600)
    return path, nkeys.from_seed(bytearray(seed)).public_key.decode()


PROCTOR_CLI = [sys.executable, "-c", "from proctor.surfaces.cli import main; main()"]


class Listeners:
    """`proctor listen` child processes a test starts, all running run_agent jobs with `config`; `stop()`
    ends every one still running (TERM, then KILL after `wait_s`)."""

    def __init__(self, config: Path) -> None:
        self.config = config
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, host: str, url: str, *, ack_wait_s: float, lanes: str | None = None,
              env: dict[str, str] | None = None, stderr: int = subprocess.PIPE) -> subprocess.Popen[bytes]:
        argv = [*PROCTOR_CLI, "listen", "--host", host, *(("--lanes", lanes) if lanes else ()),
                "--ack-wait", str(ack_wait_s), "--config", str(self.config), "--queue", url]
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
        self.procs.append(proc)
        return proc

    def stop(self, wait_s: float = 15.0) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(wait_s)
                except subprocess.TimeoutExpired:
                    proc.kill()


@dataclass
class FleetServer:
    """A TLS fleet server for tests: hosts A and B on lane `default`, the senders given, an admin."""

    url: str
    settings: object  # proctor.mechanisms.config.load.QueueSettings for a client of this server
    ids: dict[str, tuple[Path, str]]  # name -> (nkey seed file, public key)
    ca: ThrowawayCa
    handle: object  # proctor.mechanisms.queue.server's handle: .stop()


def start_fleet(folder: Path, senders: dict[str, list[str] | None]) -> FleetServer:
    """A real nats-server with the fleet's config (TLS with client certs, one NKEY per identity), its two
    lanes made by the admin. `senders`: name -> the hosts it may enqueue for (None: any)."""
    import asyncio

    from proctor.mechanisms.config.model import QueueSettings
    from proctor.mechanisms.queue import connection, server
    from proctor.mechanisms.queue.fleet import Fleet, Tls
    from proctor.mechanisms.queue.jetstream import JetStreamBackend

    ca = throwaway_ca(folder / "pki")
    ids = {n: nkey_user(folder, n) for n in ("admin", "hostA", "hostB", *senders)}
    fleet = Fleet(admin=ids["admin"][1],
                  hosts={"hostA": (ids["hostA"][1], ["default"]), "hostB": (ids["hostB"][1], ["default"])},
                  senders={n: (ids[n][1], hosts) for n, hosts in senders.items()},
                  tls=Tls(str(ca.server_cert), str(ca.server_key), str(ca.ca)))
    conf = folder / "fleet.conf"
    conf.write_text(json.dumps(fleet.server_config()))
    handle = server.start(folder / "store", config_file=conf)
    url = handle.url.replace("nats://", "tls://")
    settings = QueueSettings(tls_ca=str(ca.ca), tls_cert=str(ca.client_cert), tls_key=str(ca.client_key))

    async def lanes() -> None:
        admin = await JetStreamBackend.connect(url, **connection.options(url, settings, folder),
                                               nkeys_seed=str(ids["admin"][0]))
        for host in ("hostA", "hostB"):
            await admin.ensure_lane(host, "default", slots=1, ack_wait_s=30)
        await admin.close()

    asyncio.run(lanes())
    return FleetServer(url, settings, ids, ca, handle)
