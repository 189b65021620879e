"""Fakes for testing code that uses the queue (ours and yours): a trusted home and a probe agent.

Owns test scaffolding only: keys and a signers.toml written into a throw-away PROCTOR_HOME, and a fake agent
CLI that records when each run starts and ends, so a test can prove two runs never overlapped. It never
starts a server (use `proctor.queue.server.start`) and is never imported by the product.
"""

from __future__ import annotations

import json
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

from proctor.queue import keys
from proctor.queue.envelope import Ed25519Signer, HmacKey

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
