"""Job kinds a listener can run: `run_agent` (the host's contract) and `noop` (queue cost alone, for benches).

Owns turning a verified, claimed job into a RunAgentResult, with a cancel hook the listener drives (a user's
cancel, a lost lease, a stopping listener). It never verifies or claims (listener.py does).

`run_agent` jobs run in a child process (`python -m proctor.services.listen.runner`) rather than a thread: if the
listener is `kill -9`ed, the child sees its control pipe close, cancels, and run_agent kills the agent's whole
tree before the lease can expire, so the redelivered run never overlaps an orphan of the first.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from proctor.contract import Code, Requester, RunAgentRequest, RunAgentResult, Status

CancelHook = Callable[[], str | None]


@dataclass(frozen=True)
class AgentJob:
    job_id: str
    delivery: int
    request: RunAgentRequest
    lane: str | None = None  # the lane it came on: part of the pool its spend budgets are kept for
    requester: Requester | None = None  # its signer: a job someone else asked for (proctor.contract.Requester)


class KindRunner(Protocol):
    async def run(self, job: AgentJob | None, payload: dict[str, object], cancel: CancelHook) -> RunAgentResult: ...


class NoopRunner:
    async def run(self, job: AgentJob | None, payload: dict[str, object], cancel: CancelHook) -> RunAgentResult:
        return RunAgentResult(status=Status.completed, summary="no-op job", agent="noop", needs_human_review=False)


def attempt_id(job: AgentJob) -> str:
    # One worktree per attempt: an abandoned attempt's worktree stays for review, so the next one needs its own.
    return job.job_id if job.delivery <= 1 else f"{job.job_id}-d{job.delivery}"


@dataclass(frozen=True)
class ProcessAgentRunner:
    """run_agent in a child process that dies with its listener (see the module docstring)."""

    store_path: Path
    config_path: Path | None = None
    cancel_poll_s: float = 0.2
    # After a cancel, how long the child may take to stop the agent (its TERM grace and cleanup) before it is
    # killed outright: a hung child must not hold a cancelled or lease-lost job.
    cancel_grace_s: float = 30.0
    # How the child reaches the fleet's spend tally, as the listener reaches the queue: {"url", and with a
    # listener's own NKEY "nkey_seed" (a path) and "inbox"}. None: the job's budgets are counted locally.
    tally: dict[str, str] | None = None

    async def run(self, job: AgentJob | None, payload: dict[str, object], cancel: CancelHook) -> RunAgentResult:
        assert job is not None
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "proctor.services.listen.runner",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )
        assert proc.stdin is not None and proc.stdout is not None
        start = {
            "jobId": job.job_id,
            "attemptId": attempt_id(job),
            "delivery": job.delivery,
            "request": job.request.model_dump(mode="json", by_alias=True, exclude_none=True),
            "store": str(self.store_path),
            "config": str(self.config_path) if self.config_path else None,
            "lane": job.lane,
            "tally": self.tally,
            "requester": ({"name": job.requester.name, "privileged": job.requester.privileged}
                          if job.requester is not None else None),
        }
        proc.stdin.write(json.dumps(start).encode() + b"\n")
        await proc.stdin.drain()
        reader = asyncio.create_task(proc.stdout.read())
        sent: float | None = None
        loop = asyncio.get_running_loop()
        while not reader.done():
            reason = cancel()
            if sent is not None and loop.time() - sent > self.cancel_grace_s and proc.returncode is None:
                try:
                    proc.kill()
                except ProcessLookupError:
                    pass
            if reason and sent is None:
                sent = loop.time()
                try:
                    proc.stdin.write(f"cancel {reason}\n".encode())
                    await proc.stdin.drain()
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the child is already gone; its output (or its absence) tells the rest
            await asyncio.wait({reader}, timeout=self.cancel_poll_s)
        out = reader.result()
        proc.stdin.close()
        code = await proc.wait()
        last = out.strip().splitlines()[-1] if out.strip() else b""
        try:
            return RunAgentResult.model_validate_json(last)
        except ValueError:
            return RunAgentResult(
                status=Status.failed, code=Code.HOST_ERROR, agent=job.request.agent,
                summary=f"job runner exited {code} without a result",
                known_risks=[f"job runner exited {code}; output tail: {out[-500:].decode(errors='replace')}"],
            )
