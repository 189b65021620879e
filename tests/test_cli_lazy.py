"""The console script loads a command's module when that command is asked for (surfaces/cli/main.py):
its table must name every command each module registers, and a command must start without the job path."""

from __future__ import annotations

import subprocess
import sys

from proctor.surfaces.cli.main import COMMANDS, load_all, main


def test_the_table_names_each_command_where_it_is_registered() -> None:
    load_all()
    defined = {name: cmd.callback.__module__.rpartition(".")[2] for name, cmd in main.commands.items()}
    assert defined == COMMANDS


def test_a_command_loads_its_own_module_only() -> None:
    probe = ("import sys\nfrom proctor.surfaces.cli import main\n"
             "try:\n    main(['stop', '--help'])\nexcept SystemExit:\n    pass\n"
             "print(sorted(m for m in sys.modules if m.startswith('proctor.')), file=sys.stderr)")
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert "Usage:" in res.stdout and "stop" in res.stdout
    loaded = res.stderr
    assert "proctor.surfaces.cli.policy" in loaded  # the control: the asked command's module did load
    for other in ("proctor.services.job.run_agent", "proctor.surfaces.cli.queue", "proctor.surfaces.cli.mcp"):
        assert other not in loaded, other


def test_help_and_a_misspelt_command_still_list_every_command() -> None:
    for argv, code in ((["--help"], 0), (["jbos"], 2)):
        res = subprocess.run([sys.executable, "-c", "from proctor.surfaces.cli import main; main()", *argv],
                             capture_output=True, text=True)
        assert res.returncode == code, res.stderr
        text = res.stdout + res.stderr
        if code == 0:
            assert all(c in text for c in COMMANDS), text
        else:
            assert "No such command 'jbos'" in text and "Traceback" not in text, text
