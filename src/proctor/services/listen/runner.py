"""The job runner child: `python -m proctor.services.listen.runner`, one run_agent attempt under a listener's control.

Owns the child side of the control pipe: the first stdin line is the job, later lines are `cancel <reason>`,
and end-of-file means the listener is gone, which cancels the run (run_agent then kills the agent's tree).
It records how the attempt ended in the listener's store, so a listener that takes the job over can name the
abandoned worktree; it prints the result as the last stdout line. It never talks to the queue's jobs; it
counts the job's spend on the fleet's tally (proctor.mechanisms.policy.tally, its own connection) when the listener says how.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from proctor.contract import Requester, RunAgentRequest
from proctor.mechanisms.queue.store import JobStore, Owner

if TYPE_CHECKING:
    from proctor.mechanisms.config.model import Config
    from proctor.mechanisms.policy.governor import Spend


class _Reason:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reason: str | None = None

    def set(self, reason: str) -> None:
        with self._lock:
            self._reason = self._reason or reason

    def get(self) -> str | None:
        with self._lock:
            return self._reason


def _watch_control(reason: _Reason) -> None:
    for line in sys.stdin:
        if line.startswith("cancel "):
            reason.set(line.removeprefix("cancel ").strip())
    reason.set("the listener is gone (control pipe closed)")


def _spend(start: dict, config: Config | None) -> Spend | None:
    """Where this job's spend is counted: the queue's KV, with the lane the job came on. None when the
    listener gave no tally or the config cannot be read (run_agent then counts it locally, or refuses the
    job over the config itself); the budgets are the trusted policy's, which run_agent reads."""
    from proctor.mechanisms.config.load import ConfigError, load_config
    from proctor.home import proctor_home
    from proctor.mechanisms.policy.governor import Spend
    from proctor.mechanisms.policy.tally import fleet_tally

    reach = start.get("tally")
    if not reach or not reach.get("url"):
        return None
    try:
        settings = (config or load_config()).queue
    except ConfigError:
        return None
    return Spend(lambda: fleet_tally(reach["url"], settings, proctor_home(), nkey_seed=reach.get("nkey_seed"),
                                     inbox_prefix=reach.get("inbox")), lane=start.get("lane"))


def main() -> int:
    from proctor.mechanisms.config.load import load_config
    from proctor.services.job.run_agent import run_agent

    start = json.loads(sys.stdin.readline())
    store = JobStore(Path(start["store"]))
    store.record_runner(start["jobId"], int(start["delivery"]), Owner.me())
    reason = _Reason()
    threading.Thread(target=_watch_control, args=(reason,), daemon=True).start()
    request = RunAgentRequest.model_validate(start["request"])
    config = load_config(start["config"]) if start.get("config") else None
    asked = start.get("requester")
    # A listener's job is always someone else's: without a signer named, the least privileged one.
    requester = Requester(str(asked["name"]), bool(asked.get("privileged"))) if asked else Requester("queue:?")
    result = run_agent(request, config=config, cancel=reason.get, job_id=start["attemptId"],
                       spend=_spend(start, config), requester=requester)
    result.job_id = start["jobId"]
    store.record_attempt(
        start["jobId"], int(start["delivery"]), worktree=result.worktree_path,
        ended=f"{result.status.value}/{result.code.value}" + (f": {reason.get()}" if reason.get() else ""),
    )
    store.close()
    try:
        sys.stdout.write(result.model_dump_json(by_alias=True) + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        return 1  # the listener died; the store row above is what its successor reads
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
