"""`proctor doctor`: what validation will run on a repo and what the base's own run says, with no agent.

Prints the report as JSON (proctor.services.job.doctor); exit 0 when the base runs (its own failing tests
are listed, not a fault), 1 when it cannot (the causes name what is missing and the config line that
fixes it), 2 for an unusable config.
"""

from __future__ import annotations

import json
import os
import sys

import click

from proctor.mechanisms.config.load import ConfigError, load_config
from proctor.mechanisms.terminal import json_safe
from proctor.services.job.doctor import doctor
from proctor.surfaces.cli.main import main
from proctor.surfaces.cli.progress import for_stderr


@main.command("doctor")
@click.option("--repo", required=True, help="Path of the git repo (made absolute).")
@click.option("--branch", help="Base ref (default: as run-agent chooses it).")
@click.option("--validate-cmd", help="The validation command a job would be given (default: the repo's own).")
@click.option("--confine", type=click.Choice(["auto", "required", "off"]),
              help="Confinement policy (default: config's).")
@click.option("--config", "config_file", help="Config TOML (else $PROCTOR_CONFIG, else $PROCTOR_HOME/config.toml).")
def doctor_cmd(repo, branch, validate_cmd, confine, config_file) -> None:
    """Run the base's own validation as a job would, with no agent; print what ran, each test's outcome,
    and what is missing (exit 0 when the base runs, 1 when it cannot)."""
    try:
        config = load_config(config_file)
    except ConfigError as exc:
        click.echo(json_safe(json.dumps({"runnable": False, "causes": exc.problems}, indent=2)))
        sys.exit(2)
    progress = for_stderr()
    try:
        report = doctor(os.path.abspath(repo), config, branch=branch, validate_command=validate_cmd,
                        confine_mode=confine, progress=progress)
    finally:
        progress.close()
    click.echo(json_safe(json.dumps(report, indent=2, default=str)))
    for cause in report.get("causes") or []:
        progress.say(f"proctor doctor: {cause}")
    sys.exit(0 if report.get("runnable") else 1)
