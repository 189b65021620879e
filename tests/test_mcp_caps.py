"""MCP gets no more than the queue (issue 23): the caps on a run_agent request beside their queue twins, the
review verbs off unless the server was started to offer them, and bad arguments as clear refusals.

The twin: the same payload is put to the queue listener's own check (`check_envelope`, a signer without and
with `may_set_validate_command`, under a configured `confine = "required"`) and to `proctor mcp` (without and
with `--may-set-validate-command`): each refuses exactly what the other refuses, with the same code.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import anyio
import pytest
from conftest import make_repo
from mcp import Client
from test_mcp import params

from proctor.contract import RunAgentRequest
from proctor.mechanisms.ledger.store import Ledger
from proctor.surfaces.mcp.arguments import bad_strings
from proctor.surfaces.mcp.grants import Grants, over_privileged
from proctor.mechanisms.queue import sender
from proctor.services.listen.checks import Accepted, check_envelope
from proctor.mechanisms.queue.signers import load_trust
from proctor.mechanisms.queue.testing import trusted_home

BASE = {"agent": "patch", "task": "t", "repo": "/tmp/r", "ticket": "T-1"}
ASKS = {
    "plain": {},
    "validateCommand": {"validateCommand": "cat $PROCTOR_HOME/keys/host.key"},
    "holdout": {"holdout": ["/srv/held-out"]},
    "confine off": {"confine": "off"},
    "confine auto": {"confine": "auto"},
    "confine required": {"confine": "required"},
}


def queue_verdict(home: Path, signer: str, payload: dict) -> str:
    key = __import__("proctor.mechanisms.queue.keys", fromlist=["load"]).load(signer, home)
    (sealed,) = sender.build(targets=["h"], kind="run_agent", lane="default", payload=payload, signer=key)
    got = check_envelope(sealed.to_wire(), trust=load_trust(home), host="h", lane="default",
                         kinds=frozenset({"run_agent"}), now=time.time(), skew_s=60, confine="required")
    return "OK" if isinstance(got, Accepted) else got.code.value


def mcp_verdict(grants: Grants, payload: dict) -> str:
    why = over_privileged(RunAgentRequest.model_validate(payload), "required", grants)
    return "OK" if why is None else "OVER_PRIVILEGED"


@pytest.mark.parametrize("ask", list(ASKS))
def test_each_cap_on_a_run_agent_request_is_the_queues(tmp_path, ask):
    trusted_home(tmp_path)
    payload = {**BASE, **ASKS[ask]}
    ungranted = (queue_verdict(tmp_path, "default", payload), mcp_verdict(Grants(), payload))
    granted = (queue_verdict(tmp_path, "admin", payload), mcp_verdict(Grants(may_set_validate_command=True), payload))
    assert ungranted[0] == ungranted[1], (ask, ungranted)
    assert granted == ("OK", "OK"), (ask, granted)  # the control: a granted sender may ask it, on both
    expected = "OK" if ask in ("plain", "confine required") else "OVER_PRIVILEGED"
    assert ungranted[0] == expected, (ask, ungranted)


def rows(kind: str) -> list[dict]:
    with Ledger.default() as led:
        return [r.payload for r in led.rows(kind=kind)]


def _session(body, *extra: str):
    async def main():
        async with Client(params(*extra, granted=False)) as client:
            return await body(client)

    return anyio.run(main)


def test_over_mcp_a_weaker_confine_is_refused_before_anything_runs_and_the_verbs_are_off(tmp_path):
    home = Path(os.environ["PROCTOR_HOME"])
    (home / "config.toml").write_text('confine = "required"\n')
    repo = make_repo(tmp_path)
    req = {"agent": "patch", "task": "--- a/README.md\n+++ b/README.md\n@@ -1 +1 @@\n-hello\n+hi\n",
           "repo": str(repo), "ticket": "T-cap"}

    async def body(c: Client) -> dict:
        return {"off": await c.call_tool("run_agent", {**req, "confine": "off"}),
                "cmd": await c.call_tool("run_agent", {**req, "validateCommand": "true"}),
                "held": await c.call_tool("run_agent", {**req, "holdout": [str(tmp_path)]}),
                "decl": await c.call_tool("run_agent", {**req, "taskDecl": {"goal": 3}}),
                "land": await c.call_tool("land", {"job": "whatever"}),
                "discard": await c.call_tool("discard", {"job": "whatever"}),
                "nul": await c.call_tool("list_jobs", {"repo": "/tmp/x\x00y"}),
                "nul_job": await c.call_tool("job_status", {"job": "a\x00b"}),
                "long": await c.call_tool("list_jobs", {"repo": "/" + "a" * 5000}),
                "nul_task": await c.call_tool("run_agent", {**req, "task": "a\x00b"}),
                "listed": await c.call_tool("list_jobs", {})}

    got = _session(body)
    codes = {k: (v.structured_content or {}).get("code") for k, v in got.items() if v.is_error}
    assert codes == {"off": "OVER_PRIVILEGED", "cmd": "OVER_PRIVILEGED", "held": "OVER_PRIVILEGED",
                     "decl": "TASK_INVALID", "land": "VERB_NOT_ALLOWED", "discard": "VERB_NOT_ALLOWED",
                     "nul": "INVALID_ARGUMENTS", "nul_job": "INVALID_ARGUMENTS", "long": "INVALID_ARGUMENTS",
                     "nul_task": "INVALID_REQUEST"}, codes
    assert "NUL" in got["nul"].content[0].text and "HOST_ERROR" not in json.dumps(codes)
    assert not got["listed"].is_error  # the control: the same tool with a sane argument answers
    assert rows("job.start") == [], "nothing ran"
    refused = rows("mcp.run_agent")
    assert [r["code"] for r in refused] == ["OVER_PRIVILEGED", "OVER_PRIVILEGED", "OVER_PRIVILEGED", "TASK_INVALID"]
    assert all(r["client"].startswith("mcp ") for r in refused), refused  # the SDK client's own name
    assert [(r["ok"], r["code"]) for r in rows("mcp.land") + rows("mcp.discard")] == \
        [(False, "VERB_NOT_ALLOWED")] * 2

    # The control: the server started to allow it runs the same request confined "off", and offers land.
    async def granted(c: Client) -> dict:
        started = await c.call_tool("run_agent", {**req, "confine": "off", "ticket": "T-granted",
                                                       "validateCommand": "true"})
        done = await c.call_tool("job_result", {"job": started.structured_content["jobId"], "wait_s": 120})
        landed = await c.call_tool("land", {"job": started.structured_content["jobId"]})
        return {"started": started, "done": done, "landed": landed}

    async def main():
        async with Client(params("--may-set-validate-command", "--allow-verb", "land", granted=False)) as client:
            return await granted(client)

    ok = anyio.run(main)
    assert not ok["started"].is_error and ok["done"].structured_content["done"] is True
    assert not ok["landed"].is_error, ok["landed"].content[0].text
    landed = [r for r in rows("mcp.land") if r["ok"]]
    assert len(landed) == 1 and landed[0]["client"].startswith("mcp ")


def test_bad_strings_are_found_wherever_they_are():
    assert bad_strings({"a": ["x", {"b": "y\x00"}]}) == "a[1].b holds a NUL character"
    assert bad_strings({"task": "x" * 300_000}).startswith("task is 300000 characters")
    assert bad_strings({"a": ["ok"], "b": {"c": "fine"}}) is None  # the control


def test_mcp_text_shows_bidi_and_controls_escaped():
    from proctor.surfaces.mcp.results import ok_result

    res = ok_result({"files": ["notes\u202etxt.sh"], "name": "café"})
    assert "\u202e" not in res.content[0].text and "\\u202e" in res.content[0].text
    assert "café" in res.content[0].text  # ordinary letters stay readable
