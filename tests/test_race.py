"""A race (issue 42): one task to several agents, each its own job, ranked by what the host measured.

Three scripted agents of different quality on one repo with a held-out test: the correct one ranks first;
one that hard-codes the visible test passes it and fails the held-out one, and ranks last with that reason,
below one that plainly fails. Landing the winner moves the target; the others stay reviewable. The budgets
book every run before any launches: a race they cannot hold whole launches nothing and says how many fit."""

from __future__ import annotations

import json
import os
from pathlib import Path

from click.testing import CliRunner

from proctor import RunAgentRequest
from proctor.contract import Code, Status
from proctor.mechanisms.config.load import load_config
from proctor.mechanisms.ledger.store import Ledger
from proctor.services.race import race as race_mod
from proctor.services.review import jobs
from proctor.services.review.land import land
from tests.conftest import make_repo, sh

FILES = {
    "pyproject.toml": '[project]\nname = "calc"\nversion = "0"\n',
    "calc.py": "def add(a, b):\n    raise NotImplementedError\n",
    "tests/test_calc.py": "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n",
}
HELD = "from calc import add\n\n\ndef test_add_more():\n    assert add(10, 20) == 30\n"
AGENTS = {
    "right": "def add(a, b):\\n    return a + b\\n",
    "cheat": "def add(a, b):\\n    return 5\\n",  # the visible test's answer, hard-coded
    "wrong": "def add(a, b):\\n    return a - b\\n",
}



def setup(tmp_path: Path, budget: str = "") -> tuple[Path, Path]:
    repo = make_repo(tmp_path, dict(FILES))
    hidden = tmp_path / "holdout"
    (hidden / "tests").mkdir(parents=True)
    (hidden / "tests" / "test_more.py").write_text(HELD)
    cfg = tmp_path / "agents.toml"
    agents = "".join(f'[agents.{name}]\ncommand = ["/bin/sh", "-c", "cat >/dev/null; printf \'{body}\' > calc.py"]\n'
                     'prompt = "stdin"\nnetwork = false\n' for name, body in AGENTS.items())
    cfg.write_text(f'[holdout]\n"{repo}" = ["{hidden}"]\n{agents}')
    return repo, cfg


def requests(repo: Path, agents: list[str]) -> list[RunAgentRequest]:
    return [RunAgentRequest(agent=a, task="make add add", repo=str(repo), ticket="RACE") for a in agents]


def test_a_race_ranks_the_right_change_first_and_the_cheat_last(tmp_path):
    repo, cfg = setup(tmp_path)
    seen: list[tuple[int, str]] = []
    out = race_mod.race(requests(repo, ["cheat", "wrong", "right"]), config=load_config(cfg),
                        on_phase=lambda lane, phase: seen.append((lane.number, phase)))
    assert out.status is Status.completed and out.code is Code.OK, out.to_json()
    order = [r["agent"] for r in out.ranking]
    assert order == ["right", "wrong", "cheat"], json.dumps(out.ranking, indent=1)
    assert out.winner == out.ranking[0]["jobId"] and out.ranking[0]["tier"] == "accepted"
    cheat = out.ranking[2]
    assert cheat["tier"] == "failed the checks it never saw", cheat
    assert "1 of 1 held-out test(s) did not pass" in cheat["reasons"][0], cheat
    assert "10" not in " ".join(cheat["reasons"]) and "test_more" not in json.dumps(out.ranking)  # counts only
    assert out.ranking[1]["tier"] == "failed its tests"
    assert [j.agent for j in out.jobs] == ["cheat", "wrong", "right"]  # each job's own result, in asked order
    # One job ran the base's tests; the others, started with it, waited for that run and read it.
    assert sorted(j.baseline["source"] for j in out.jobs) == ["cached", "cached", "ran"], [j.baseline for j in out.jobs]
    assert {n for n, _ in seen} == {1, 2, 3} and any(p.startswith("ended") for _, p in seen)  # live, all three
    with Ledger.default() as ledger:
        rows = [r for r in ledger.rows(kind="race.end") if r.payload["raceId"] == out.race_id]
        assert rows and rows[0].payload["winner"] == out.winner
        landed = land(ledger, jobs.find(ledger, out.winner))
        assert landed.ok, landed.to_dict()
        for other in out.ranking[1:]:  # still reviewable
            found = jobs.find(ledger, other["jobId"])
            assert isinstance(found, jobs.Job) and found.worktree_exists and found.state == "open"
    assert "return a + b" in sh("git", "show", "master:calc.py", cwd=repo)


