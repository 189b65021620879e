"""End to end: `proctor run-agent --agent codex|claude|gemini`, the built-in adapters as a user runs them,
confined (`--confine required`: bwrap+landlock here), against a scripted model API on loopback
(tests/modelserver.py) that answers one tool call and then a final message, and logs every request.

What a user configures, and nothing else: `[agents.NAME]` in config.toml overlaying the built-in with
`base_url` (the adapter keys turn it into the CLI's own flag or variable), `egress = ["127.0.0.1:PORT"]` (a
declared local gateway) and, for codex, `api_key_env`; the key itself in the host's environment. The test
machine's part: a throw-away CA the model's HTTPS is signed with, named by the CLI's CA variable (it sits
in the CLI's state dir, the one place under HOME the sandbox shows), and gemini's auth type in its own
settings under the test's HOME (README, configuration: a custom base URL needs it).

Each success test: the model's tool call — the CLI's own tool (codex: its shell, nested in code mode's
`exec`; claude: `Write`; gemini: `run_shell_command`) — writes hello.txt in the job's worktree; the job is
`completed` with exactly that file in `changed_files` and in its commit, validation `true` passes, the main
repo's status, refs and HEAD are unchanged, the model's log holds the tool call and, in a later request,
the tool's result as the CLI sent it back, and the host's egress proxy let the agent reach the model and
nothing else. Each control: the model answers 401 and the job fails with the CLI's message in its summary.

Skips with a reason when a CLI or bubblewrap is missing; under CI=true that fails (CI installs them). The
endpoint keys themselves (how base_url, api_key_env and model become each CLI's flags and variables) are
checked without any CLI at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import make_repo, sh
from modelserver import ERROR_MARK, FINAL_TEXT, ScriptedModel, WriteFile
from proctor.mechanisms.adapters.spec import Invocation, build, pool_key
from proctor.mechanisms.config.load import ConfigError, builtin_agents, load_config
from proctor.mechanisms.confine import detect

CACHE = Path(os.environ.get("PROCTOR_CLI_CACHE") or Path.home() / ".cache" / "proctor" / "agent-clis")
BIN = CACHE / "bin"
CAPS = detect()
CI = os.environ.get("CI") == "true"
ACTION = WriteFile("hello.txt", "hello from the scripted model\n")
TASK = "Create hello.txt saying hello."
KEY = "sk-scripted-model-test-key"
# The developer's own endpoint, key and state variables never reach the job under test.
FOREIGN = ("ANTHROPIC_", "CLAUDE_", "OPENAI_", "CODEX_", "GEMINI_", "GOOGLE_", "OPENCODE_", "GROK_", "NODE_EXTRA_CA_CERTS",
           "SSL_CERT_", "HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY", "NO_PROXY", "https_proxy", "http_proxy",
           "all_proxy", "no_proxy")


@dataclass(frozen=True)
class Cli:
    name: str  # the built-in adapter
    state: str  # its state dir under HOME: writable and visible in the sandbox, so the CA goes there
    ca_var: str  # the variable its TLS stack reads an extra CA from
    base_path: str  # what base_url ends in (codex's provider base_url includes /v1)
    host_env: dict[str, str]  # the key, as a user exports it
    overlay: str = ""  # more config.toml lines for [agents.NAME]
    config_env: dict[str, str] = field(default_factory=dict)
    tool: str = ""  # the CLI tool the scripted call goes through
    result_says: str = ""  # in the tool result the CLI sends back after the write
    auth_header: str = ""
    model: str | None = None  # the adapter key `model`, when the case sets it
    sent_model: str | None = None  # the model the CLI's requests name, when not `model` itself


CLIS = {
    "codex": Cli("codex", ".codex", "CODEX_CA_CERTIFICATE", "/v1", {"SCRIPTED_MODEL_KEY": KEY},
                 overlay='api_key_env = "SCRIPTED_MODEL_KEY"\n', tool="exec", result_says='"exit_code":0',
                 auth_header="authorization"),
    # A model of the user's choosing: `--model`, and with a model 0.171 has no code-mode metadata for, a plain
    # `exec_command` function tool instead of JavaScript.
    "codex-model": Cli("codex", ".codex", "CODEX_CA_CERTIFICATE", "/v1", {"SCRIPTED_MODEL_KEY": KEY},
                       overlay='api_key_env = "SCRIPTED_MODEL_KEY"\n', tool="exec_command",
                       result_says="Process exited with code 0", auth_header="authorization", model="gpt-5"),
    "claude": Cli("claude", ".claude", "NODE_EXTRA_CA_CERTS", "", {"ANTHROPIC_API_KEY": KEY},
                  config_env={"CLAUDE_CODE_MAX_RETRIES": "0"}, tool="Write", result_says="File created successfully",
                  auth_header="x-api-key", model="claude-scripted-1"),
    "gemini": Cli("gemini", ".gemini", "NODE_EXTRA_CA_CERTS", "", {"GEMINI_API_KEY": KEY},
                  tool="run_shell_command", result_says="Output:", auth_header="x-goog-api-key"),
    # `model` is opencode's "provider/model"; its anthropic provider reads ANTHROPIC_BASE_URL.
    "opencode": Cli("opencode", ".config/opencode", "NODE_EXTRA_CA_CERTS", "/v1", {"ANTHROPIC_API_KEY": KEY},
                    tool="write", result_says="Wrote file successfully", auth_header="x-api-key",
                    model="anthropic/claude-sonnet-4-5", sent_model="claude-sonnet-4-5"),
}


def need(cli: Cli) -> None:
    missing = []
    exe = BIN / cli.name
    if not (exe.exists() and os.access(exe, os.X_OK)):
        missing.append(f"{cli.name} is not installed in {BIN} (scripts/install-agent-clis.sh; PROCTOR_CLI_CACHE "
                       "selects the cache)")
    if CAPS.bwrap is None:
        missing.append(f"no bubblewrap here: {CAPS.bwrap_reason}")
    if CI and not CAPS.landlock:
        missing.append(f"no Landlock here: {CAPS.landlock_reason}; helper: {CAPS.helper_reason}")
    if missing:
        if CI:
            pytest.fail("; ".join(missing))  # CI must run the real thing
        pytest.skip("; ".join(missing))


def proctor_cmd() -> list[str]:
    script = Path(sys.executable).parent / "proctor"
    return [str(script)] if script.exists() else [sys.executable, "-c", "from proctor.surfaces.cli import main; main()"]


def repo_state(repo: Path) -> tuple[str, str, str]:
    """What a person sees of the main repo: status (untracked and ignored too), every ref, HEAD."""
    return (sh("git", "status", "--porcelain=v1", "--ignored", "--untracked-files=all", cwd=repo),
            sh("git", "for-each-ref", "--format=%(refname) %(objectname)", cwd=repo),
            sh("git", "rev-parse", "HEAD", cwd=repo))


@dataclass
class Job:
    result: dict
    exit_code: int
    stderr: str
    seconds: float
    model: ScriptedModel
    repo: Path
    before: tuple[str, str, str]
    proctor_home: Path

    def egress(self) -> list[dict]:
        with sqlite3.connect(self.proctor_home / "ledger.sqlite3") as db:
            rows = db.execute("SELECT payload FROM rows WHERE kind = 'egress.decision' AND job_id = ?",
                              (self.result["jobId"],)).fetchall()
        return [json.loads(r[0]) for r in rows]

    def explain(self) -> str:
        keep = ("status", "code", "summary", "changed_files", "known_risks", "tests_attempted", "exit_codes",
                "confinement")
        return (f"{json.dumps({k: self.result.get(k) for k in keep}, indent=1)}\nmodel: {self.model.summary()}"
                f"\nstderr: {self.stderr[-1500:]}")



def launch(cli, repo: Path, config: Path, model, proctor_home: Path, extra: tuple[str, ...] = ()) -> Job:
    """`proctor run-agent` with the real CLI, as a user runs it (the CLI's own dir and node on PATH, no
    foreign credentials), confined, against `model`; its result and what it took."""
    node = shutil.which("node")
    path = [str(BIN), str(Path(sys.executable).parent), *([str(Path(node).parent)] if node else []),
            "/usr/local/bin", "/usr/bin", "/bin"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(FOREIGN)}
    env.update(cli.host_env, PATH=os.pathsep.join(dict.fromkeys(path)))
    before = repo_state(repo)
    argv = [*proctor_cmd(), "run-agent", "--agent", cli.name, "--task", TASK, "--repo", str(repo), "--ticket",
            "T-1", "--confine", "required", "--timeout", "60", "--config", str(config), *extra]
    with model:
        start = time.monotonic()
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=150)
        seconds = time.monotonic() - start
    try:
        result = json.loads(done.stdout)
    except ValueError:
        pytest.fail(f"proctor printed no result (exit {done.returncode}): {done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return Job(result, done.returncode, done.stderr, seconds, model, repo, before, proctor_home)

def run_job(case: str, tmp_path: Path, fail: int | None = None, extra: tuple[str, ...] = (),
            files: dict[str, str] | None = None, model_type: type[ScriptedModel] = ScriptedModel,
            overlay: str = "", action: WriteFile = ACTION) -> Job:
    """One `proctor run-agent` of the real CLI against a `model_type` model; `overlay`, more lines for the
    agent's table in the user's config.toml."""
    cli = CLIS[case]
    name = cli.name
    need(cli)
    # A test of its own, run by the autodetected `python -m pytest`: a verdict on per-test evidence, not on
    # the exit code of `true` (which alone keeps a person in the loop: README "What the verdict rests on").
    repo = make_repo(tmp_path, {"README.md": "hello\n", "main.py": "print('hi')\n", "pytest.ini": "[pytest]\n",
                                "test_main.py": "def test_main():\n    assert True\n", **(files or {})})
    home = Path(os.environ["HOME"])  # the test's own (conftest): the agent's HOME and its state dirs
    proctor_home = Path(os.environ["PROCTOR_HOME"])
    model = model_type(tmp_path / "model", action, fail=fail, log_file=tmp_path / "model.jsonl")
    state = home / cli.state
    state.mkdir(parents=True, exist_ok=True)
    shutil.copy(model.ca_file, state / "scripted-model-ca.pem")
    if name == "gemini":
        # gemini's own settings, as a gateway user has them: with GOOGLE_GEMINI_BASE_URL and no auth type
        # 0.61 exits 41 "Invalid auth method selected." This HOME is the test's, never the user's.
        (state / "settings.json").write_text(json.dumps({"security": {"auth": {"selectedType": "gemini-api-key"}}}))
    env_toml = ", ".join(f"{k} = {json.dumps(v)}" for k, v in
                         {cli.ca_var: f"~/{cli.state}/scripted-model-ca.pem", **cli.config_env}.items())
    config = tmp_path / "config.toml"
    config.write_text(f'confine = "required"\n\n[agents.{name}]\nbase_url = "{model.url}{cli.base_path}"\n'
                      f'egress = ["{model.endpoint}"]\n{cli.overlay}{overlay}env = {{ {env_toml} }}\n'
                      + (f'model = "{cli.model}"\n' if cli.model else ""))
    job = launch(cli, repo, config, model, proctor_home, extra)
    result, seconds = job.result, job.seconds
    print(f"{case}{' fail=' + str(fail) if fail else ''}: {seconds:.1f} s (job {result.get('durationSeconds')} s)")
    return job


def expected_confinement() -> str:
    return "bwrap+landlock" if CAPS.landlock else "bwrap"


@pytest.mark.realcli
@pytest.mark.parametrize("case", sorted(CLIS))
def test_the_models_tool_call_lands_in_the_worktree(case, tmp_path):
    job = run_job(case, tmp_path)
    cli = CLIS[case]
    r, why = job.result, job.explain()
    assert job.exit_code == 0 and r["status"] == "completed" and r["code"] == "OK", why
    assert r["summary"] == FINAL_TEXT, why
    assert r["changed_files"] == [ACTION.name] and r["agent_changed_files"] == [ACTION.name], why
    assert len(r["tests_attempted"]) == 1 and r["tests_attempted"][0].endswith("-m pytest => exit 0"), why
    assert r["validation"][-1]["tests"]["passed"] == 1, why
    assert r["confinement"] == expected_confinement(), why
    assert r["needs_human_review"] is False and r["known_risks"] == [], why
    # The edit is in the job's commit, on its branch, in its own repo: the review checkout shows it.
    wt = Path(r["worktreePath"])
    assert (wt / ACTION.name).read_text() == ACTION.content, why
    assert sh("git", "show", f"{r['commit']}:{ACTION.name}", cwd=wt) == ACTION.content
    assert sh("git", "rev-parse", r["branch"], cwd=wt).strip() == r["commit"]
    # ... and nowhere in the main repo: not its checkout, not a ref, not HEAD.
    assert repo_state(job.repo) == job.before
    assert not (job.repo / ACTION.name).exists()

    # The model saw the CLI's request (with our key), answered the tool call, and got the tool's result back.
    log = job.model.requests
    calls = [q for q in log if q.reply == "tool_call"]
    finals = [q for q in log if q.reply == "final"]
    assert len(calls) == 1 and len(finals) == 1, job.model.summary()
    assert calls[0].seq < finals[0].seq
    assert calls[0].tool_call and calls[0].tool_call["name"] == cli.tool, calls[0].tool_call
    assert cli.result_says in (finals[0].tool_result or ""), finals[0].tool_result
    assert all(q.headers.get(cli.auth_header) == "<redacted>" for q in (calls[0], finals[0])), \
        (calls[0].headers, finals[0].headers)
    if cli.model:
        sent = cli.sent_model or cli.model
        assert [q.body["model"] for q in (calls[0], finals[0])] == [sent, sent]
    assert not [q for q in log if q.reply.startswith("server_error")], job.model.summary()
    # The file log holds the same exchange, one JSON line a request.
    lines = [json.loads(ln) for ln in (tmp_path / "model.jsonl").read_text().splitlines()]
    assert [q["reply"] for q in lines] == [q.reply for q in log]

    # The agent's network was the host's proxy: the model endpoint allowed, nothing else.
    decisions = job.egress()
    allowed = {(d["host"], d["port"]) for d in decisions if d["allowed"]}
    assert allowed == {("127.0.0.1", job.model.port)}, decisions
    # ... and the CLI tried nothing else, not even to be refused: its telemetry, analytics and update checks
    # are off (builtin.toml; before, codex tried ab.chatgpt.com and gemini play.googleapis.com every job).
    assert [d for d in decisions if not d["allowed"]] == [], decisions


# One test fails on the base (no hello.txt yet), one passes there and checks any hello.txt is right: the
# model's write is the fix, or, with other content, a wrong edit that breaks the second. Judged on each test's
# outcome against the base's run, never on the agent's word.
FAILING_TEST = {"test_main.py": "import os\n\ndef test_hello():\n    with open('hello.txt') as f:\n"
                                f"        assert f.read() == {ACTION.content!r}\n\n"
                                "def test_any_hello_is_right():\n    if os.path.exists('hello.txt'):\n"
                                "        with open('hello.txt') as f:\n"
                                f"            assert f.read() == {ACTION.content!r}\n"}


@pytest.mark.realcli
@pytest.mark.parametrize("case", ["claude", "codex", "gemini", "opencode"])
@pytest.mark.parametrize("right", [True, False], ids=["fix", "wrong-edit"])
def test_the_clis_fix_of_a_failing_test_passes_and_a_wrong_edit_fails_validation(case, tmp_path, right):
    action = ACTION if right else WriteFile(ACTION.name, "not what the test wants\n")
    job = run_job(case, tmp_path, files=FAILING_TEST, action=action)
    r, why = job.result, job.explain()
    assert r["changed_files"] == [ACTION.name], why
    assert r["baseline"] and r["baseline"]["steps"][0]["failing"] == 1, r["baseline"]
    compared = r["validation"][-1]["compared"]
    if right:
        assert (r["status"], r["code"], r["needs_human_review"]) == ("completed", "OK", False), why
        assert compared["fixed"] == ["test_main.py::test_hello"] and compared["broken"] == [], compared
    else:
        assert (r["status"], r["code"], r["needs_human_review"]) == ("failed", "VALIDATION_FAILED", True), why
        assert compared["broken"] == ["test_main.py::test_any_hello_is_right"], compared
        assert compared["fixed"] == [] and r["summary"] == FINAL_TEXT, (compared, why)  # its word, not the verdict


@pytest.mark.realcli
@pytest.mark.parametrize("case", ["claude", "codex", "gemini", "opencode"])
def test_a_model_error_fails_the_job_with_the_clis_message(case, tmp_path):
    job = run_job(case, tmp_path, fail=401)
    r, why = job.result, job.explain()
    assert job.exit_code != 0 and r["status"] == "failed" and r["code"] != "OK", why
    assert ERROR_MARK in r["summary"], why
    assert r["changed_files"] == [] and r["needs_human_review"] is True, why
    assert repo_state(job.repo) == job.before
    errors = [q for q in job.model.requests if q.reply == "error"]
    assert errors and not [q for q in job.model.requests if q.reply in ("tool_call", "final")], \
        job.model.summary()
    assert all(q.status == 401 for q in errors)


# -- the endpoint keys, without a CLI --------------------------------------------------------------------

def _overlaid(tmp_path: Path, name: str, keys: str):
    cfg = tmp_path / f"{name}.toml"
    cfg.write_text(f"[agents.{name}]\n{keys}")
    return load_config(cfg).adapter(name)


def _argv(spec) -> list[str]:
    inv = build(spec, "the task", Path("/wt"), None, {})
    assert isinstance(inv, Invocation), inv
    return list(inv.argv)


def test_endpoint_keys_become_each_clis_own_flags_and_variables(tmp_path):
    url = "https://gw.example.test/v1"
    codex = _overlaid(tmp_path, "codex", f'base_url = "{url}"\napi_key_env = "GW_KEY"\nmodel = "m-1"\n')
    argv = _argv(codex)
    # After the subcommand, before the first option: `-c` overrides of a provider of its own, and --model.
    assert argv[:2] == ["codex", "exec"] and argv[-1] == "-"
    assert argv[2:21] == ["-c", 'model_provider="proctor"', "-c", 'model_providers.proctor.name="proctor"',
                          "-c", f'model_providers.proctor.base_url="{url}"',
                          "-c", 'model_providers.proctor.wire_api="responses"',
                          "-c", 'model_providers.proctor.env_key="GW_KEY"',
                          "-c", f'model_providers.proctor.base_url="{url}"', "--model", "m-1", "--json",
                          "--skip-git-repo-check", "--disable", "plugins", "-C"]
    claude = _overlaid(tmp_path, "claude", f'base_url = "{url}"\nmodel = "m-2"\n')
    assert claude.env["ANTHROPIC_BASE_URL"] == url and claude.env["CLAUDE_CONFIG_DIR"] == "~/.claude"
    assert _argv(claude)[:4] == ["claude", "--model", "m-2", "-p"]
    gemini = _overlaid(tmp_path, "gemini", f'base_url = "{url}"\n')
    assert gemini.env["GOOGLE_GEMINI_BASE_URL"] == url
    assert _overlaid(tmp_path, "grok", f'base_url = "{url}"\n').env["GROK_BASE_URL"] == url
    assert _argv(gemini)[:2] == ["gemini", "--prompt=the task"]
    # Without the keys, every built-in's argv and env are exactly as declared.
    for name, spec in builtin_agents().items():
        assert _argv(spec) == [t.replace("{prompt}", "the task").replace("{worktree}", "/wt")
                               for t in spec.command], name
        assert not any(k.endswith("BASE_URL") for k in spec.env), name


@pytest.mark.parametrize("name, keys, says", [
    ("claude", 'api_key_env = "GW_KEY"\n', "api_key_env takes no effect"),  # ANTHROPIC_API_KEY only
    ("gemini", 'api_key_env = "GW_KEY"\n', "api_key_env takes no effect"),  # GEMINI_API_KEY only
    ("codex", 'api_key_env = "GW_KEY"\n', "api_key_env takes no effect"),  # without base_url: nothing to key
    ("patch", 'base_url = "https://gw.example.test"\n', "base_url takes no effect"),
    ("codex", 'base_url = "https://gw.example.test/v1\\" x"\n', "base_url"),  # no TOML breaks out of -c
    ("codex", 'base_url = "gw.example.test"\n', "base_url"),  # a URL, with its scheme
    ("claude", 'api_key_env = "GW-KEY"\n', "api_key_env"),
])
def test_an_endpoint_key_the_cli_cannot_take_is_refused(tmp_path, name, keys, says):
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"[agents.{name}]\n{keys}")
    with pytest.raises(ConfigError, match=f"agents.{name}.*{says}"):
        load_config(cfg)


def test_a_gateway_given_as_keys_is_a_credential_pool_of_its_own(tmp_path):
    a = _overlaid(tmp_path, "codex", 'base_url = "https://a.example.test/v1"\napi_key_env = "GW_KEY"\n')
    b = _overlaid(tmp_path, "codex", 'base_url = "https://b.example.test/v1"\napi_key_env = "GW_KEY"\n')
    env = {"GW_KEY": "k1"}
    assert len({pool_key(a, env), pool_key(b, env), pool_key(a, {"GW_KEY": "k2"})}) == 3
    assert pool_key(builtin_agents()["codex"], {}) == "codex"  # unchanged without the keys
