"""The `proctor` click group the command modules register on; `cli/__init__` imports them all."""

from __future__ import annotations

import click


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="proctor")
def main() -> None:
    """Run coding agents under limits a person set; the host, not the agent, owns the verdict.

    Proctor's state (config.toml, policy.toml, the ledger, keys, job records) is in $PROCTOR_HOME, which is
    ~/.proctor unless set."""
