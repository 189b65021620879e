"""`proctor keys show|generate` suggest the trust entry for the key's role (issue 15, item 1), proven the way a
person uses it: the printed snippet pasted into a real signers.toml, a real `proctor listen` on a real
nats-server, and `proctor send`/`proctor job` in another home. The host key's `[hosts.NAME]` entry makes the
sender accept the listener's signed result; the `[signers.host]` entry it used to print does not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

PROCTOR = [sys.executable, "-c", "from proctor.surfaces.cli import main; main()"]
HOST = "keyshost"


def proctor(home: Path, *args: str, timeout: float = 60) -> tuple[int, str, str]:
    p = subprocess.run([*PROCTOR, *args], capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "PROCTOR_HOME": str(home)})
    assert "Traceback" not in p.stdout + p.stderr, p.stdout + p.stderr
    return p.returncode, p.stdout, p.stderr


def shown(home: Path, *args: str) -> dict:
    code, out, err = proctor(home, "keys", *args)
    assert code == 0, err
    return json.loads(out)


def test_a_host_keys_snippet_makes_a_sender_trust_its_results_and_the_old_one_does_not(nats_url, tmp_path):
    listener_home, sender_home = tmp_path / "listener", tmp_path / "sender"
    host_key = shown(listener_home, "generate", "--name", "host", "--host", HOST)
    assert host_key["role"] == "host" and host_key["hostName"] == HOST
    assert host_key["signersToml"].startswith(f"[hosts.{HOST}]\n") and "[signers." not in host_key["signersToml"]
    assert shown(listener_home, "show", "--name", "host", "--host", HOST)["signersToml"] == host_key["signersToml"]
    sender_key = shown(sender_home, "generate", "--kinds", "noop,run_agent")
    assert sender_key["role"] == "sender" and sender_key["signersToml"].startswith("[signers.default]\n")
    assert tomllib.loads(sender_key["signersToml"])["signers"]["default"]["kinds"] == ["noop", "run_agent"]
    assert "hosts" not in tomllib.loads(sender_key["signersToml"])
    # Each home gets the other's snippet, pasted as printed.
    (listener_home / "signers.toml").write_text(sender_key["signersToml"])
    (sender_home / "signers.toml").write_text(host_key["signersToml"])
    assert not (sender_home / "keys" / "host.key").exists()  # no local host key to fall back on
    listener = subprocess.Popen([*PROCTOR, "listen", "--host", HOST, "--ack-wait", "10", "--queue", nats_url],
                                env={**os.environ, "PROCTOR_HOME": str(listener_home)},
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        payload = tmp_path / "noop.json"
        payload.write_text("{}")
        code, out, err = proctor(sender_home, "send", "--targets", HOST, "--kind", "noop", "--payload-file",
                                 str(payload), "--queue", nats_url, "--wait", "60", timeout=120)
    finally:
        listener.terminate()
        listener.wait(10)
    res = json.loads(out)
    assert code == 0 and res["verified"] is True and res["result"]["status"] == "completed", (out, err)
    job_id = res["jobId"]

    def job() -> dict:
        code, out, err = proctor(sender_home, "job", job_id, "--queue", nats_url)
        assert code == 0, err
        return json.loads(out)

    assert job()["state"] == "done" and job()["verified"] is True
    # The entry `keys show --name host` used to print, pasted instead: the same signed result is not taken.
    old = shown(listener_home, "show", "--name", "host", "--role", "sender")["signersToml"]
    assert old.startswith("[signers.host]\n")
    (sender_home / "signers.toml").write_text(old)
    wrong = job()
    assert wrong["state"] != "done" and wrong["verified"] is False and "result" not in wrong, wrong
    assert wrong["error"].startswith("UNTRUSTED_SIGNER"), wrong
    # And back: the right snippet again, the same result verifies (the control for the line above).
    (sender_home / "signers.toml").write_text(host_key["signersToml"])
    assert job()["verified"] is True


def test_a_key_of_unknown_role_prints_both_entries_labelled_and_pasted_whole_grants_nothing(tmp_path):
    home = tmp_path / "home"
    laptop = shown(home, "generate", "--name", "laptop", "--host", HOST, "--kinds", "noop")
    assert laptop["role"] is None
    by_role = {e["role"]: e for e in laptop["entries"]}
    assert set(by_role) == {"sender", "host"}
    assert "runs jobs this key signs" in by_role["sender"]["grants"]
    assert "accepts the results" in by_role["host"]["grants"] and HOST in by_role["host"]["grants"]
    # Each labelled entry is exactly what naming the role prints.
    assert by_role["host"]["toml"] == shown(home, "show", "--name", "laptop", "--role", "host",
                                            "--host", HOST)["signersToml"]
    assert by_role["sender"]["toml"] == shown(home, "show", "--name", "laptop", "--role", "sender",
                                              "--kinds", "noop")["signersToml"]
    text = laptop["signersToml"]
    assert "not known" in text and "uncomment ONE" in text
    assert tomllib.loads(text) == {}  # all commented: pasting it whole trusts the key for nothing
    uncommented = tomllib.loads("\n".join(line[2:] for line in text.splitlines() if line.startswith("# [")
                                          or line.startswith("# public_key") or line.startswith("# kinds")
                                          or line.startswith("# may_set")))
    assert set(uncommented) == {"signers", "hosts"}  # control: the commented lines are the real entries


def test_bad_trust_flags_are_one_line_errors_and_make_no_key(tmp_path):
    home = tmp_path / "home"
    code, _, err = proctor(home, "keys", "generate", "--kinds", "shell")
    assert code == 2 and err.startswith("proctor: --kinds") and not (home / "keys" / "default.key").exists()
    code, _, err = proctor(home, "keys", "generate", "--name", "host", "--host", "bad.name")
    assert code == 2 and "--host NAME" in err and not (home / "keys" / "host.key").exists()
    # Control: the same calls with good flags make the keys.
    assert proctor(home, "keys", "generate", "--kinds", "noop")[0] == 0
    assert proctor(home, "keys", "generate", "--name", "host", "--host", "good-name")[0] == 0
    assert (home / "keys" / "default.key").exists() and (home / "keys" / "host.key").exists()

