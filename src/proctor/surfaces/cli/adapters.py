"""`proctor adapters list|show NAME`: the adapters a job may name, as the config makes them (built-ins with
the user's overlays, and the user's own)."""

from __future__ import annotations

import json
import sys

import click

from proctor.surfaces.cli.main import main
from proctor.mechanisms.config.load import ConfigError, load_config


@main.group("adapters")
def adapters_group() -> None:
    """The agent adapters of this config."""


def _config(path: str | None):
    try:
        return load_config(path)
    except ConfigError as exc:
        click.echo(f"proctor: {exc}", err=True)
        sys.exit(2)


@adapters_group.command("list")
@click.option("--config", "config_path", default=None, help="Config TOML (else $PROCTOR_CONFIG, else the home's).")
def list_cmd(config_path: str | None) -> None:
    """One JSON object per adapter: name, description, and the keys a user table overlays on a built-in."""
    cfg = _config(config_path)
    click.echo(json.dumps([{"name": n, "description": s.description, "overlaid": list(cfg.overlays.get(n, ()))}
                           for n, s in sorted(cfg.agents.items())], indent=2))


@adapters_group.command("show")
@click.argument("name")
@click.option("--config", "config_path", default=None, help="Config TOML (else $PROCTOR_CONFIG, else the home's).")
def show_cmd(name: str, config_path: str | None) -> None:
    """The adapter as a job gets it, and which of its keys came from the user's table over the built-in."""
    cfg = _config(config_path)
    spec = cfg.adapter(name)
    if spec is None:
        click.echo(f"proctor: unknown adapter {name!r} (known: {', '.join(sorted(cfg.agents))})", err=True)
        sys.exit(2)
    overlaid = list(cfg.overlays.get(name, ()))
    if overlaid:
        click.echo(f"proctor: {name} is the built-in with {', '.join(overlaid)} from {cfg.source}", err=True)
    click.echo(json.dumps({**spec.model_dump(mode="json"), "overlaid": overlaid}, indent=2))
