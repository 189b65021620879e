"""Our adapters against the REAL agent CLIs from npm (scripts/install-agent-clis.sh), offline.

Each CLI is run with the exact argv `builtin.toml` + `adapters.spec.build()` produce, in a real linked git
worktree, with an empty HOME, no API keys, and every proxy variable pointing at a closed loopback port (so
the runs are offline and identical on a machine that does have network). What this proves, per CLI:

(a) its own parser ACCEPTS our argv: no "unknown option"-style rejection, and the run reaches the auth or
    network failure shared/agent-clis/README.md measured. Where the CLI leaves a trace of what it parsed
    (claude's and codex's session transcripts, gemini's yolo banner) the prompt, workspace and mode are
    checked too; gemini and grok, which leave no such trace, get a stand-in model API on loopback and the
    request must carry our prompt verbatim. CONTROLS make "accepted" evidence: the same argv plus a bogus
    flag IS rejected, with the very texts the acceptance check looks for, before any auth check; and the
    argv claude and gemini had before 2026-12-02 is rejected for a prompt that starts with "-".
(b) that real offline failure, read by our reader and classifier, is neither `completed` nor
    `rate_limited`; and through `proctor.services.job.run_agent.run_agent` (built-in agent table, PATH = the cache bin dir,
    HOME empty) claude, gemini and grok end `failed` / AGENT_FAILED after the one retry, codex `timed_out`
    at the host's 60 s floor.

Skips, one reason per CLI, only when that CLI is not installed in the cache; CI installs them first.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psutil
import pytest

from conftest import make_repo, sh
from proctor.mechanisms.adapters import versions
from proctor.mechanisms.confine import detect
from proctor.mechanisms.adapters.output import READERS
from proctor.mechanisms.adapters.spec import AdapterSpec, Invocation, build
from proctor.services.job.classify import Patterns, classify
from proctor.mechanisms.config.load import builtin_agents, load_config
from proctor.mechanisms.config.model import Config
from proctor.contract import Code, RunAgentRequest, Status
from proctor.services.job.run_agent import run_agent
from proctor.mechanisms.process.local import LocalRunner
from proctor.mechanisms.process.spawn import Exit, Spawn

pytestmark = pytest.mark.realcli
# The tests that read `runs` (one direct run per CLI and prompt, kept for the session) share one worker: spread
# over two, each worker made every run itself (codex's alone take ~10 s each).
SHARES_RUNS = pytest.mark.xdist_group("realcli-runs")

CACHE = Path(os.environ.get("PROCTOR_CLI_CACHE") or Path.home() / ".cache" / "proctor" / "agent-clis")
BIN = CACHE / "bin"

# name -> (npm package, version): scripts/install-agent-clis.sh's pins, read from it. A cache of the
# registry's newest (`make test-latest-clis`, PROCTOR_CLI_LATEST=1) holds other versions on purpose: there
# test_the_installed_cli_is_a_tested_version is the check that matters.
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "install-agent-clis.sh"
PINS = {m[1]: (m[2], m[3]) for m in re.finditer(r'^\s*"(\w+)\|([^|"]+)\|([^|"]+)"$', SCRIPT.read_text(), re.M)}
LATEST = os.environ.get("PROCTOR_CLI_LATEST") == "1"
CLIS = sorted(n for n in PINS if n != "opencode")  # opencode, driven with its gate: test_gate_opencode.py

DEADLINE_S = 20.0  # kill deadline for one direct run; codex never exits offline, the others take < 6 s
DEAD_PROXY = "http://127.0.0.1:9"  # discard port: nothing listens, every request is refused at once
LOOPBACK = "127.0.0.1,localhost"
PROXY_VARS = ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY", "https_proxy", "http_proxy", "all_proxy")

PLAIN = "Add a line saying hello to README.md."
# Every parser trap at once: a leading "-", a known flag, a flag-like line. A task written as a markdown
# list starts exactly like this.
DASHED = "--help\n- fix the bug in main.py\n-p"
PROMPTS = {"plain": PLAIN, "dashed": DASHED}

# What a CLI's argument parser prints when it refuses an argv (commander, clap, yargs).
REJECTED = re.compile(
    r"unknown option|unexpected argument|Unknown arguments?:|error: unrecognized|unrecognized option"
    r"|Not enough arguments following|error: too many arguments|Invalid values?:|^Usage: ",
    re.I | re.M,
)
BOGUS_FLAG = "--proctor-no-such-flag"


@dataclass(frozen=True)
class Expect:
    failure: re.Pattern[str]  # the auth/network failure the README measured, in stdout+stderr
    exit_codes: tuple[int, ...] | None  # None: never exits by itself, only our kill ends it
    bogus_at: int = 1  # where the control's bogus flag goes (after the subcommand for codex)


EXPECT = {
    "claude": Expect(re.compile(r"Not logged in"), (1,)),
    "gemini": Expect(re.compile(r"Please set an Auth method|GEMINI_API_KEY"), (41,)),
    "grok": Expect(re.compile(r"API key required"), (1,)),
    "codex": Expect(re.compile(r'"type":"error","message":"Reconnecting\.\.\.'), None, bogus_at=2),
}


def need_bwrap() -> None:
    caps = detect()
    if caps.bwrap is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"no bubblewrap here: {caps.bwrap_reason}")
        pytest.skip(f"no bubblewrap here: {caps.bwrap_reason}")


def installed(name: str) -> Path:
    exe = BIN / name
    if not (exe.exists() and os.access(exe, os.X_OK)):
        pytest.skip(f"{name} is not installed in {BIN} (run scripts/install-agent-clis.sh; "
                    f"PROCTOR_CLI_CACHE selects the cache)")
    return exe


def node_path() -> str:
    dirs = [str(BIN)]
    node = shutil.which("node")
    if node:
        dirs.append(str(Path(node).parent))
    dirs += ["/usr/local/bin", "/usr/bin", "/bin"]
    return os.pathsep.join(dict.fromkeys(dirs))


def offline_env(home: Path) -> dict[str, str]:
    """The agent's whole environment in a direct run: nothing of ours leaks in (keys, XDG dirs, HOME)."""
    env = {"PATH": node_path(), "HOME": str(home), "LANG": "C.UTF-8", "TERM": "dumb"}
    env.update({k: DEAD_PROXY for k in PROXY_VARS})
    return env


