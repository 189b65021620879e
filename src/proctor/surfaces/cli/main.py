"""The `proctor` click group the command modules register on, each loaded when its command is asked for.

A command module adds its commands to `main` on import. `COMMANDS` says which module holds which command,
so `proctor jobs` imports the review commands and not the job path, the queue client or the MCP server:
every module imported up front made each command start in 0.6 s, which the suite pays hundreds of times
and a person pays on every `proctor stop`. Help and an unknown name load them all.
"""

from __future__ import annotations

import importlib

import click

# command -> the module under proctor.surfaces.cli that registers it (tests check the two agree).
COMMANDS = {
    "adapters": "adapters",
    "doctor": "doctor",
    "run-request": "commands",
    "keys": "keys",
    "mcp": "mcp",
    "stop": "policy", "resume": "policy", "check-task": "policy", "decide": "policy", "approve": "policy",
    "ledger": "policy",
    "enqueue": "queue", "send": "queue", "listen": "queue", "job": "queue", "cancel": "queue",
    "jobs": "review", "show": "review", "diff": "review", "land": "review", "discard": "review", "gc": "review",
    "run-agent": "run_agent",
    "race": "race",
    "schema": "schema",
    "serve": "serve",
    "usage": "usage",
}


def load(module: str) -> None:
    importlib.import_module(f"proctor.surfaces.cli.{module}")


def load_all() -> None:
    for module in sorted(set(COMMANDS.values())):
        load(module)


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*COMMANDS, *self.commands})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands:
            if cmd_name in COMMANDS:
                load(COMMANDS[cmd_name])
            else:
                load_all()  # a misspelt name: click's "no such command" then lists every one there is
        return super().get_command(ctx, cmd_name)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="proctor")
def main() -> None:
    """Run coding agents under limits a person set; the host, not the agent, owns the verdict.

    Proctor's state (config.toml, policy.toml, the ledger, keys, job records) is in $PROCTOR_HOME, which is
    ~/.proctor unless set."""
