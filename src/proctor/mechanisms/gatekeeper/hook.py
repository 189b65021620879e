"""The hook as a CLI runs it for one job: the client script (`hook_client.py`), its copy and compiled form
in the gate dir, the command line that runs it, its shell quoting, and the CLI's timeout for it.

Below the service and every dialect; it never speaks to the socket (the client does) and never decides a call.
"""

from __future__ import annotations

import os
import py_compile
import shutil
import sys
from pathlib import Path

HOOK_CLIENT = Path(__file__).resolve().parent / "hook_client.py"
# What the CLI runs: the client compiled once per job (GateService.start), beside its source. Run as a .py it
# was compiled again by every tool call (~0.9 ms of a ~8 ms call, issue 25); the interpreter runs a .pyc
# given as the script without looking for a source, so the compiled one is what each call loads.
HOOK_CLIENT_PYC = "hook_client.pyc"
HOOK_TIMEOUT_S = 60  # the CLI's own timeout for the hook; the client gives up (deny) well before it


def shell_word(arg: str) -> str:
    """`arg` as one single-quoted POSIX shell word."""
    return "'" + arg.replace("'", "'\\''") + "'"


def client_command(dir: Path, socket: Path, cli: str) -> list[str]:
    """The hook as the CLI runs it, with the paths it has inside the sandbox (`dir`: the job's gate dir)."""
    return [os.path.realpath(sys.executable), "-I", "-S", str(dir / HOOK_CLIENT_PYC), str(socket), cli]


def install_client(dir: Path) -> None:
    """The client's source and its compiled form in the gate dir (GateService.start)."""
    shutil.copyfile(HOOK_CLIENT, dir / "hook_client.py")  # the source, for a person reading the gate dir
    compile_client(dir / "hook_client.py", dir / HOOK_CLIENT_PYC)


def compile_client(source: Path, target: Path) -> None:
    """The hook client compiled by this interpreter (the one `client_command` names, so its bytecode version),
    unchecked against its source: the hook runs it as its script, which never consults a source anyway. A
    failure is an OSError, as for the other files `start` writes."""
    try:
        py_compile.compile(str(source), cfile=str(target), doraise=True, optimize=0,
                           invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    except py_compile.PyCompileError as exc:
        raise OSError(f"the hook client did not compile: {exc.msg}") from exc
