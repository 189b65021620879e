"""Two hosts racing for a budget's last unit: exactly one wins, round after round, on the fleet's JetStream KV
(one real nats-server, each racer a process of its own with its own connection) and on the local SQLite tally
(two processes on one file). And a queued job end to end: `proctor listen` books on the fleet's tally with
the lane the job came on, and the next job of that pool is BUDGET_DENIED with nothing launched."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from proctor.contract import Code, Status
from proctor.mechanisms.policy.budget import BudgetTable
from proctor.mechanisms.policy.governor import Booking, Denial, UsageGovernor
from proctor.mechanisms.policy.windows import key_for
from proctor.mechanisms.policy.tally import BUCKET, KvTally, SqliteTally, TallyError
from proctor.mechanisms.queue import sender, server
from proctor.mechanisms.queue.jetstream import JetStreamBackend
from proctor.mechanisms.queue.signers import load_trust
from proctor.mechanisms.queue.testing import nkey_user, trusted_home
from proctor.mechanisms.adapters.testing import Behaviour, FakeAgent

ROUNDS = 50
LIMIT = 3  # each round's budget: LIMIT - 1 units booked before the race, the racers want the last one
PROCTOR = [sys.executable, "-c", "from proctor.surfaces.cli import main; main()"]


# These runs count in the real clock's hour (conftest.clear_of_the_hour).
pytestmark = pytest.mark.usefixtures("clear_of_the_hour")


def round_budget(prefix: str, r: int):
    return BudgetTable.model_validate({"agent": "claude", "runs_per_hour": LIMIT}).build(f"{prefix}-{r}")


def open_tally(kind: str, where: str):
    return SqliteTally(where) if kind == "sqlite" else KvTally(where)


def racer(kind: str, where: str, prefix: str, name: str, barrier, results) -> None:
    """One host: its own tally connection, one booking per round, all racers released by one barrier."""
    tally = open_tally(kind, where)
    try:
        for r in range(ROUNDS):
            gov = UsageGovernor([round_budget(prefix, r)], lambda: tally)
            barrier.wait(60)
            got = gov.book("claude", f"{name}-{r}")
            results.put((r, name, got.code.value, gov.conflicts))
    finally:
        tally.close()


def race(kind: str, where: str) -> tuple[dict[int, list[tuple[str, str]]], int]:
    prefix = f"race-{uuid.uuid4().hex[:8]}"
    setup = open_tally(kind, where)
    try:
        for r in range(ROUNDS):  # the pool's first units, taken before the race
            gov = UsageGovernor([round_budget(prefix, r)], lambda: setup)
            assert all(isinstance(gov.book("claude", f"setup-{r}-{i}"), Booking) for i in range(LIMIT - 1))
    finally:
        setup.close()
    ctx = multiprocessing.get_context("spawn")  # no fork of a process with threads and open connections
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=racer, args=(kind, where, prefix, name, barrier, results)) for name in ("a", "b")]
    for p in procs:
        p.start()
    by_round: dict[int, list[tuple[str, str]]] = {}
    conflicts = 0
    try:
        for _ in range(2 * ROUNDS):
            r, name, code, lost = results.get(timeout=120)
            by_round.setdefault(r, []).append((name, code))
            conflicts += lost  # writes this racer lost to the other in that round (read again, decided again)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    check = open_tally(kind, where)
    try:
        for r in range(ROUNDS):  # no lost update and no unit past the limit: exactly LIMIT runs booked
            found = check.get(key_for(round_budget(prefix, r)))
            assert found is not None and json.loads(found.value)["windows"]["hour"]["runs"] == LIMIT, r
    finally:
        check.close()
    return by_round, conflicts


def assert_one_winner_each_round(kind: str, by_round: dict[int, list[tuple[str, str]]], conflicts: int) -> None:
    assert sorted(by_round) == list(range(ROUNDS))
    for r, outcomes in by_round.items():
        codes = sorted(code for _, code in outcomes)
        assert codes == [Code.BUDGET_DENIED.value, Code.OK.value], (r, outcomes)
    wins = {name: sum(code == Code.OK.value for n, code in (o for v in by_round.values() for o in v) if n == name)
            for name in ("a", "b")}
    print(f"{kind}: {ROUNDS} rounds, exactly one winner each (a won {wins['a']}, b {wins['b']}); "
          f"{conflicts} compare-and-set writes lost and retried")
    # The racers did collide (read the same revision, both wrote): the compare-and-set was what decided.
    assert conflicts > 0


def wrote_in_the_same_instant(kind: str, where: str) -> int:
    """Both racers read the same revision and both write: the tally must take exactly one (a CAS check
    made without the governor's loop, so a loser's retry cannot hide a tally that took both)."""
    a, b = open_tally(kind, where), open_tally(kind, where)
    key = f"budget.cas-{uuid.uuid4().hex[:8]}"
    try:
        assert a.create(key, b"0") is not None
        seen_a, seen_b = a.get(key), b.get(key)
        assert seen_a == seen_b
        first = a.update(key, b"a", seen_a.revision)
        second = b.update(key, b"b", seen_b.revision)
        assert first is not None and second is None  # the second write is refused: the revision moved
        assert b.create(key, b"again") is None  # and a create over an existing key too
        assert b.update(key, b"b", first) is not None  # control: after reading again it goes in
        return first
    finally:
        a.close()
        b.close()


def test_two_hosts_race_for_the_last_unit_on_the_fleets_kv(nats_url):
    assert wrote_in_the_same_instant("jetstream", nats_url)
    by_round, conflicts = race("jetstream", nats_url)
    assert_one_winner_each_round("jetstream", by_round, conflicts)


def test_two_processes_race_for_the_last_unit_on_the_local_sqlite_tally(tmp_path):
    path = str(tmp_path / "usage.sqlite3")
    assert wrote_in_the_same_instant("sqlite", path)
    by_round, conflicts = race("sqlite", path)
    assert_one_winner_each_round("sqlite", by_round, conflicts)


def test_the_fleets_bucket_is_made_on_first_use_and_a_dead_server_fails_closed(nats_url):
    budget = BudgetTable.model_validate({"agent": "claude", "runs_per_hour": 1}).build(f"b-{uuid.uuid4().hex[:6]}")
    gov = UsageGovernor([budget], lambda: KvTally(nats_url))
    try:
        assert isinstance(gov.book("claude", "j1"), Booking) and gov.store == "jetstream"
    finally:
        gov.close()

    async def bucket_config():
        backend = await JetStreamBackend.connect(nats_url)
        try:
            return (await backend.nc.jetstream().stream_info(f"KV_{BUCKET}")).config
        finally:
            await backend.close()

    config = asyncio.run(bucket_config())
    assert config.max_msgs_per_subject == 1 and config.max_age == pytest.approx(2 * 86400)
    dead = UsageGovernor([budget], lambda: KvTally("nats://127.0.0.1:1", connect_timeout_s=1))
    try:
        denied = dead.book("claude", "j2")
    finally:
        dead.close()
    assert isinstance(denied, Denial) and denied.code is Code.BUDGET_UNAVAILABLE
    assert "nothing was launched" in denied.reason
    with pytest.raises(TallyError):
        KvTally("nats://127.0.0.1:1", connect_timeout_s=1).get("budget.x")


# -- a queued job, end to end -----------------------------------------------------------------------------

def test_a_queued_job_books_on_the_fleets_tally_with_its_lane(nats_url, proctor_home, tmp_path):
    from conftest import make_repo

    th = trusted_home(proctor_home)
    host = f"gov-{os.getpid()}-{uuid.uuid4().hex[:4]}"
    budget = f"fast-{uuid.uuid4().hex[:6]}"
    (proctor_home / "policy.toml").write_text(f'[budgets.{budget}]\nagent = "fake"\nlane = "fast"\n'
                                              'runs_per_hour = 1\n')
    agent = FakeAgent(tmp_path / "bin", "fake-cli", Behaviour(writes={"out.txt": "done\n"}))
    cfg = tmp_path / "agents.toml"
    cfg.write_text(f'confine = "off"\n[agents.fake]\ncommand = [{json.dumps(str(agent.path))}, "{{prompt}}"]\n')
    listener = subprocess.Popen([*PROCTOR, "listen", "--host", host, "--lanes", "fast=1,slow=1", "--config",
                                 str(cfg), "--queue", nats_url], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    repos = iter(make_repo(tmp_path / f"r{i}") for i in range(3))

    async def send(lane: str):
        payload = {"agent": "fake", "task": "t", "repo": str(next(repos)), "ticket": "T-1", "timeoutSec": 60,
                   "validateCommand": "true"}
        backend = await JetStreamBackend.connect(nats_url)
        try:
            (sealed,) = sender.build(targets=[host], kind="run_agent", lane=lane, payload=payload, signer=th.admin)
            await sender.publish(backend, sealed)
            return await sender.wait(backend, load_trust(proctor_home), sealed, 120)
        finally:
            await backend.close()

    try:
        first = asyncio.run(send("fast"))
        assert first.result.status is Status.completed, first.result.known_risks
        assert first.result.budget["store"] == "jetstream" and first.result.budget["pool"]["lane"] == "fast"
        assert len(agent.calls()) == 1
        second = asyncio.run(send("fast"))
        assert second.result.status is Status.rate_limited and second.result.code is Code.BUDGET_DENIED
        assert second.result.retry_after and len(agent.calls()) == 1  # nothing launched
        # Control: the same agent on another lane is another pool, and runs.
        other = asyncio.run(send("slow"))
        assert other.result.status is Status.completed and other.result.budget is None
        assert len(agent.calls()) == 2
    finally:
        listener.terminate()
        try:
            listener.wait(20)
        except subprocess.TimeoutExpired:
            listener.kill()
    # The run is in the fleet's tally, not this home's.
    fleet = subprocess.run([*PROCTOR, "usage", "--json", "--fleet", "--queue", nats_url], capture_output=True,
                           text=True, timeout=60)
    assert fleet.returncode == 0, fleet.stderr
    (row,) = [b for b in json.loads(fleet.stdout)["budgets"] if b["budget"] == budget]
    assert row["limits"][0]["spent"] == 1 and json.loads(fleet.stdout)["store"] == "jetstream"
    local = json.loads(subprocess.run([*PROCTOR, "usage", "--json"], capture_output=True, text=True,
                                      timeout=60).stdout)
    assert [b["limits"][0]["spent"] for b in local["budgets"]] == [0]


def test_a_hosts_nkey_user_may_book_on_the_tally_and_only_through_its_permissions(tmp_path):
    try:
        import nkeys  # noqa: F401 - nats-py needs it for NKEY auth
    except ImportError:
        if os.environ.get("CI") == "true":
            pytest.fail("the nkeys package is missing (pip install nkeys): CI must run this")
        pytest.skip("nats-py needs the `nkeys` package for NKEY auth")
    from proctor.mechanisms.queue.jetstream import host_permissions

    admin_seed, admin_pub = nkey_user(tmp_path, "admin")
    a_seed, a_pub = nkey_user(tmp_path, "hostA")
    b_seed, b_pub = nkey_user(tmp_path, "hostB")
    without = host_permissions("hostB", ["default"])
    without["publish"]["allow"] = [s for s in without["publish"]["allow"] if "proctor_usage" not in s]
    config = tmp_path / "fleet.conf"
    config.write_text(json.dumps({"authorization": {"users": [
        {"nkey": admin_pub},
        {"nkey": a_pub, "permissions": host_permissions("hostA", ["default"])},
        {"nkey": b_pub, "permissions": without},  # the same host's permissions but the tally's
    ]}}))
    handle = server.start(tmp_path / "store", config_file=config)
    budget = BudgetTable.model_validate({"agent": "claude", "runs_per_hour": 5}).build("team")

    def book(seed: Path, inbox: str | None) -> Booking | Denial:
        options = {"nkeys_seed": str(seed), **({"inbox_prefix": inbox.encode()} if inbox else {})}
        gov = UsageGovernor([budget], lambda: KvTally(handle.url, options=options, connect_timeout_s=2,
                                                      request_timeout_s=2))
        try:
            return gov.book("claude", f"j-{uuid.uuid4().hex[:6]}")
        finally:
            gov.close()

    try:
        # A host may not make the bucket: the refusal says who does.
        missing = book(a_seed, "_INBOX_hostA")
        assert isinstance(missing, Denial) and missing.code is Code.BUDGET_UNAVAILABLE
        assert "the fleet's admin creates it" in missing.reason, missing.reason
        assert isinstance(book(admin_seed, None), Booking)  # the admin may, and makes it
        assert isinstance(book(a_seed, "_INBOX_hostA"), Booking)  # now the host books
        refused = book(b_seed, "_INBOX_hostB")  # control: without the tally's permissions it cannot
        assert isinstance(refused, Denial) and refused.code is Code.BUDGET_UNAVAILABLE, refused
        # A refusal by the server is final, never retried as if it were a failover: the reason is the one the
        # tally gives when it stops at the violation (retried to the end, it would be "cannot be reached: a
        # timeout"), not a clock (issue 24).
        assert "the server refused this user the tally" in refused.reason, refused.reason
        assert "permissions violation" in refused.reason, refused.reason
    finally:
        handle.stop()
