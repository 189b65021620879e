"""Issue 24's human errors and named causes: config problems as one list in proctor's words, flags named as
flags, a missing agent program, a configured `validate`, a 127 under the private tmpfs, and the review
verbs' wording (discard twice, gc's age, cancelled validation, leftover TMPDIRs). Each test has its control:
the same path where nothing is wrong."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from proctor.mechanisms import confine
from proctor.surfaces.cli.review import _ended_as
from proctor.mechanisms.config.load import ConfigError, key_lines, load_config
from proctor.contract import Code, RunAgentRequest, Status
from proctor.services.job.attempts import exec_missing, missing_program, run_attempts, tmpfs_hint
from proctor.services.job.run_agent import run_agent
from proctor.mechanisms.process.spawn import Exit, Spawn
from proctor.services.job.progress import NullProgress
from proctor.services.review import gc as gc_mod
from proctor.services.review.jobs import Job
from proctor.mechanisms.adapters.testing import Behaviour

PROCTOR = str(Path(sys.executable).with_name("proctor"))
PYDANTIC_WORDS = ("Input should be", "Extra inputs are not permitted", "Field required", "Value error")


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    p = subprocess.run([PROCTOR, *args], check=False, capture_output=True, text=True, timeout=120,
                       env=env or os.environ.copy())
    assert "Traceback" not in p.stderr, p.stderr
    return p


# -- config problems -------------------------------------------------------------------------------------

BAD = '''confine = "maybe"
validate_timout = 30

[limits]
memory = "lots"
pid = 5

[agents.mine]
comand = ["x", "{prompt}"]

[queue]
servers = "nats://x"

[repos."/abs/r"]
validat = "make test"
'''
GOOD = '''confine = "off"
validate_timeout = 30

[limits]
memory = "1GiB"
pids = 64

[agents.mine]
command = ["x", "{prompt}"]

[queue]
servers = ["nats://x:4222"]

[repos."/abs/r"]
validate = "make test"
'''


def test_every_config_problem_at_once_with_its_line_key_and_a_suggestion(tmp_path):
    bad = tmp_path / "c.toml"
    bad.write_text(BAD)
    with pytest.raises(ConfigError) as info:
        load_config(bad)
    problems = info.value.problems
    text = str(info.value)
    assert not any(w in text for w in PYDANTIC_WORDS), text
    expected = [
        (1, "confine: 'maybe' is not allowed; use 'auto', 'required' or 'off'"),
        (2, "validate_timout: unknown key; did you mean 'validate_timeout'?"),
        (5, "limits.memory: size 'lots'"),
        (6, "limits.pid: unknown key; did you mean 'pids'?"),
        (8, "agents.mine.command: missing"),
        (9, "agents.mine.comand: unknown key; did you mean 'command'?"),
        (12, "queue.servers: got text 'nats://x', must be a list"),
        (15, "repos.\"/abs/r\".validat: unknown key; did you mean 'validate'?"),
    ]
    assert len(problems) == len(expected), problems
    for line, (n, what) in zip(problems, expected, strict=True):
        assert line.startswith(f"{bad}:{n} {what}"), (line, n, what)
    assert text.splitlines() == problems
    # control: the same keys, spelled and typed right, load
    good = tmp_path / "good.toml"
    good.write_text(GOOD)
    cfg = load_config(good)
    assert cfg.confine == "off" and cfg.limits.pids == 64 and "mine" in cfg.agents


def test_a_toml_syntax_error_names_its_line(tmp_path):
    bad = tmp_path / "c.toml"
    bad.write_text('confine = "off"\nthis is = = not\n')
    with pytest.raises(ConfigError, match=rf"^{bad}:2: not valid TOML: ") as info:
        load_config(bad)
    assert "(at line" not in str(info.value)


def test_key_lines_reads_headers_quoted_keys_and_skips_multiline_strings():
    text = ('a = 1\n[repos."/x/y.z"]\nvalidate = """\nfake = 1\n"""\nsetup = ["s"]\n'
            "[agents.b]\nenv = { K = \"v\" }\nb.c = 2\n")
    lines = key_lines(text)
    assert lines[("a",)] == 1 and lines[("repos", "/x/y.z")] == 2 and lines[("repos", "/x/y.z", "validate")] == 3
    assert ("fake",) not in lines and ("repos", "/x/y.z", "fake") not in lines  # inside a string
    assert lines[("repos", "/x/y.z", "setup")] == 6 and lines[("agents", "b", "env")] == 8
    assert lines[("agents", "b", "b", "c")] == 9


def test_run_agent_lists_each_config_problem_as_a_risk(tmp_path, repo):
    bad = tmp_path / "c.toml"
    bad.write_text(BAD)
    p = cli("run-agent", "--agent", "patch", "--task", "x", "--repo", str(repo), "--ticket", "T", "--config", str(bad))
    out = json.loads(p.stdout)
    assert p.returncode == 1 and out["code"] == "CONFIG_INVALID"
    assert len(out["known_risks"]) == 8 and all(r.startswith(f"{bad}:") for r in out["known_risks"])
    assert p.stderr.startswith("proctor: refused (CONFIG_INVALID): ") and "did you mean 'pids'" in p.stderr
    # control: a good file is no refusal (the job runs; its diff does not apply: AGENT_FAILED)
    good = tmp_path / "good.toml"
    good.write_text('confine = "off"\n')
    p = cli("run-agent", "--agent", "patch", "--task", "x", "--repo", str(repo), "--ticket", "T", "--config", str(good))
    assert json.loads(p.stdout)["code"] != "CONFIG_INVALID"


def test_a_bad_timeout_names_the_flag_not_the_field(repo):
    p = cli("run-agent", "--agent", "patch", "--task", "x", "--repo", str(repo), "--ticket", "T", "--timeout", "soon")
    out = json.loads(p.stdout)
    assert out["known_risks"] == ["invalid request: --timeout: 'soon' is not a finite number"], out["known_risks"]
    assert "timeoutSec" not in p.stdout + p.stderr
    # control: a good timeout is no refusal
    p = cli("run-agent", "--agent", "patch", "--task", "x", "--repo", str(repo), "--ticket", "T", "--timeout", "120")
    assert json.loads(p.stdout)["code"] != "INVALID_REQUEST"


# -- a missing agent program ---------------------------------------------------------------------------------

def _ghost_config(tmp_path: Path, confine_mode: str, program: str) -> Path:
    cfg = tmp_path / f"ghost-{confine_mode}.toml"
    cfg.write_text(f'confine = "{confine_mode}"\n[agents.ghost]\ncommand = ["{program}", "{{prompt}}"]\n'
                   "network = false\n")
    return cfg


def _modes() -> list[str]:
    confined = not isinstance(confine.choose("required", confine.detect()), confine.Unavailable)
    return ["off", "required"] if confined else ["off"]


@pytest.mark.parametrize("mode", _modes())
def test_a_missing_agent_program_is_agent_not_found_and_never_launched(tmp_path, repo, fake, mode):
    req = RunAgentRequest(agent="ghost", task="t", repo=str(repo), ticket="T", validateCommand="true")
    res = run_agent(req, config=load_config(_ghost_config(tmp_path, mode, "proctor-no-such-agent")))
    assert res.status is Status.failed and res.code is Code.AGENT_NOT_FOUND, res
    assert res.attempts == 0 and res.exit_codes == [], res
    assert "proctor-no-such-agent" in res.summary and "exited None" not in res.summary
    assert not any("confinement refused" in r or "retried" in r.replace("not retried", "") for r in res.known_risks)
    # control: the same adapter with a program that is there launches it
    fake("ghostly", Behaviour(writes={"a.txt": "1"}))
    res = run_agent(req, config=load_config(_ghost_config(tmp_path, mode, "ghostly")))
    assert res.code is not Code.AGENT_NOT_FOUND and res.attempts >= 1, res


def test_missing_program_and_the_sandboxs_failed_exec_are_named(tmp_path):
    assert "was not found on the PATH" in missing_program("nope-xyz", str(tmp_path), tmp_path)
    exe = tmp_path / "tool"
    exe.write_text("#!/bin/sh\n")
    assert "not an executable file" in missing_program(str(exe), None, tmp_path)
    exe.chmod(0o755)
    # control: an executable by path, and one on PATH
    assert missing_program(str(exe), None, tmp_path) is None and missing_program("tool", str(tmp_path), Path("/")) is None
    gone = Exit(127, stderr=b"proctor-landlock: exec codex: No such file or directory\n")
    assert exec_missing(gone) == "codex"
    assert exec_missing(Exit(1, stderr=b"bwrap: execvp codex: No such file or directory\n")) == "codex"
    # control: the agent's own "No such file" (a file it opened) is not a missing program
    assert exec_missing(Exit(1, stderr=b"cat: x: No such file or directory\n")) is None
    assert exec_missing(Exit(0, stderr=b"proctor-landlock: exec codex: No such file or directory\n")) is None


class _Runner:
    """A ProcessRunner that answers with fixed exits, counting spawns."""

    def __init__(self, *exits: Exit) -> None:
        self.exits, self.spawns = list(exits), 0

    def run(self, spawn: Spawn) -> Exit:
        self.spawns += 1
        return self.exits.pop(0)


def _attempts(tmp_path: Path, runner: _Runner, argv: list[str], path: str) -> object:
    from proctor.mechanisms.config.load import builtin_agents

    spec = builtin_agents()["patch"].model_copy(update={"command": (sys.executable, "{prompt}"), "retry": True})
    return run_attempts(spec=spec, argv=argv, stdin=None, env={"PATH": path}, cwd=tmp_path, runner=runner,
                        progress=NullProgress(), poll=lambda: None, timeout_s=60, term_grace_s=0.1, name="t",
                        confined=True)


def test_an_exec_the_sandbox_could_not_make_is_not_retried(tmp_path):
    runner = _Runner(Exit(127, stderr=b"proctor-landlock: exec codex: No such file or directory\n"))
    out = _attempts(tmp_path, runner, ["/usr/bin/bwrap", "--", "codex"], "/usr/bin")
    assert out.code is Code.AGENT_NOT_FOUND and runner.spawns == 1
    assert not any("confinement refused" in r for r in out.risks), out.risks
    # control: an ordinary failure is retried once
    runner = _Runner(Exit(3, stderr=b"boom\n"), Exit(0))
    out = _attempts(tmp_path, runner, ["/usr/bin/bwrap", "--", "codex"], "/usr/bin")
    assert out.code is Code.OK and runner.spawns == 2


def test_exit_127_under_the_private_tmpfs_gets_a_hint(tmp_path):
    hint = tmpfs_hint(127, "sh: 1: /tmp/tools/bin/tox: not found\n", "/usr/bin")
    assert hint and "/tmp/tools/bin/tox" in hint and "private" in hint
    on_path = tmpfs_hint(127, "sh: 1: tox: not found\n", "/tmp/venv/bin:/usr/bin")
    assert on_path and "/tmp/venv/bin" in on_path and "on its PATH" in on_path
    runner = _Runner(Exit(127, stderr=b"sh: 1: tox: not found\n"), Exit(127, stderr=b"sh: 1: tox: not found\n"))
    out = _attempts(tmp_path, runner, ["/usr/bin/bwrap", "--", "x"], "/tmp/venv/bin:/usr/bin")
    assert any("private, empty tmpfs" in r for r in out.risks), out.risks
    # Any file error naming a path there (issue 43: a script's `cp` of a file under /tmp, "cannot stat").
    cp = tmpfs_hint(1, "cp: cannot stat '/tmp/data/input.csv': No such file or directory\n", "/usr/bin")
    assert cp and "/tmp/data/input.csv" in cp and "exit 1" in cp, cp
    # control: no file error, exit 0, a path outside the tmpfs dirs, or no bubblewrap: no hint
    assert tmpfs_hint(1, "wrote /tmp/x.log; 3 tests failed", "/tmp/venv/bin") is None
    assert tmpfs_hint(0, "cp: cannot stat '/tmp/x': No such file or directory", "/usr/bin") is None
    assert tmpfs_hint(127, "sh: 1: /opt/tox: not found", "/usr/bin") is None
    runner = _Runner(Exit(127, stderr=b"sh: 1: tox: not found\n"), Exit(127, stderr=b"sh: 1: tox: not found\n"))
    out = _attempts(tmp_path, runner, ["landlock-exec", "--", "x"], "/tmp/venv/bin:/usr/bin")
    assert not any("tmpfs" in r for r in out.risks), out.risks


# -- a configured validate ---------------------------------------------------------------------------------

def test_a_configured_validate_runs_where_autodetection_finds_nothing(tmp_path, repo, fake):
    fake("claude", Behaviour(writes={"a.txt": "1"}))
    req = RunAgentRequest(agent="claude", task="t", repo=str(repo), ticket="T")
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'confine = "off"\n[repos."{repo}"]\nvalidate = "test -f a.txt"\n')
    res = run_agent(req, config=load_config(cfg))
    assert res.tests_attempted == ["test -f a.txt => exit 0"], res
    assert res.status is Status.completed and not any("skipped" in r for r in res.known_risks), res.known_risks
    # control: without it the repo has nothing to run, and the result says validation was skipped
    plain = tmp_path / "plain.toml"
    plain.write_text('confine = "off"\n')
    res = run_agent(RunAgentRequest(agent="claude", task="t", repo=str(repo), ticket="T2"), config=load_config(plain))
    assert res.tests_attempted == [] and res.needs_human_review, res


# -- review verbs ------------------------------------------------------------------------------------------

def _job(repo: Path, ticket: str) -> dict:
    p = cli("run-agent", "--agent", "claude", "--task", "t", "--repo", str(repo), "--ticket", ticket,
            "--validate-cmd", "true")
    return json.loads(p.stdout)


def test_a_second_discard_says_already_discarded_and_fails(repo, fake):
    fake("claude", Behaviour(writes={"a.txt": "1"}))
    job = _job(repo, "T")["jobId"]
    first = cli("discard", job)
    assert first.returncode == 0 and "discarded job" in first.stdout  # control: the first one removes it
    second = cli("discard", job)
    assert second.returncode == 1 and "freed" not in second.stdout
    assert "already discarded" in second.stderr and "(DISCARDED)" in second.stderr, second.stderr


def test_gc_says_the_age_it_used_and_what_it_kept(repo, fake):
    fake("claude", Behaviour(writes={"a.txt": "1"}))
    _job(repo, "T")
    kept = cli("gc")
    assert kept.returncode == 0 and "more than 7d ago" in kept.stdout, kept.stdout
    assert "1 ended job(s) younger than 7d kept (--older-than 0" in kept.stdout, kept.stdout
    # control: with --older-than 0 it takes the job and keeps nothing
    taken = cli("gc", "--older-than", "0")
    assert "of 1 job(s)" in taken.stdout and "kept" not in taken.stdout, taken.stdout
    assert "7 days" in cli("gc", "--help").stdout


def test_gc_takes_the_tmpdirs_a_killed_host_left_and_nothing_like_them(tmp_path):
    job_id = "20250101T000000-abc123"
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    mine = [Path(tempfile.mkdtemp(prefix=f"proctor-{job_id}-", dir=tmp)),
            Path(tempfile.mkdtemp(prefix=f"proctor-host-{job_id}-", dir=tmp))]
    (mine[0] / "f").write_text("x" * 10_000)
    others = [tmp / f"proctor-{job_id}x-abcdefgh", tmp / f"proctor-{job_id}-abcdefgh-more",
              Path(tempfile.mkdtemp(prefix="proctor-20250101T000000-abc124-", dir=tmp))]
    for d in others:
        d.mkdir(exist_ok=True)
    (tmp / f"proctor-{job_id}-linklink").symlink_to(tmp_path)  # a link shaped like one: never followed
    fp = gc_mod.footprint(Job(job_id), tmp=tmp)
    assert sorted(fp.paths) == sorted(mine) and fp.bytes >= 10_000
    assert gc_mod._remove(fp) == [] and not any(d.exists() for d in mine)
    assert all(d.exists() for d in others) and tmp.is_dir()  # control: none of the others, nor /tmp itself
    assert gc_mod.footprint(Job("20250101T000000-abc999"), tmp=tmp).empty


def test_a_cancelled_validation_reads_cancelled_not_exit_minus_15():
    assert _ended_as(-15, "CANCELLED") == "cancelled (killed by SIGTERM)"
    assert _ended_as(-9, "VALIDATION_FAILED") == "killed by SIGKILL"
    # control: an ordinary exit is its number
    assert _ended_as(1, "CANCELLED") == "exit 1" and _ended_as(0, "OK") == "exit 0"


def test_help_says_where_state_is_and_what_the_patch_task_is():
    assert "~/.proctor" in cli("--help").stdout
    assert "unified diff" in cli("run-agent", "--help").stdout
    # control: the jobs table names its column for what it is
    assert "needs_human_review" in cli("jobs", "--help").stdout


def test_an_empty_repo_is_named_as_one(tmp_path, fake):
    fake("claude", Behaviour(writes={"a": "1"}))
    empty = tmp_path / "empty"
    subprocess.run(["git", "init", "-q", "-b", "master", str(empty)], check=True)
    res = run_agent(RunAgentRequest(agent="claude", task="t", repo=str(empty), ticket="T"))
    assert res.code is Code.INVALID_REQUEST and "has no commits yet" in res.known_risks[0], res.known_risks
    # Control: a repo with commits but no such branch keeps the plain words.
    (empty / "f").write_text("x")
    subprocess.run(["git", "-C", str(empty), "add", "f"], check=True)
    subprocess.run(["git", "-C", str(empty), "commit", "-qm", "c"], check=True)
    other = run_agent(RunAgentRequest(agent="claude", task="t", repo=str(empty), ticket="T", branch="nope"))
    assert other.code is Code.INVALID_REQUEST and "does not name a commit" in other.known_risks[0], other.known_risks


def test_a_step_killed_by_a_signal_says_so_not_a_negative_exit():
    from proctor.mechanisms.validation.plan import Attempt

    assert Attempt("pytest", -15, False).line(60) == "pytest => killed by signal 15"
    assert Attempt("pytest", 1, False).line(60) == "pytest => exit 1"  # control
