"""The `proctor` console script: thin commands that parse, call one service function and print.

No policy lives here. Each command module registers itself on `main`; results go to stdout as JSON,
human progress to stderr; a refused or unusable call is a clear message and exit 2, never a traceback.
"""

from __future__ import annotations

import click


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="proctor")
def main() -> None:
    """Run coding agents under limits a person set; the host, not the agent, owns the verdict.

    Proctor's state (config.toml, policy.toml, the ledger, keys, job records) is in $PROCTOR_HOME, which is
    ~/.proctor unless set."""


# Command modules: each adds itself to `main` on import. One line per module, keep sorted.
from proctor.cli import adapters as _adapters  # noqa: E402,F401
from proctor.cli import commands as _commands  # noqa: E402,F401
from proctor.cli import mcp as _mcp  # noqa: E402,F401
from proctor.cli import policy as _policy  # noqa: E402,F401
from proctor.cli import queue as _queue  # noqa: E402,F401
from proctor.cli import review as _review  # noqa: E402,F401
from proctor.cli import run_agent as _run_agent  # noqa: E402,F401
from proctor.cli import schema as _schema  # noqa: E402,F401
from proctor.cli import serve as _serve  # noqa: E402,F401
from proctor.cli import usage as _usage  # noqa: E402,F401