def test_a_race_the_budgets_cannot_hold_whole_launches_nothing(tmp_path, monkeypatch):
    from proctor.mechanisms.policy.governor import UsageGovernor
    from proctor.mechanisms.policy.tally import SqliteTally
    from proctor.mechanisms.policy.trusted import Policy

    repo, cfg = setup(tmp_path)
    (tmp_path / "policy.toml").write_text('[budgets.right]\nagent = "right"\nruns_per_hour = 1\n')
    budgets = Policy.load(tmp_path).budgets

    def governor():
        return UsageGovernor(budgets, lambda: SqliteTally(tmp_path / "usage.sqlite3"))

    refused = race_mod.race(requests(repo, ["right", "wrong", "right"]), config=load_config(cfg), governor=governor())
    assert refused.status is Status.rate_limited and refused.code is Code.BUDGET_DENIED, refused.to_json()
    assert refused.budget["fit"] == 2 and "room for 2 of the race's 3 runs" in refused.summary
    assert refused.jobs == [] and not list((repo.parent / "repo-agents").glob("*"))  # nothing launched
    # The control: two runs fit, and run (the refused race took back what it had booked).
    fits = race_mod.race(requests(repo, ["right", "wrong"]), config=load_config(cfg), governor=governor())
    assert fits.status is Status.completed and len(fits.jobs) == 2, fits.to_json()


def test_proctor_race_prints_one_json_and_exits_by_the_winner(tmp_path):
    from proctor.surfaces.cli.main import main

    repo, cfg = setup(tmp_path)
    got = CliRunner().invoke(main, ["race", "--agent", "wrong", "--agent", "right", "--task", "make add add",
                                    "--repo", str(repo), "--ticket", "R", "--config", str(cfg)])
    out = json.loads(got.stdout)
    assert got.exit_code == 0, got.output
    assert out["ranking"][0]["agent"] == "right" and len(out["jobs"]) == 2
    bad = CliRunner().invoke(main, ["race", "--agent", "wrong", "--task", "t", "--repo", str(repo), "--ticket", "R",
                                    "--config", str(cfg)])
    assert bad.exit_code == 1 and json.loads(bad.stdout)["code"] == "INVALID_REQUEST", bad.output


def test_a_race_lands_its_winner_only_where_the_repos_policy_says(tmp_path):
    repo, cfg = setup(tmp_path)
    cfg.write_text(cfg.read_text() + f'[auto_land."{repo}"]\nbasis = "held-out"\n')
    before = sh("git", "rev-parse", "master", cwd=repo)
    out = race_mod.race(requests(repo, ["wrong", "right"]), config=load_config(cfg))
    assert out.landed is not None and out.landed["landed"] is True and out.landed["race"] == out.race_id, out.landed
    assert out.winner and sh("git", "rev-parse", "master", cwd=repo) != before
    with Ledger.default() as ledger:
        auto_rows = [r.job_id for r in ledger.rows(kind="auto.land") if r.payload.get("race") == out.race_id]
    assert auto_rows == [out.winner]  # the loser was never considered, let alone landed


def test_proctor_land_race_lands_the_winner_or_the_pick_and_discards_the_rest(tmp_path):
    from proctor.surfaces.cli.main import main

    repo, cfg = setup(tmp_path)
    out = race_mod.race(requests(repo, ["wrong", "right", "cheat"]), config=load_config(cfg))
    runner = CliRunner()
    loser = next(r["jobId"] for r in out.ranking if r["agent"] == "wrong")
    unknown = runner.invoke(main, ["land", out.race_id, "--pick", "nosuchjob", "--json"])
    assert unknown.exit_code == 1 and json.loads(unknown.stdout)["code"] == "UNKNOWN_JOB", unknown.output
    not_race = runner.invoke(main, ["land", out.winner, "--pick", loser])
    assert not_race.exit_code == 2, not_race.output
    listed = json.loads(runner.invoke(main, ["jobs", "--json", "--repo", str(repo)]).stdout)
    assert {j["race"] for j in listed} == {out.race_id}
    landed = runner.invoke(main, ["land", out.race_id, "--json"])
    body = json.loads(landed.stdout)
    assert landed.exit_code == 0 and body["jobId"] == out.winner, landed.output
    assert sorted(body["discarded"]) == sorted(j for j in [r["jobId"] for r in out.ranking] if j != out.winner)
    assert "return a + b" in sh("git", "show", "master:calc.py", cwd=repo)
    states = {j["jobId"]: j["state"] for j in json.loads(runner.invoke(main, ["jobs", "--json"]).stdout)}
    assert states[out.winner] == "landed" and states[loser] == "discarded"