def linked_worktree(root: Path) -> Path:
    """A real repo and a linked worktree of it, laid out the way the host cuts one."""
    repo = make_repo(root, {"README.md": "hello\n", "main.py": "print('hi')\n"})
    wt = root / "repo-agents" / "job-1"
    sh("git", "worktree", "add", "--quiet", "-b", "wt/job-1/T", "--", str(wt), "HEAD", cwd=repo)
    assert (wt / ".git").is_file(), "expected a linked worktree (.git is a file)"
    return wt


class UntilText:
    """A Spawn watch that ends the run once `needle` has appeared on stdout (codex: it retries forever)."""

    def __init__(self, needle: bytes) -> None:
        self.needle, self.seen = needle, b""

    def __call__(self, stream: str, chunk: bytes) -> str | None:
        if stream != "stdout":
            return None
        self.seen = (self.seen + chunk)[-100_000:]
        return f"saw {self.needle.decode()!r}" if self.needle in self.seen else None


@dataclass(frozen=True)
class Run:
    name: str
    spec: AdapterSpec
    prompt: str
    argv: tuple[str, ...]
    worktree: Path
    home: Path
    exit: Exit

    @property
    def text(self) -> str:
        return (self.exit.stdout + b"\n" + self.exit.stderr).decode("utf-8", "replace")


