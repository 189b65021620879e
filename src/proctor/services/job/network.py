"""A job's network: the host-run egress proxies (the agent's, to its adapter's declared hosts; setup's, to
the repo's registries), each decision a ledger row and each refusal a risk a person reads. Never opens a
network to code the agent wrote: validation has none."""

from __future__ import annotations

from collections.abc import Callable

from proctor.mechanisms.config.settings import RepoSettings
from proctor.mechanisms.confine.egress import EgressProxy
from proctor.services.job.context import Job


def egress_row(job: Job) -> Callable[[dict], None]:
    def row(decision: dict) -> None:
        job.ledger.append("egress.decision", {"jobId": job.job_id, **decision}, job_id=job.job_id)
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


def registry_proxy(job: Job, cfg: RepoSettings, sock: str, what: str) -> EgressProxy | None | str:
    """A proxy to the repo's `registries` for its setup steps; None without registries or confinement (no
    network to restrict), a str when it could not start (why)."""
    if not cfg.registries or job.confiner is None or job.confiner.name == "none":
        return None
    try:
        return EgressProxy(cfg.registries, job.host_tmp / sock, on_decision=egress_row(job)).start()
    except (OSError, RuntimeError, ValueError) as exc:
        return f"{what} not run: its registry proxy did not start: {exc}"
