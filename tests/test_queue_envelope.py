"""Unit tests: envelopes, keys, trusted signers, signed results, sender-side validation (no server)."""

from __future__ import annotations

import base64
import json
import stat
import time

import pytest
from click.testing import CliRunner

from proctor.surfaces.cli import main
from proctor.contract import RunAgentResult, Status
from proctor.mechanisms.queue import keys, sender
from proctor.mechanisms.queue.envelope import EnvelopeError, Opened, canonical_json, job_fields, seal, unseal, verify
from proctor.services.listen.checks import Accepted, Refusal, Refused, check_envelope
from proctor.mechanisms.queue.results import open_result, seal_result
from proctor.mechanisms.queue.signers import TrustFileError, load_trust
from proctor.mechanisms.queue.testing import trusted_home

PAYLOAD = {"agent": "fake", "task": "do it", "repo": "/tmp/r", "ticket": "T-1"}


def envelope(signer, **over):
    fields = job_fields(kind="run_agent", target="hostA", lane="default", payload=PAYLOAD, signer_kid=signer.kid,
                        ttl_s=600)
    fields.update(over)
    return seal(fields, signer).to_wire()


def check(raw, trust, kinds=frozenset({"run_agent", "noop"})):
    return check_envelope(raw, trust=trust, host="hostA", lane="default", kinds=kinds, now=time.time(), skew_s=5.0)


def test_canonical_json_is_sorted_and_compact():
    assert canonical_json({"b": 1, "a": [1, {"d": "é", "c": None}]}) == '{"a":[1,{"c":null,"d":"é"}],"b":1}'.encode()


def test_ed25519_and_hmac_round_trip_and_tamper(proctor_home):
    th = trusted_home(proctor_home)
    for key in (th.sender, keys.load("fleet", proctor_home)):
        sealed = seal({"x": 1, "signer": key.kid}, key)
        env = unseal(sealed.to_wire())
        assert isinstance(verify(env, key.verifier() if hasattr(key, "verifier") else key), Opened)
        doc = json.loads(sealed.to_wire())
        doc["body"] = base64.b64encode(canonical_json({"x": 2, "signer": key.kid})).decode()
        tampered = unseal(json.dumps(doc).encode())
        bad = verify(tampered, key.verifier() if hasattr(key, "verifier") else key)
        assert isinstance(bad, EnvelopeError) and bad.code == "FORGED"


@pytest.mark.parametrize("raw", [b"", b"[]", b'{"v":1}', b'{"v":1,"alg":"ed25519","body":"!!","sig":"x"}',
                                 b'{"v":2,"alg":"ed25519","body":"","sig":""}', b"\xff" * 10])
def test_unseal_never_raises(raw):
    assert isinstance(unseal(raw), EnvelopeError)


def test_key_files_are_private_and_show_prints_no_secret(proctor_home):
    res = CliRunner().invoke(main, ["keys", "generate"])
    assert res.exit_code == 0, res.output
    path = keys.key_path("default", proctor_home)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    shown = json.loads(CliRunner().invoke(main, ["keys", "show"]).output)
    private = json.loads(path.read_text())["private"]
    assert shown["kid"].startswith("ed25519:") and private not in json.dumps(shown)
    assert "[signers.default]" in shown["signersToml"]
    again = CliRunner().invoke(main, ["keys", "generate"])
    assert again.exit_code == 2 and "already exists" in again.output


def test_trust_file_errors_are_clear(proctor_home):
    (proctor_home / "signers.toml").write_text('[signers.x]\npublic_key = "nope"\n')
    with pytest.raises(TrustFileError, match="signers.x"):
        load_trust(proctor_home)


def test_checks_refuse_each_failure_with_a_control(proctor_home):
    th = trusted_home(proctor_home)
    trust = load_trust(proctor_home)
    assert isinstance(check(envelope(th.sender), trust), Accepted)  # the control
    cases = {
        Refusal.UNTRUSTED_SIGNER: envelope(th.stranger),
        Refusal.MISTARGETED: envelope(th.sender, target="hostB"),
        Refusal.MISROUTED: envelope(th.sender, lane="gpu"),
        Refusal.EXPIRED: envelope(th.sender, issuedAt=1, expiresAt=2),
        Refusal.NOT_YET_VALID: envelope(th.sender, issuedAt=4_000_000_000, expiresAt=4_000_000_600),
        Refusal.OVER_PRIVILEGED: envelope(th.sender, payload={**PAYLOAD, "validateCommand": "make test"}),
        Refusal.INVALID_REQUEST: envelope(th.sender, payload={**PAYLOAD, "ticket": "bad ticket"}),
        Refusal.KIND_NOT_ALLOWED: envelope(th.sender, kind="shell"),
        Refusal.MALFORMED: envelope(th.sender, jobId="a.b"),
    }
    for code, raw in cases.items():
        got = check(raw, trust)
        assert isinstance(got, Refused) and got.code is code, (code, got)
    unknown = check(envelope(th.sender, kind="noop", payload={}), trust, kinds=frozenset({"run_agent"}))
    assert isinstance(unknown, Refused) and unknown.code is Refusal.UNKNOWN_KIND
    # validateCommand from a signer allowed it is accepted: the control for over-privileged
    assert isinstance(check(envelope(th.admin, payload={**PAYLOAD, "validateCommand": "make test"}), trust), Accepted)
    # the shared-secret signer is trusted for noop only
    fleet = keys.load("fleet", proctor_home)
    got = check(envelope(fleet), trust)
    assert isinstance(got, Refused) and got.code is Refusal.KIND_NOT_ALLOWED
    assert isinstance(check(envelope(fleet, kind="noop", payload={}), trust), Accepted)