def drive(name: str, prompt: str, root: Path, mutate: Callable[[list[str]], list[str]] | None = None) -> Run:
    installed(name)
    spec = builtin_agents()[name]
    wt = linked_worktree(root)
    home = root / "home"
    home.mkdir()
    env = {**offline_env(home), **spec.env_under(str(home))}
    gate_dir = None
    if spec.gate:  # the gate's install args as a job has them (an empty settings file: no hook needed offline)
        gate_dir = root / "gate"
        gate_dir.mkdir()
        (gate_dir / f"{spec.gate}-settings.json").write_text("{}")
    inv = build(spec, prompt, wt, None, env, gate_dir=gate_dir)
    assert isinstance(inv, Invocation), inv
    argv = list(inv.argv)
    argv[0] = str(BIN / argv[0])  # exactly our argv, with the executable pinned to the cache
    if mutate is not None:
        argv = mutate(argv)
    # codex never exits offline: end it once it says it is waiting for the network (the deadline backs this).
    watch = UntilText(b"waiting for network") if name == "codex" else None
    ex = LocalRunner().run(Spawn(argv=argv, cwd=wt, env=env, deadline_s=DEADLINE_S, stdin=inv.stdin,
                                 watch=watch, name=f"realcli-{name}", term_grace_s=1.0))
    assert ex.spawn_error is None, ex.spawn_error
    return Run(name, spec, prompt, tuple(argv), wt, home, ex)


@pytest.fixture(scope="session")
def runs(tmp_path_factory) -> Callable[[str, str], Run]:
    """One direct run per (CLI, prompt), shared by the tests that read it. Session-wide, with those tests
    in one xdist group: a module's fixture was made again whenever the worker ran another module's test
    between two of them."""
    done: dict[tuple[str, str], Run] = {}

    def get(name: str, prompt_key: str) -> Run:
        if (name, prompt_key) not in done:
            done[name, prompt_key] = drive(name, PROMPTS[prompt_key], tmp_path_factory.mktemp(f"{name}-{prompt_key}"))
        return done[name, prompt_key]

    return get


def transcript_events(home: Path, pattern: str) -> list[dict]:
    out = []
    for f in sorted(home.glob(pattern)):
        for line in f.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if isinstance(ev, dict):
                out.append(ev)
    return out


# -- the cache holds what was measured -------------------------------------------------------------------

def test_the_script_pins_every_built_in_cli():
    assert set(PINS) == {"codex", "claude", "gemini", "grok", "opencode"}, PINS


@pytest.mark.parametrize("name", sorted(PINS))
def test_cached_cli_is_the_pinned_version(name):
    installed(name)
    pkg, version = PINS[name]
    pj = CACHE / "pkgs" / name / "node_modules" / pkg / "package.json"
    if not pj.is_file():
        pytest.skip(f"{name} in {BIN} was not installed by scripts/install-agent-clis.sh ({pj} missing)")
    got = json.loads(pj.read_text())["version"]
    assert got == version or LATEST, (f"{pkg} {got} is cached but {version} is pinned: run "
                                      "scripts/install-agent-clis.sh")


@functools.cache
def cli_version(name: str) -> str:
    """What the cached CLI says it is, as the job's probe reads it (its first line)."""
    out = subprocess.run([str(installed(name)), "--version"], capture_output=True, text=True, timeout=60,
                         env={"PATH": node_path(), "HOME": "/nonexistent"})
    return (out.stdout or out.stderr).strip().splitlines()[0]


@pytest.mark.parametrize("name", sorted(PINS))
def test_the_installed_cli_is_a_tested_version(name):
    """The compatibility matrix kept true: the CLI this suite ran is one its adapter lists as tested. After
    `make test-latest-clis` passes with a newer release, this names the version to add to `tested`."""
    said = cli_version(name)
    tested = builtin_agents()[name].tested
    assert versions.version_of(said) in tested, (f"{name} says {said!r}: add its version to `tested` in "
                                                  f"builtin.toml once the real-CLI tests pass with it ({tested})")


# -- (a) the real parser accepts our argv ----------------------------------------------------------------

@SHARES_RUNS
@pytest.mark.parametrize("prompt_key", sorted(PROMPTS))
@pytest.mark.parametrize("name", CLIS)
def test_real_cli_accepts_our_argv_and_fails_only_on_auth_or_network(runs, name, prompt_key):
    run = runs(name, prompt_key)
    ex, want = run.exit, EXPECT[name]
    rejected = REJECTED.search(run.text)
    assert rejected is None, f"{name} rejected our argv {run.argv!r}: {rejected.group(0)!r}\n{run.text[-3000:]}"
    assert want.failure.search(run.text), f"{name}: not the measured offline failure\n{run.text[-3000:]}"
    if want.exit_codes is None:
        # Never exits by itself: only our watch or deadline ended it (README: "never exits ... within 200 s").
        assert ex.timed_out or ex.killed_reason, (ex.exit_code, run.text[-2000:])
    else:
        assert not ex.timed_out and ex.exit_code in want.exit_codes, (ex.exit_code, run.text[-2000:])


