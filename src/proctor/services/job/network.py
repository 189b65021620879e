"""A job's network: the host-run egress proxies (the agent's, to its adapter's declared hosts; setup's, to
the repo's registries), each decision a ledger row and each refusal a risk a person reads. Never opens a
network to code the agent wrote: validation has none."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from proctor.mechanisms.config.settings import RepoSettings
from proctor.services.job.context import Job

if TYPE_CHECKING:
    from proctor.mechanisms.confine.egress import EgressProxy


def egress_row(job: Job, agent: bool = False) -> Callable[[dict], None]:
    """The ledger row of each decision of a proxy of the job (`agent`: the agent's own, whose allowed
    requests are counted for `never_reached`)."""
    def row(decision: dict) -> None:
        job.ledger.append("egress.decision", {"jobId": job.job_id, **decision}, job_id=job.job_id)
        if decision.get("allowed") and agent:
            job.reached_egress += 1
        if not decision.get("allowed"):
            where = f"{decision.get('host')}:{decision.get('port')}"
            job.refused_egress.setdefault(where, str(decision.get("reason") or "refused"))

    return row


def refused_egress(job: Job) -> None:
    """A refused request is a cause a person should read in the result, not only in the ledger (a refused
    registry read as "no version found", issue 24): each host:port once, with the proxy's reason."""
    if job.refused_egress:
        shown = [f"{where} ({why})" for where, why in list(job.refused_egress.items())[:5]]
        more = f" (+{len(job.refused_egress) - 5} more)" if len(job.refused_egress) > 5 else ""
        job.risks.append(f"the network proxy refused requests to: {'; '.join(shown)}{more}")


def never_reached(job: Job) -> str | None:
    """Why the agent never reached its model, when the host can tell: its only network was its egress proxy
    (confined, with hosts declared) and not one request of it went through. None when one did, or when the
    agent had another way out (no confinement) or no model host to reach. A CLI that exits 0 on
    "Connection error" (grok) read as a validation failure before (issue 40)."""
    if job.egress is None or job.reached_egress:
        return None
    if job.refused_egress:
        refused = "; ".join(list(job.refused_egress)[:5])
        return f"the agent never reached its model: the egress proxy let no request of it through (refused: {refused})"
    return ("the agent never reached its model: it sent no request through the egress proxy, its only network "
            "(a client that ignores the proxy variables, or one that failed before asking)")


def stop_egress(job: Job) -> None:
    if job.egress is None:
        return
    job.egress.stop()
    if job.egress.decisions_dropped:
        job.risks.append(f"{job.egress.decisions_dropped} network requests past the proxy's cap were refused "
                         "without a ledger row each")
    if job.egress.callback_errors:
        job.risks.append(f"network requests were refused because their ledger row failed: "
                         f"{job.egress.callback_errors[0]}")


def start_proxy(job: Job, allowed: Sequence[str], sock: str, *, agent: bool = False) -> EgressProxy:
    """A started proxy to `allowed` (host:port entries) on a socket in the job's host dir, each decision a row.
    Imported here, when a job has one: the proxy runs an asyncio loop, and asyncio with ssl is 8 MB of every
    host process that loads it (measured 2026-12-07), which a job without network never needs."""
    from proctor.mechanisms.confine.egress import EgressProxy

    return EgressProxy(allowed, job.host_tmp / sock, on_decision=egress_row(job, agent=agent)).start()


def registry_proxy(job: Job, cfg: RepoSettings, sock: str, what: str) -> EgressProxy | None | str:
    """A proxy to the repo's `registries` for its setup steps; None without registries or confinement (no
    network to restrict), a str when it could not start (why)."""
    if not cfg.registries or job.confiner is None or job.confiner.name == "none":
        return None
    try:
        return start_proxy(job, cfg.registries, sock)
    except (OSError, RuntimeError, ValueError) as exc:
        return f"{what} not run: its registry proxy did not start: {exc}"