def test_the_mcp_race_tool_starts_every_job_and_ranks_them(tmp_path):
    """Over a real MCP server (stdio): `race` answers at once with the race's and its jobs' ids, each job is
    this server's own (job_result follows it), and race_result gives the ranking once all have ended."""
    from tests.test_mcp import session

    repo, cfg = setup(tmp_path)
    home = Path(os.environ["PROCTOR_HOME"])
    (home / "config.toml").write_text(cfg.read_text())  # confined as a person's default (auto), not the suite's off

    async def body(client):
        started = await client.call_tool("race", {"agents": ["wrong", "right"],
                                                  "job": {"task": "make add add", "repo": str(repo), "ticket": "M"}})
        assert not started.is_error, started
        ids = started.structured_content["jobs"]
        one = await client.call_tool("job_result", {"job": ids[1], "wait_s": 120})
        ranked = await client.call_tool("race_result", {"race": started.structured_content["raceId"],
                                                        "wait_s": 120})
        too_few = await client.call_tool("race", {"agents": ["right"], "job": {"task": "t", "repo": str(repo),
                                                                               "ticket": "M"}})
        return started.structured_content, one.structured_content, ranked.structured_content, too_few

    started, one, ranked, too_few = session(body)
    assert one["done"] and one["result"]["status"] == "completed", one
    assert ranked["done"] and ranked["winner"] == started["jobs"][1], json.dumps(ranked, indent=1)
    assert [r["agent"] for r in ranked["ranking"]] == ["right", "wrong"]
    assert too_few.is_error and too_few.structured_content["code"] == "INVALID_ARGUMENTS", too_few


def test_a_race_over_the_queue_fans_out_to_the_lanes_hosts_and_ranks_their_signed_results(tmp_path, nats_url,
                                                                                         proctor_home):
    """Two listeners (two hosts) on a real NATS server; the race's three jobs go to them in turn as ordinary
    signed run_agent jobs, and the verified results are ranked as a local race's are."""
    import asyncio

    from proctor.mechanisms.queue import keys
    from proctor.mechanisms.queue.jetstream import JetStreamBackend
    from proctor.mechanisms.queue.signers import load_trust
    from proctor.mechanisms.queue.store import JobStore
    from proctor.mechanisms.queue.testing import trusted_home
    from proctor.services.listen.kinds import NoopRunner, ProcessAgentRunner
    from proctor.services.listen.listener import Listener, Settings
    from proctor.services.race.fleet import race_over_queue

    trusted_home(proctor_home)
    repo, cfg = setup(tmp_path)
    hosts = [f"racehost{i}-{os.getpid()}" for i in range(2)]

    async def go():
        stop, tasks, backends = asyncio.Event(), [], []
        for host in hosts:
            backend = await JetStreamBackend.connect(nats_url)
            runner = ProcessAgentRunner(proctor_home / f"{host}.sqlite3", config_path=cfg)
            listener = Listener(Settings(host, {"default": 1}, ack_wait_s=30), backend, load_trust(proctor_home),
                                keys.load("host", proctor_home), JobStore(proctor_home / f"{host}.sqlite3"),
                                Ledger(proctor_home / "ledger.sqlite3"), {"noop": NoopRunner(), "run_agent": runner})
            backends.append(backend)
            tasks.append(asyncio.create_task(listener.serve(stop)))
        client = await JetStreamBackend.connect(nats_url)
        try:
            return await race_over_queue(client, load_trust(proctor_home), requests(repo, ["cheat", "wrong", "right"]),
                                         targets=hosts, lane="default", signer=keys.load("default", proctor_home),
                                         ttl_s=600, wait_s=120)
        finally:
            stop.set()
            await asyncio.gather(*tasks)
            for b in [*backends, client]:
                await b.close()

    out = asyncio.run(go())
    assert [r["agent"] for r in out.ranking] == ["right", "wrong", "cheat"], json.dumps(out.ranking, indent=1)
    assert out.status is Status.completed and out.winner == out.ranking[0]["jobId"]
    assert [r["host"] for r in sorted(out.ranking, key=lambda r: [j.agent for j in out.jobs].index(r["agent"]))] == \
        [hosts[0], hosts[1], hosts[0]]  # in turn


