"""An adapter's state may be a file as well as a directory (a user of Claude Code has `~/.claude.json`): a
confined job gets that file writable in place and nothing else beside it; the built-in claude keeps its
config inside `~/.claude` (CLAUDE_CONFIG_DIR), so a save by rename works under confinement. Every job writes
its own copy of the state (proctor.services.job.sandbox_home): nothing of it comes back. Real bwrap /
Landlock; under CI=true a machine without either fails instead of skipping."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from proctor.mechanisms.config.load import load_config
from proctor.mechanisms.confine import detect
from proctor.contract import RunAgentRequest, Status
from proctor.services.job.run_agent import run_agent

CAPS = detect()
if CAPS.bwrap is None and not CAPS.landlock and os.environ.get("CI") == "true":
    pytest.fail("CI must have bwrap or Landlock for the state-file tests", pytrace=False)
pytestmark = pytest.mark.skipif(CAPS.bwrap is None and not CAPS.landlock, reason="no OS confinement here")


def job(repo: Path, tmp_path: Path, adapter: str) -> object:
    cfg = tmp_path / "c.toml"
    cfg.write_text('confine = "required"\n' + adapter)
    req = RunAgentRequest(agent="st", task="t", repo=str(repo), ticket="T", validateCommand="true")
    return run_agent(req, config=load_config(cfg))


@pytest.mark.parametrize("keep", [True, False])
def test_a_state_file_is_the_jobs_copy_and_its_neighbours_are_not(repo, tmp_path, keep):
    """The job writes its copy of the state file (its HOME is its own); the user's file never gets the
    change, a login (`state_keep`) neither, which the result names (control: without it, nothing is said)."""
    home = Path(os.environ["HOME"])
    (home / ".st.json").write_text('{"n": 1}')
    (home / "neighbour").write_text("keep")
    script = ('echo \'{"n": 2}\' > "$HOME/.st.json"; echo changed > "$HOME/neighbour" 2>/dev/null; '
              'echo new > "$HOME/.st.json.tmp" 2>/dev/null; echo x > a.txt')
    res = job(repo, tmp_path, '[agents.st]\ncommand = ["sh", "-c", ' + json.dumps(script) + ']\nprompt = "stdin"\n'
              'network = false\nstate_dirs = ["~/.st.json"]\n' + ('state_keep = ["~/.st.json"]\n' if keep else ""))
    assert res.status is Status.completed, res
    assert json.loads((home / ".st.json").read_text()) == {"n": 1}
    assert res.confinement_details["state"]["login_changed"] == (["~/.st.json"] if keep else [])
    assert (home / "neighbour").read_text() == "keep"  # beside it: not
    assert not (home / ".st.json.tmp").exists()


def test_control_without_the_grant_the_same_write_is_refused(repo, tmp_path):
    home = Path(os.environ["HOME"])
    (home / ".st.json").write_text('{"n": 1}')
    script = 'echo \'{"n": 2}\' > "$HOME/.st.json" 2>/dev/null; echo x > a.txt'
    res = job(repo, tmp_path, '[agents.st]\ncommand = ["sh", "-c", ' + json.dumps(script) + ']\nprompt = "stdin"\n'
              'network = false\n')
    assert res.status is Status.completed and json.loads((home / ".st.json").read_text()) == {"n": 1}


def test_builtin_claude_saves_its_config_by_rename_inside_its_state_dir(repo, tmp_path, fake_bin):
    """A stand-in `claude` that saves the way Claude Code 2.1 does (measured with strace: write
    `$CLAUDE_CONFIG_DIR/.claude.json.tmp.PID.x`, rename over `.claude.json`), with the user's own
    `~/.claude.json` present: the job runs (it was CONFINEMENT_UNAVAILABLE), the save lands in ~/.claude."""
    home = Path(os.environ["HOME"])
    (home / ".claude.json").write_text('{"user": "theirs"}')
    claude = fake_bin / "claude"
    claude.write_text('#!/bin/sh\nd="${CLAUDE_CONFIG_DIR:-$HOME}"\n'
                      'echo \'{"saved": true}\' > "$d/.claude.json.tmp.$$" && mv "$d/.claude.json.tmp.$$" "$d/.claude.json"'
                      ' || exit 3\necho x > a.txt\n'
                      'echo \'{"type":"result","is_error":false,"result":"done"}\'\n')
    claude.chmod(0o755)
    cfg = tmp_path / "c.toml"
    # The stand-in asks no model, so it has no network: a networked CLI that sent nothing through its proxy
    # never reached its model, and its job is AGENT_FAILED (network.never_reached).
    cfg.write_text('confine = "required"\n[agents.claude]\nnetwork = false\negress = []\n')
    req = RunAgentRequest(agent="claude", task="t", repo=str(repo), ticket="T", validateCommand="true")
    res = run_agent(req, config=load_config(cfg))
    assert res.status is Status.completed and res.summary == "done", res
    # The save landed in the job's copy of ~/.claude, which is not kept: the user's state never gets it.
    assert not (home / ".claude" / ".claude.json").exists()
    assert json.loads((home / ".claude.json").read_text()) == {"user": "theirs"}  # the user's own, untouched


@pytest.mark.parametrize("write, watched", [
    ("plugins/store/cc-plugin-agents-md_builtin-b049b47b3618.json", False),  # 2.1.332's usage store: state
    ("plugins/installed_plugins.json", True),  # control: which plugins are installed is config
    ("plugins/marketplaces/m/plugin.json", True),
])
def test_claudes_plugin_usage_store_is_state_and_its_plugins_stay_watched(tmp_path, write, watched):
    """claude 2.1.332 writes its built-in plugins' usage store every run: not a config change. A plugin
    installed or a marketplace's code changed still is."""
    from proctor.mechanisms.config.load import builtin_agents
    from proctor.services.job import sandbox_home

    user = tmp_path / "user"
    for rel in ("plugins/installed_plugins.json", "plugins/marketplaces/m/plugin.json",
                "plugins/store/cc-plugin-agents-md_builtin-b049b47b3618.json"):
        (user / ".claude" / rel).parent.mkdir(parents=True, exist_ok=True)
        (user / ".claude" / rel).write_text("{}")
    copy = sandbox_home.copy_state(tmp_path / "job", user, builtin_agents()["claude"])
    assert not isinstance(copy, str), copy
    (tmp_path / "job" / ".claude" / write).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / "job" / ".claude" / write).write_text('{"uses": 2}')
    changed = sandbox_home.settle(copy).changed_config
    assert bool(changed) is watched and all("store" not in c for c in changed), changed


