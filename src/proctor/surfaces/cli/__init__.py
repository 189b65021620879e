"""The `proctor` console script: thin commands that parse, call one service function and print.

No policy lives here. Each command module registers itself on `main` when `main` first needs it
(proctor.surfaces.cli.main.COMMANDS); results go to stdout as JSON, human progress to stderr; a refused or
unusable call is a clear message and exit 2, never a traceback.
"""

from __future__ import annotations

from proctor.surfaces.cli.main import main

__all__ = ["main"]