def test_forged_signature_is_refused(proctor_home):
    th = trusted_home(proctor_home)
    doc = json.loads(envelope(th.sender))
    body = json.loads(base64.b64decode(doc["body"]))
    body["payload"]["task"] = "something else"
    doc["body"] = base64.b64encode(canonical_json(body)).decode()
    got = check(json.dumps(doc).encode(), load_trust(proctor_home))
    assert isinstance(got, Refused) and got.code is Refusal.FORGED and not got.authentic


def test_result_is_bound_to_host_job_and_envelope_and_tamper_is_rejected(proctor_home):
    th = trusted_home(proctor_home)
    trust = load_trust(proctor_home)
    result = RunAgentResult(status=Status.completed, summary="ok", agent="fake")
    raw = seal_result(job_id="j1", host="hostA", result=result, signer=th.host, envelope="d" * 64).to_wire()
    ok = open_result(raw, trust, host="hostA", job_id="j1", envelope="d" * 64)
    assert not isinstance(ok, EnvelopeError) and ok.result.status is Status.completed and ok.envelope == "d" * 64
    assert open_result(raw, trust, host="hostA", job_id="j2", envelope="d" * 64).code == "MISMATCHED"
    assert open_result(raw, trust, host="hostB", job_id="j1", envelope="d" * 64).code == "MISMATCHED"
    # Same host, same job id, another envelope (say a noop that reused the id): not this envelope's answer.
    assert open_result(raw, trust, host="hostA", job_id="j1", envelope="e" * 64).code == "MISMATCHED"
    unbound = seal_result(job_id="j1", host="hostA", result=result, signer=th.host, envelope=None).to_wire()
    assert open_result(unbound, trust, host="hostA", job_id="j1", envelope="d" * 64).code == "UNBOUND"
    doc = json.loads(raw)
    body = json.loads(base64.b64decode(doc["body"]))
    body["result"]["status"] = "failed"
    doc["body"] = base64.b64encode(canonical_json(body)).decode()
    assert open_result(json.dumps(doc).encode(), trust, host="hostA", job_id="j1", envelope="d" * 64).code == "FORGED"
    by_stranger = seal_result(job_id="j1", host="hostA", result=result, signer=th.stranger, envelope="d" * 64).to_wire()
    assert open_result(by_stranger, trust, host="hostA", job_id="j1", envelope="d" * 64).code == "FORGED"


def test_sender_rejects_a_malformed_payload_before_enqueue(proctor_home):
    th = trusted_home(proctor_home)
    bad = sender.build(targets=["hostA"], kind="run_agent", lane="default", payload={"agent": "x"}, signer=th.sender)
    assert isinstance(bad, sender.Rejected) and any("task" in e for e in bad.errors)
    assert isinstance(sender.build(targets=["bad host"], kind="noop", lane="default", payload={}, signer=th.sender),
                      sender.Rejected)
    two = sender.build(targets=["a", "b"], kind="run_agent", lane="default", payload=PAYLOAD, signer=th.sender)
    assert not isinstance(two, sender.Rejected) and len({json.loads(s.body)["jobId"] for s in two}) == 2


def test_enqueue_cli_dies_on_malformed_payload(proctor_home, tmp_path):
    trusted_home(proctor_home)
    payload = tmp_path / "p.json"
    payload.write_text(json.dumps({"agent": "fake", "task": " ", "repo": "rel", "ticket": "T"}))
    res = CliRunner().invoke(main, ["enqueue", "--targets", "hostA", "--payload-file", str(payload),
                                    "--queue", "nats://127.0.0.1:1"])
    assert res.exit_code == 2
    assert "task must be non-empty" in res.output and "absolute path" in res.output