def test_the_review_page_shows_a_race_side_by_side_and_lands_the_pick(tmp_path):
    """The page (a real `proctor serve`) shows the race's jobs in one view, best first, each with its tier,
    reasons, validation and diff; landing one from there lands exactly the diff shown and discards the rest.
    A land that names a diff other than the one shown is refused (control: the shown one lands)."""
    from review_site import Server

    repo, cfg = setup(tmp_path)
    out = race_mod.race(requests(repo, ["cheat", "right"]), config=load_config(cfg))
    server = Server()
    try:
        c = server.client()
        page = c.get(f"{server.prefix}/races/{out.race_id}")
        assert page.status_code == 200, page.text
        html = page.text
        right, cheat = out.ranking[0]["jobId"], out.ranking[1]["jobId"]
        assert html.index(right) < html.index(cheat)  # best first
        assert "failed the checks it never saw" in html and html.count('data-field="tier"') == 2
        assert html.count('<span class="mono path">calc.py</span>') == 2  # each job's diff
        csrf = html.split('name="csrf" value="', 1)[1].split('"', 1)[0]
        form = html.split(f'name="pick" value="{right}"', 1)[1]
        shown = form.split('name="shown" value="', 1)[1].split('"', 1)[0]
        headers = {"content-type": "application/x-www-form-urlencoded"}
        forged = c.post(f"{server.prefix}/races/{out.race_id}/land", headers=headers,
                        content=f"csrf={csrf}&pick={right}&shown={'0' * 64}")
        assert "NOT_AS_SHOWN" in c.get(forged.headers["location"]).text
        assert "return a + b" not in sh("git", "show", "master:calc.py", cwd=repo)
        done = c.post(f"{server.prefix}/races/{out.race_id}/land", headers=headers,
                      content=f"csrf={csrf}&pick={right}&shown={shown}")
        after = c.get(done.headers["location"]).text
        assert "land done" in after and cheat in after, after[:2000]
        job_page = c.get(f"{server.prefix}/jobs/{cheat}").text
        assert f"/races/{out.race_id}" in job_page  # a job's page links its race
    finally:
        server.stop()
    assert "return a + b" in sh("git", "show", "master:calc.py", cwd=repo)
    with Ledger.default() as ledger:
        assert jobs.find(ledger, cheat).state == "discarded"


def test_a_booking_a_job_took_is_never_given_back_by_the_race_too(tmp_path, clear_of_the_hour):
    """A race's bookings are handed to its jobs: one a job took (admission settles or releases it as its own)
    is left alone by the race; one never taken (its job refused before admission) the race releases, once."""
    from proctor.mechanisms.policy.governor import UsageGovernor
    from proctor.mechanisms.policy.tally import SqliteTally
    from proctor.mechanisms.policy.trusted import Policy

    (tmp_path / "policy.toml").write_text('[budgets.right]\nagent = "right"\nruns_per_hour = 5\n')
    gov = UsageGovernor(Policy.load(tmp_path).budgets, lambda: SqliteTally(tmp_path / "usage.sqlite3"))

    def runs() -> int:
        return gov.spend()[0].windows["hour"].spent.runs

    repo, cfg = setup(tmp_path / "r")
    opened = race_mod.open_race(requests(repo, ["right", "right"]), config=load_config(cfg), governor=gov)
    assert isinstance(opened, race_mod.Opened) and runs() == 2
    opened.booked[0].take()  # the first job's admission took its booking (and will settle it itself)
    race_mod.release_untaken(opened, gov)
    assert runs() == 1  # only the untaken one came back
    race_mod.release_untaken(opened, gov)
    assert runs() == 1  # and only once
    gov.close()