@SHARES_RUNS
def test_claude_got_our_prompt_workspace_and_permission_mode(runs):
    """claude's session transcript records what it parsed: the prompt verbatim, the cwd, the mode."""
    for key, prompt in PROMPTS.items():
        run = runs("claude", key)
        events = [json.loads(ln) for ln in run.exit.stdout.decode().splitlines() if ln.startswith("{")]
        init = next(e for e in events if e.get("type") == "system" and e.get("subtype") == "init")
        assert init["permissionMode"] == "dontAsk" and init["cwd"] == str(run.worktree), init
        result = next(e for e in events if e.get("type") == "result")
        assert result["is_error"] is True and "Not logged in" in result["result"], result
        users = [e for e in transcript_events(run.home, ".claude/projects/*/*.jsonl") if e.get("type") == "user"]
        texts = []
        for e in users:
            content = e["message"]["content"]
            texts.append(content if isinstance(content, str) else "".join(p.get("text", "") for p in content))
        assert texts == [prompt], (key, texts)


@SHARES_RUNS
def test_codex_got_our_prompt_workspace_and_approval_policy(runs):
    """codex's rollout file records the user message from stdin, the -C workspace and approval `never`."""
    for key, prompt in PROMPTS.items():
        run = runs("codex", key)
        events = transcript_events(run.home, ".codex/sessions/*/*/*/rollout-*.jsonl")
        assert events, f"no codex rollout under {run.home}"
        meta = next(e["payload"] for e in events if e.get("type") == "session_meta")
        assert meta["cwd"] == str(run.worktree), meta.get("cwd")
        ctx = next(e["payload"] for e in events if e.get("type") == "turn_context")
        assert ctx["cwd"] == str(run.worktree) and ctx["approval_policy"] == "never", ctx
        users = [p for e in events if e.get("type") == "response_item"
                 for p in [e["payload"]] if p.get("type") == "message" and p.get("role") == "user"]
        texts = ["".join(c.get("text", "") for c in p["content"]) for p in users]
        assert prompt in texts, (key, texts)
        # JSONL on stdout (--json) with a started turn: exec parsed everything and began work.
        events = [json.loads(ln) for ln in run.exit.stdout.decode().splitlines() if ln.startswith("{")]
        # The gate's --dangerously-bypass-hook-trust makes codex print warning items first: not our argv's fault.
        types = [e.get("type") for e in events
                 if not (e.get("type") == "item.completed" and (e.get("item") or {}).get("type") == "error")]
        assert types[:2] == ["thread.started", "turn.started"], types


@SHARES_RUNS
def test_gemini_yolo_survives_the_fresh_worktree(runs):
    """--skip-trust parsed: yolo is announced, never downgraded to default in the untrusted worktree."""
    for key in PROMPTS:
        err = runs("gemini", key).exit.stderr.decode("utf-8", "replace")
        assert "YOLO mode is enabled" in err, err[-2000:]
        assert "overridden" not in err, err[-2000:]
        # With --output-format stream-json (the gate reads its tool events) the auth failure is prose.
        run = runs("gemini", key)
        assert run.exit.exit_code == 41 and "Please set an Auth method" in err, (run.exit.exit_code, err[-2000:])


