"""`proctor usage [--json] [--fleet]`: each spend budget's current windows against its limits.

A thin command: the trusted policy's budgets (proctor.mechanisms.policy.trusted), the tally they are counted in (this home's
SQLite for jobs run here; with `--fleet`, the queue's KV bucket every listener books in) and the governor's
`spend()`. It changes nothing. A policy that cannot be read is `proctor: usage refused (CONFIG_INVALID): ...`
and exit 2; a tally that cannot be reached is `... (BUDGET_UNAVAILABLE): ...` and exit 1.
"""

from __future__ import annotations

import json
import sys
import time
from typing import NoReturn

import click

from proctor.surfaces.cli.main import main
from proctor.contract import Code
from proctor.home import ensure_home
from proctor.mechanisms.policy.governor import UsageGovernor
from proctor.mechanisms.policy.windows import iso
from proctor.mechanisms.policy.tally import SqliteTally, Tally, TallyError, fleet_tally
from proctor.mechanisms.policy.trusted import Policy, PolicyError
from proctor.mechanisms.terminal import json_safe, visible


def _refuse(code: Code, why: str, exit_code: int) -> NoReturn:
    click.echo(f"proctor: usage refused ({code.value}): {visible(why)}", err=True)
    sys.exit(exit_code)


@main.command("usage")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--fleet", is_flag=True,
              help="The queue's tally (jobs that came through the queue), not this home's (jobs run here).")
@click.option("--queue", "queue_url", envvar="PROCTOR_QUEUE",
              help="With --fleet: NATS URL (else $PROCTOR_QUEUE, [queue] servers, the bundled local server).")
@click.option("--config", "config_file", help="Config TOML, for its [queue] settings.")
def usage_cmd(as_json: bool, fleet: bool, queue_url: str | None, config_file: str | None) -> None:
    """Spend per budget in the current hour and day (UTC) against its limits."""
    try:
        budgets = Policy.load().budgets
    except PolicyError as exc:
        _refuse(Code.CONFIG_INVALID, str(exc), 2)
    if fleet:
        from proctor.surfaces.cli.queue import queue_settings, resolve_queue

        url, settings = resolve_queue(queue_url, config_file), queue_settings(config_file)

        def store() -> Tally:
            return fleet_tally(url, settings, ensure_home())
    else:
        store = SqliteTally.default
    governor = UsageGovernor(budgets, store)
    try:
        spend = governor.spend() if budgets else []
        where = governor.store or ("jetstream" if fleet else "sqlite")
    except TallyError as exc:
        _refuse(Code.BUDGET_UNAVAILABLE, str(exc), 1)
    finally:
        governor.close()
    rows = [s.as_dict() for s in spend]
    if as_json:
        click.echo(json_safe(json.dumps({"store": where, "at": iso(time.time()), "budgets": rows}, indent=2)))
        return
    if not rows:
        click.echo("no budgets in the trusted policy ([budgets.<name>] in policy.toml)")
        return
    click.echo(f"{'budget':<20} {'pool':<28} {'limit':<16} {'spent':>12} {'allowed':>12} {'left':>12}  window (UTC)")
    for row in rows:
        pool = " ".join(f"{k}={v}" for k, v in row["pool"].items() if v is not None)
        for lim in row["limits"]:
            window = f"{lim['window_start'][:16]} - {lim['window_end'][11:16]}"
            click.echo(visible(f"{row['budget']:<20} {pool:<28} {lim['limit']:<16} {lim['spent']:>12} "
                               f"{lim['allowed']:>12} {lim['left']:>12}  {window}"))
    click.echo(f"({where} tally)")
