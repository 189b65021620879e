"""Measure (not a test): how fast `proctor mcp` answers while jobs run, over stdio with the MCP SDK's client.

Moved here from tests/test_mcp.py, whose `< 1 s`, `< 0.5 s` and `< 15 s` assertions were a loaded machine's
clock (issue 24): the tests keep the properties (run_agent answers while its job still runs; job_status is
answered while a job_result call waits; a cancelled job ends CANCELLED with its agent dead), this keeps the
numbers. Each is printed beside its floor, the same server's answer to a call that does no work
(`list_jobs` on an empty home):
- run_agent: the call's answer (the job goes on in a thread of the server);
- job_status while another call waits in job_result on a running job;
- cancel_job to job_result's CANCELLED (the agent honours TERM); its floor is the runner's poll interval
  (POLL_S: the cancel is read that often), not a no-op call.
Median and max of N rounds, in a fresh $PROCTOR_HOME with confine = "off" and an agent held until released.
Run: .venv/bin/python bench/mcp_latency.py [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio
from mcp import Client, StdioServerParameters
from repos import make_repo  # bench/, the script's own dir, is first on sys.path

from proctor.mechanisms.process.local import POLL_S

GIT_ENV = {"GIT_AUTHOR_NAME": "b", "GIT_AUTHOR_EMAIL": "b@example.invalid",
           "GIT_COMMITTER_NAME": "b", "GIT_COMMITTER_EMAIL": "b@example.invalid"}
HELD = """#!{python}
import os, sys, time
sys.stdin.read()
print("working on it", flush=True)
end = time.monotonic() + 300
while not os.path.exists({release!r}) and time.monotonic() < end:
    time.sleep(0.02)
"""


async def timed(call) -> tuple[float, object]:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    out = await call
    return time.perf_counter() - t0, out


async def one_round(c: Client, repo: Path, release: Path, n: int) -> dict[str, float]:
    got: dict[str, float] = {}
    got["floor"], _ = await timed(c.call_tool("list_jobs", {}))
    req = {"agent": "held", "task": "t", "repo": str(repo), "ticket": f"T-{n}"}
    got["run_agent"], started = await timed(c.call_tool("run_agent", req))
    if started.is_error:  # type: ignore[attr-defined]
        raise SystemExit(f"run_agent refused: {started.content[0].text}")  # type: ignore[attr-defined]
    jid = started.structured_content["jobId"]  # type: ignore[attr-defined]
    progress: list[str] = []

    async def on_progress(p: float, total: float | None, message: str | None) -> None:
        progress.append(message or "")

    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: c.call_tool("job_result", {"job": jid, "wait_s": 600}, progress_callback=on_progress))
        while not any("working on it" in m for m in progress):
            await anyio.sleep(0.02)
        got["job_status during a wait"], _ = await timed(c.call_tool("job_status", {"job": jid}))
        t0 = time.perf_counter()
        await c.call_tool("cancel_job", {"job": jid, "reason": "bench"})
        done = await c.call_tool("job_result", {"job": jid, "wait_s": 120})
        got["cancel_job to CANCELLED"] = time.perf_counter() - t0
    code = done.structured_content.get("code")  # type: ignore[attr-defined]
    if code != "CANCELLED":
        raise SystemExit(f"round {n}: the job ended {code}, not CANCELLED")
    return got


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    n = ap.parse_args().runs
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        os.environ.update(GIT_ENV)
        home = root / "home"
        home.mkdir()
        (home / "config.toml").write_text('confine = "off"\n\n[agents.held]\ncommand = ["heldagent"]\nprompt = "stdin"\n')
        os.environ["PROCTOR_HOME"] = str(home)
        os.environ["HOME"] = str(root / "userhome")
        (root / "userhome").mkdir()
        bin_dir = root / "bin"
        bin_dir.mkdir()
        release = root / "never-released"  # the job is cancelled, never released
        exe = bin_dir / "heldagent"
        exe.write_text(HELD.format(python=sys.executable, release=str(release)))
        exe.chmod(0o755)
        os.environ["PATH"] = f"{bin_dir}{os.pathsep}{os.environ['PATH']}"
        repo = make_repo(root)
        script = Path(sys.executable).with_name("proctor")
        params = StdioServerParameters(command=str(script), args=["mcp"], env=dict(os.environ))

        async def run() -> list[dict[str, float]]:
            async with Client(params) as c:
                return [await one_round(c, repo, release, i) for i in range(n)]

        rounds = anyio.run(run)
    floor = statistics.median(r["floor"] for r in rounds)
    print(f"floor (list_jobs, no work): median {floor * 1000:.1f} ms over {n} rounds")
    for key, base in (("run_agent", floor), ("job_status during a wait", floor), ("cancel_job to CANCELLED", POLL_S)):
        xs = [r[key] for r in rounds]
        med = statistics.median(xs)
        print(f"{key:26s} median {med * 1000:8.1f} ms, max {max(xs) * 1000:8.1f} ms; "
              f"{med / base:6.1f}x its floor ({base * 1000:.1f} ms)")


if __name__ == "__main__":
    main()