def test_a_seed_goes_into_the_jobs_copy_only_where_the_user_has_none(tmp_path):
    """opencode installs its plugin package from npm into a config dir with no node_modules (a refused
    egress row, a risk, on every job): the job's copy is seeded with an empty one and a lock naming it. A
    user's own lock stays as it is, and the user's home is never written."""
    from proctor.mechanisms.config.load import builtin_agents
    from proctor.services.job import sandbox_home

    spec = builtin_agents()["opencode"]
    bare, own = tmp_path / "bare", tmp_path / "own"
    bare.mkdir()
    (own / ".config" / "opencode").mkdir(parents=True)
    (own / ".config" / "opencode" / "package-lock.json").write_text('{"mine": true}')
    for user in (bare, own):
        job = tmp_path / f"job-{user.name}"
        assert not isinstance(sandbox_home.copy_state(job, user, spec), str)
        assert (job / ".config" / "opencode" / "node_modules").is_dir()
        lock = json.loads((job / ".config" / "opencode" / "package-lock.json").read_text())
        assert lock == ({"mine": True} if user is own else
                        {"lockfileVersion": 3, "packages": {"": {"dependencies": {"@opencode-ai/plugin": "*"}}}})
    assert not (bare / ".config").exists() and not (own / ".config" / "opencode" / "node_modules").exists()


def test_a_seed_outside_the_adapters_state_dirs_is_refused(tmp_path):
    from proctor.mechanisms.config.load import ConfigError

    cfg = tmp_path / "c.toml"
    cfg.write_text('[agents.st]\ncommand = ["true"]\nstate_dirs = ["~/.st"]\nstate_seed = { "~/.bashrc" = "x" }\n')
    with pytest.raises(ConfigError, match="state_seed entry '~/.bashrc'"):
        load_config(cfg)