class LoopbackModel:
    """A stand-in model API on 127.0.0.1 that records every request; `reply(path, body)` -> (type, bytes)."""

    def __init__(self, reply: Callable[[str, dict], tuple[str, bytes]]) -> None:
        self.requests: list[tuple[str, dict]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                try:
                    parsed = json.loads(body or b"{}")
                except ValueError:
                    parsed = {}
                outer.requests.append((self.path, parsed))
                ctype, data = reply(self.path, parsed)
                self.send_response(200)
                self.send_header("content-type", ctype)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        # Handler threads not joined on close, each read bounded: server_close() joined every handler, and one
        # blocked on a keep-alive connection that a killed CLI's leftover child still held made the test
        # wait for pytest-timeout's 300 s (issue 24).
        Handler.timeout = 30
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.block_on_close = False
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self._thread.join(10)
        self.server.server_close()


def _gemini_reply(path: str, body: dict) -> tuple[str, bytes]:
    def candidate(text: str) -> dict:
        return {"candidates": [{"content": {"parts": [{"text": text}], "role": "model"}, "finishReason": "STOP",
                                "index": 0}],
                "usageMetadata": {"promptTokenCount": 5, "candidatesTokenCount": 3, "totalTokenCount": 8}}

    if "streamGenerateContent" in path:
        return "text/event-stream", f"data: {json.dumps(candidate('ok from the loopback model'))}\r\n\r\n".encode()
    # its model router's classifier call (generateContent): any well-formed choice
    return "application/json", json.dumps(candidate(json.dumps({"reasoning": "x", "model_choice": "flash"}))).encode()


def test_gemini_sends_our_dashed_prompt_verbatim_to_its_model_api(tmp_path):
    """gemini leaves no offline trace of the prompt it parsed, so give it a loopback model API (README:
    GOOGLE_GEMINI_BASE_URL + settings selectedType) and read the request: the `--prompt=VALUE` token must
    arrive whole, leading dashes and all. Everything but loopback still goes to the dead proxy."""
    installed("gemini")
    model = LoopbackModel(_gemini_reply)
    try:
        home = tmp_path / "home"
        (home / ".gemini").mkdir(parents=True)
        (home / ".gemini" / "settings.json").write_text(
            json.dumps({"security": {"auth": {"selectedType": "gemini-api-key"}}}))
        spec = builtin_agents()["gemini"]
        wt = linked_worktree(tmp_path)
        env = {**offline_env(home), **spec.env_under(str(home)), "GEMINI_API_KEY": "not-a-real-key",
               "GOOGLE_GEMINI_BASE_URL": model.url, "NO_PROXY": LOOPBACK, "no_proxy": LOOPBACK}
        inv = build(spec, DASHED, wt, None, env)
        assert isinstance(inv, Invocation)
        ex = LocalRunner().run(Spawn(argv=[str(BIN / "gemini"), *inv.argv[1:]], cwd=wt, env=env, deadline_s=40,
                                     stdin=inv.stdin, name="realcli-gemini-loopback", term_grace_s=1.0))
    finally:
        model.close()
    out = ex.stdout.decode("utf-8", "replace")
    assert ex.exit_code == 0 and not ex.timed_out, (ex.exit_code, out[-1500:], ex.stderr.decode()[-1500:])
    main = [body for path, body in model.requests if "streamGenerateContent" in path]
    assert main, [p for p, _ in model.requests]
    parts = [p.get("text") for c in main[0].get("contents", []) for p in c.get("parts", [])]
    assert parts and parts[-1] == DASHED, parts[-3:]
    # ... and its real success output reads as the reply, with a `completed` claim.
    reading = READERS[spec.output](out, ex.stderr.decode("utf-8", "replace"))
    assert reading.summary == "ok from the loopback model" and reading.claimed_status == "completed", reading


def _grok_reply(path: str, body: dict) -> tuple[str, bytes]:
    message = {"role": "assistant", "content": "ok from the loopback model"}
    if body.get("stream"):
        chunks = [{"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
                   "choices": [{"index": 0, "delta": message, "finish_reason": None}]},
                  {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
                   "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}]
        sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return "text/event-stream", sse.encode()
    return "application/json", json.dumps({
        "id": "c", "object": "chat.completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}).encode()


def test_grok_sends_our_dashed_prompt_verbatim_to_its_model_api(tmp_path):
    """grok's `-p VALUE` is commander's required option value: the dashed prompt must reach the model whole
    (GROK_BASE_URL, README), not be read as --help or -p."""
    installed("grok")
    model = LoopbackModel(_grok_reply)
    try:
        home = tmp_path / "home"
        home.mkdir()
        spec = builtin_agents()["grok"]
        wt = linked_worktree(tmp_path)
        env = {**offline_env(home), **spec.env_under(str(home)), "GROK_API_KEY": "not-a-real-key", "GROK_BASE_URL": f"{model.url}/v1",
               "NO_PROXY": LOOPBACK, "no_proxy": LOOPBACK}
        inv = build(spec, DASHED, wt, None, env)
        assert isinstance(inv, Invocation)
        ex = LocalRunner().run(Spawn(argv=[str(BIN / "grok"), *inv.argv[1:]], cwd=wt, env=env, deadline_s=30,
                                     stdin=inv.stdin, name="realcli-grok-loopback", term_grace_s=1.0))
    finally:
        model.close()
    out = ex.stdout.decode("utf-8", "replace")
    assert ex.exit_code == 0 and not ex.timed_out, (ex.exit_code, out[-1500:], ex.stderr.decode()[-1500:])
    chats = [body for path, body in model.requests if path.endswith("/chat/completions")]
    assert chats, [p for p, _ in model.requests]
    users = [m.get("content") for m in chats[0].get("messages", []) if m.get("role") == "user"]
    assert users == [DASHED], users
    assert "ok from the loopback model" in out


# -- controls: the acceptance check can fail -------------------------------------------------------------

@pytest.mark.parametrize("name", CLIS)
def test_control_a_bogus_flag_is_rejected_by_the_same_parser(tmp_path, name):
    at = EXPECT[name].bogus_at
    run = drive(name, PLAIN, tmp_path, mutate=lambda a: [*a[:at], BOGUS_FLAG, *a[at:]])
    ex = run.exit
    assert not ex.timed_out and ex.killed_reason is None and ex.exit_code not in (0, None), (ex, run.text[-2000:])
    assert REJECTED.search(run.text), f"{name} did not reject {BOGUS_FLAG}: {run.text[-3000:]}"
    assert "proctor-no-such-flag" in run.text.replace("proctorNoSuchFlag", "proctor-no-such-flag")
    # Refused by the parser, before the auth/network step the accepted run reaches.
    assert not EXPECT[name].failure.search(run.text), run.text[-2000:]


@pytest.mark.parametrize("name,old", [
    # The argv these two had before 2026-12-02: a separate value after -p. Kept as a control so that the
    # DASHED prompt demonstrably trips the parser when the argv is wrong.
    ("claude", ["claude", "-p", "{prompt}", "--permission-mode", "acceptEdits", "--output-format",
                "stream-json", "--verbose"]),
    ("gemini", ["gemini", "-p", "{prompt}", "--approval-mode", "yolo", "--skip-trust", "--output-format", "json"]),
])
def test_control_the_old_argv_rejects_a_dashed_prompt(tmp_path, name, old):
    def old_form(argv: list[str]) -> list[str]:
        return [argv[0], *(DASHED if t == "{prompt}" else t for t in old[1:])]

    run = drive(name, DASHED, tmp_path, mutate=old_form)
    # Refused by the parser, never reaching auth. Measured: claude exits 1 "error: unknown option '--help
    # ...'"; gemini takes the value for its --help flag and prints usage with exit 0, which the host would
    # have judged by validation as a run that completed.
    assert REJECTED.search(run.text) and not EXPECT[name].failure.search(run.text), run.text[-2000:]
    assert not run.exit.timed_out and run.exit.exit_code is not None


# -- (b) our reader and classifier on the real failure ---------------------------------------------------

def read(run: Run):
    ex = run.exit
    return READERS[run.spec.output](ex.stdout.decode("utf-8", "replace"), ex.stderr.decode("utf-8", "replace"))


@SHARES_RUNS
@pytest.mark.parametrize("name", CLIS)
def test_real_offline_failure_is_neither_completed_nor_rate_limited(runs, name):
    run = runs(name, "plain")
    ex, spec = run.exit, run.spec
    reading = read(run)
    assert reading.claimed_status != "completed", reading
    want = r"Reconnecting" if name == "codex" else EXPECT[name].failure
    assert re.search(want, reading.summary), reading.summary  # the summary names the real failure
    # The host classifies only a nonzero exit; the killed codex (-15) counts as one here on purpose: if it
    # ever did exit nonzero with this text, "Reconnecting... waiting for network" must not be a rate limit.
    assert ex.exit_code not in (0, None)
    verdict = classify(ex.exit_code, run.text, Patterns.build(spec.rate_limit_patterns, spec.approval_patterns))
    assert verdict.status is None, (verdict, run.text[-2000:])  # neither rate_limited nor approval_required


# gemini's real error: a banner line, then the error object pretty-printed over several lines on stderr.
@SHARES_RUNS
@pytest.mark.parametrize("name", ["claude", "codex", "grok", "gemini"])
def test_reader_claims_failed_on_the_real_offline_output(runs, name):
    reading = read(runs(name, "plain"))
    assert reading.claimed_status == "failed", reading


# -- (b) the same failure through the host -------------------------------------------------------------

SECRETISH = re.compile(r"API_KEY|AUTH_TOKEN|ACCESS_TOKEN|^(ANTHROPIC|OPENAI|CODEX|CLAUDE|GEMINI|GOOGLE|GROK|XDG)_"
                       r"|^(NO_PROXY|no_proxy)$")


def host_config(home: Path, monkeypatch) -> Config:
    """The built-in agent table, each agent's env pointing PATH at the cache and HOME at an empty dir."""
    for k in list(os.environ):
        if SECRETISH.search(k):
            monkeypatch.delenv(k)
    base = load_config()  # PROCTOR_HOME is a fresh temp dir (conftest): no user config, only built-ins
    offline = offline_env(home)
    agents = {n: s.model_copy(update={"env": {**s.env, **offline}}) for n, s in base.agents.items()}
    return base.model_copy(update={"agents": agents})


def no_process_left_in(wt: Path) -> list[str]:
    left = []
    for p in psutil.process_iter(["pid", "name", "cwd"]):
        try:
            if p.info["cwd"] and Path(p.info["cwd"]).is_relative_to(wt):
                left.append(f"{p.info['pid']} {p.info['name']}")
        except (psutil.Error, ValueError):
            pass
    return left


@pytest.mark.parametrize("confine", ["off", "auto"])
@pytest.mark.parametrize("name", ["claude", "gemini", "grok"])
def test_host_ends_real_offline_cli_misconfigured_without_a_retry(tmp_path, monkeypatch, name, confine):
    """Unconfined and under the machine's strongest confinement: the real CLI must still fail on auth,
    not on a state file its confinement hid from it."""
    installed(name)
    home = tmp_path / "home"
    home.mkdir()
    repo = make_repo(tmp_path, {"README.md": "hello\n"})
    config = host_config(home, monkeypatch).model_copy(update={"confine": confine})
    res = run_agent(RunAgentRequest(agent=name, task=DASHED, repo=str(repo), ticket="T-1", timeoutSec=60),
                    config=config)
    assert (res.confinement == "none") is (confine == "off"), res.confinement
    want = EXPECT[name].exit_codes
    # Not logged in / no key: the CLI cannot run as configured, which a retry would not change.
    assert res.status is Status.failed and res.code is Code.AGENT_MISCONFIGURED, res
    assert res.attempts == 1 and len(res.exit_codes) == 1 and set(res.exit_codes) <= set(want), res.exit_codes
    assert res.claimed_status != "completed" and EXPECT[name].failure.search(res.summary), res
    assert res.agent_version == cli_version(name), res.agent_version  # the cached CLI ran, not another on PATH
    assert res.needs_human_review
    # grok writes its own .grok/ folder into the workspace (README); nothing else may change.
    assert [f for f in res.changed_files if not (name == "grok" and f.startswith(".grok/"))] == [], res.changed_files
    assert not any("rate" in r for r in res.known_risks), res.known_risks
    assert no_process_left_in(Path(res.worktree_path)) == []


OFFLINE_DEADLINE_S = 15  # codex's first "Reconnecting" came at under 2 s here; margin for a loaded machine


def test_host_ends_real_offline_codex_timed_out(tmp_path, monkeypatch):
    """codex retries "Reconnecting... waiting for network" forever: it is the only test that the real CLI's
    tree dies at the host's deadline and is neither retried nor called a rate limit. Classification of its
    text never runs for a timed-out job, so test_real_offline_failure_reads_as_failed_never_rate_limited
    drives `classify` and the reader directly on the captured output as well."""
    installed("codex")
    home = tmp_path / "home"
    home.mkdir()
    repo = make_repo(tmp_path, {"README.md": "hello\n"})
    # model_construct skips the contract's 60 s floor (test_contract checks the clamp): codex's first
    # "Reconnecting" comes within seconds, and the rest of a minute proves nothing more.
    req = RunAgentRequest(agent="codex", task=PLAIN, repo=str(repo), ticket="T-1")
    res = run_agent(RunAgentRequest.model_construct(**{**req.model_dump(), "timeout_sec": OFFLINE_DEADLINE_S}),
                    config=host_config(home, monkeypatch))
    assert res.status is Status.timed_out and res.code is Code.TIMED_OUT, res
    assert res.attempts == 1 and res.exit_codes[0] not in (0, None), res.exit_codes
    assert res.claimed_status == "failed" and "Reconnecting" in res.summary, res.summary
    assert res.agent_version == cli_version("codex"), res.agent_version
    # Ended by the deadline, not before it. A lower bound only, which load can never break; how far past it
    # the tree died is not asserted (a loaded machine's number): the TIMED_OUT code and no process left are
    # the kill (issue 24).
    assert res.duration_seconds >= OFFLINE_DEADLINE_S, res.duration_seconds
    assert no_process_left_in(Path(res.worktree_path)) == []
    assert subprocess.run(["git", "status", "--porcelain"], cwd=res.worktree_path, capture_output=True,
                          text=True, check=True).stdout == ""


@pytest.mark.parametrize("node_proxy", [True, False], ids=["preload", "control-without"])
def test_grok_confined_reaches_its_model_through_the_egress_proxy(tmp_path, monkeypatch, node_proxy):
    """grok's SDK calls node's fetch, which ignores the proxy variables: confined (no network but the host's
    egress proxy), it never reached its model. With the adapter's `node_proxy` preload the model answers,
    through the proxy (an allowed egress row); the control, the preload off, is the old "Connection error"."""
    installed("grok")
    need_bwrap()
    model = LoopbackModel(_grok_reply)
    port = model.server.server_address[1]
    try:
        home = tmp_path / "home"
        home.mkdir()
        repo = make_repo(tmp_path, {"README.md": "hello\n"})
        base = host_config(home, monkeypatch)
        grok = base.agents["grok"].model_copy(update={
            "node_proxy": node_proxy, "egress": (f"127.0.0.1:{port}",),
            "env": {**base.agents["grok"].env, "GROK_BASE_URL": f"{model.url}/v1"}})
        monkeypatch.setenv("GROK_API_KEY", "not-a-real-key")
        config = base.model_copy(update={"confine": "required", "agents": {**base.agents, "grok": grok}})
        res = run_agent(RunAgentRequest(agent="grok", task=PLAIN, repo=str(repo), ticket="T-1", timeoutSec=60,
                                        validateCommand="true"), config=config)
    finally:
        model.close()
    chats = [body for path, body in model.requests if path.endswith("/chat/completions")]
    if node_proxy:
        assert chats and "ok from the loopback model" in res.summary, (res.summary, res.known_risks)
        users = [m.get("content") for m in chats[0].get("messages", []) if m.get("role") == "user"]
        assert users == [PLAIN], users
        assert "never reached its model" not in res.summary
    else:
        assert chats == [] and "Connection error" in res.summary, (res.summary, model.requests)
        # grok exits 0 on it: the host, which saw no request pass its proxy, says what happened.
        assert res.exit_codes and res.exit_codes[-1] == 0, res.exit_codes
        assert (res.status, res.code) == (Status.failed, Code.AGENT_FAILED), res.summary
        assert res.summary.startswith("the agent never reached its model: it sent no request"), res.summary
        assert res.tests_attempted == [], res.tests_attempted  # nothing to validate: no model, no work
    assert res.confinement != "none"
