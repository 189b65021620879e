"""The gate decides on what each CLI will execute (issue 22, items 1, 3, 4, the diff check): its parsers read
a tool's input as the CLI does, every path of every hunk or brace expansion is checked, an input the gate
cannot read completely is refused, a tool that runs commands is `shell` whatever a declaration says, and the
job's diff is checked against the declaration. Each breach beside its control, through the dialects and the
real Gate; the parsers are also checked against the installed CLIs' own code (codex's `apply_patch`, gemini's
bundled brace-expansion) where those are installed."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
from pathlib import Path

import pytest

from proctor.mechanisms.gatekeeper.claude import CLAUDE_TOOLS
from proctor.mechanisms.gatekeeper.codex import CodexDialect, PatchError, parse_patch
from proctor.mechanisms.gatekeeper.gemini import GeminiDialect, system_file_loads
from proctor.mechanisms.gatekeeper.gemini_glob import GlobError, brace_expand
from proctor.mechanisms.gatekeeper.task import measured
from proctor.mechanisms.policy.diffcheck import undeclared
from proctor.mechanisms.policy.gate import Gate, GateCode
from proctor.mechanisms.policy.task import AgentTask
from proctor.mechanisms.policy.trusted import Policy

CLIS = Path(os.environ.get("PROCTOR_CLI_CACHE") or Path.home() / ".cache" / "proctor" / "agent-clis") / "pkgs"
CODEX_BIN = CLIS / "codex/node_modules/@openai/codex-linux-x64/vendor/x86_64-unknown-linux-musl/bin/codex"
GEMINI_BUNDLE = CLIS / "gemini/node_modules/@google/gemini-cli/bundle/chunk-5FZXKDXH.js"


def task(ws: Path, tools: dict[str, str], **perms: bool) -> AgentTask:
    return AgentTask.model_validate({"goal": "g", "tools": [{"name": n, "effect": e} for n, e in tools.items()],
                                     "permissions": {"workspace": str(ws), "read_files": True,
                                                     "write_files": True, **perms}})


def decide(dialect, t: AgentTask, payload: dict, ws: Path, forbid: tuple[str, ...] = ()):
    gate = Gate(measured(t, dialect.tools), policy=Policy(forbidden_paths=forbid), dry_run=False, stop=lambda: None)
    return gate.decide(dialect.call(payload, ws))


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    w = tmp_path / "wt"
    (w / "sub").mkdir(parents=True)
    return w


# -- codex: apply_patch as codex parses it --------------------------------------------------------------

def patch(*hunks: str) -> str:
    return "*** Begin Patch\n" + "".join(hunks) + "*** End Patch\n"


def codex_call(ws: Path, text: str, tool: str = "apply_patch") -> dict:
    return {"tool_name": tool, "tool_input": {"command": text}, "cwd": str(ws), "tool_use_id": "c1"}


@pytest.mark.parametrize("header", ["   *** Add File: ", "\t*** Add File: ", "\u2028*** Add File: ",
                                    "\u3000*** Add File: "])
def test_a_hunk_header_codex_trims_is_checked_like_any_other(ws, header):
    t = task(ws, {"apply_patch": "write"})
    ok = patch("*** Add File: a.txt\n+x\n", "*** Add File: b.txt\n+y\n")  # the control: both inside
    assert decide(CodexDialect(), t, codex_call(ws, ok), ws).code is GateCode.OK
    bad = patch("*** Add File: a.txt\n+x\n", f"{header}../../outside.txt\n+y\n")
    d = decide(CodexDialect(), t, codex_call(ws, bad), ws)
    assert d.code is GateCode.OUTSIDE_WORKSPACE and "outside.txt" in d.reason, d


def test_a_forbidden_path_in_any_hunk_is_refused(ws):
    t = task(ws, {"apply_patch": "write"})
    ok = patch("*** Add File: a.txt\n+x\n", "  *** Add File: b.txt\n+y\n")
    assert decide(CodexDialect(), t, codex_call(ws, ok), ws, ("secrets/*",)).code is GateCode.OK
    bad = patch("*** Add File: a.txt\n+x\n", "  *** Update File: a.txt\n*** Move to: secrets/k\n@@\n-x\n+y\n")
    d = decide(CodexDialect(), t, codex_call(ws, bad), ws, ("secrets/*",))
    assert d.code is GateCode.POLICY_BLOCKED and "secrets/k" in d.reason, d


def test_a_separator_codex_does_not_split_on_hides_no_header(ws):
    # \x1c ends a line for Python's splitlines, not for Rust's lines(): to codex this is one Add hunk whose
    # path holds the \x1c; the gate must see the same single path, never a second hunk it would miss.
    text = patch("*** Add File: a.txt\x1c*** Add File: /etc/x\n+x\n")
    assert [h.path for h in parse_patch(text)] == ["a.txt\x1c*** Add File: /etc/x"]
    assert decide(CodexDialect(), task(ws, {"apply_patch": "write"}), codex_call(ws, text), ws).code is GateCode.OK


@pytest.mark.parametrize("text", ["*** Begin Patch\n*** Frob: x\n*** End Patch", "no patch at all",
                                  patch("*** Update File: a.txt\n*** End of File\n"), patch("*** Add File:  \n+x\n")])
def test_a_patch_codex_would_not_parse_is_refused_not_guessed(ws, text):
    d = decide(CodexDialect(), task(ws, {"apply_patch": "write"}), codex_call(ws, text), ws)
    assert d.code in (GateCode.CALL_INVALID, GateCode.OK if text.endswith("+x\n*** End Patch\n") else None), d
    if d.code is GateCode.CALL_INVALID:
        assert "the way the CLI reads it" in d.reason


def test_a_lone_carriage_return_is_refused(ws):
    # codex 0.171 drops a \r that ends no line (measured): `..\r/..\r/x` would be `../../x` to it.
    text = patch("*** Add File: ..\r/..\r/x\n+x\n")
    d = decide(CodexDialect(), task(ws, {"apply_patch": "write"}), codex_call(ws, text), ws)
    assert d.code is GateCode.CALL_INVALID and "carriage return" in d.reason, d
    crlf = patch("*** Add File: a\r\n+x\r\n")  # the control: CRLF line ends are codex's own
    assert decide(CodexDialect(), task(ws, {"apply_patch": "write"}), codex_call(ws, crlf), ws).code is GateCode.OK


def test_a_shell_form_patch_resolves_against_its_cd(ws):
    t = task(ws, {"Bash": "shell"}, shell=True)
    body = patch("*** Add File: x.txt\n+x\n")
    ok = decide(CodexDialect(), t, codex_call(ws, f"cd sub && apply_patch <<'EOF'\n{body}EOF\n", "Bash"), ws)
    assert ok.code is GateCode.OK and ok.paths == (f"{ws.resolve()}/sub/x.txt",), ok
    out = decide(CodexDialect(), t, codex_call(ws, f"cd ../.. && apply_patch <<'EOF'\n{body}EOF\n", "Bash"), ws)
    assert out.code is GateCode.OUTSIDE_WORKSPACE, out
    # A patch the shell would hand codex's apply_patch alias in a form the gate cannot read: refused.
    odd = decide(CodexDialect(), t, codex_call(ws, f"true; apply_patch <<'EOF'\n{body}EOF\n", "Bash"), ws)
    assert odd.code is GateCode.CALL_INVALID, odd
    plain = decide(CodexDialect(), t, codex_call(ws, "ls -la", "Bash"), ws)  # no patch: a plain command
    assert plain.code is GateCode.OK and plain.paths == ()


def _fuzz_patch(r: random.Random) -> str:
    ws_ = ["", " ", "  ", "\t", "\x0b", "\x0c", "\x1c", "\u2028", "\xa0", "\x85"]  # (a lone \\r is refused)
    seps = ["\n", "\r\n", "\n", "\x0b", "\u2028", "\x1e"]
    w, nl = (lambda: r.choice(ws_)), (lambda: r.choice(seps))
    edge = (lambda: r.choice(["", " ", "\t", "\u2028", "\xa0"]))  # trimmed by both: the markers still hold
    out = [edge() + "*** Begin Patch" + edge() + r.choice(["\n", "\r\n"])]
    for n in range(r.randint(1, 4)):
        name = f"f{n}{r.choice(['', ' ', chr(0x1c)])}.txt"
        kind = r.choice(["add", "add", "del", "upd"])
        if kind == "add":
            out.append(w() + "*** Add File: " + r.choice(["", " "]) + name + w() + nl() + "+x" + nl())
        elif kind == "del":
            out.append(w() + "*** Delete File: exist.txt" + w() + nl())
        else:
            move = r.choice(["", w() + "*** Move to: " + name + w() + nl()])
            out.append(w() + "*** Update File: exist.txt" + w() + nl() + move + "@@" + nl() + "-old" + nl() + "+new"
                       + nl())
    return "".join(out) + "\n" + edge() + "*** End Patch" + edge() + r.choice(["", "\n"])


@pytest.mark.skipif(not CODEX_BIN.exists(), reason="codex is not installed (make agent-clis)")
def test_the_patch_parser_touches_no_file_codex_does_not_and_misses_none(tmp_path):
    """Differential, against codex 0.171's own apply_patch (its binary run as `apply_patch`): every file
    codex changed is a path the gate saw (a patch the gate refuses never reaches codex)."""
    exe = tmp_path / "bin" / "apply_patch"
    exe.parent.mkdir()
    exe.symlink_to(CODEX_BIN)
    r, refused = random.Random(22), 0
    for _ in range(60):
        text = _fuzz_patch(r)
        d = tmp_path / "run"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
        (d / "exist.txt").write_text("old\n")
        subprocess.run([str(exe), text], check=False, cwd=d, capture_output=True, timeout=30)
        after = {str(p.relative_to(d)) for p in d.rglob("*") if p.is_file()}
        touched = after - {"exist.txt"}
        if "exist.txt" not in after or (d / "exist.txt").read_text() != "old\n":
            touched.add("exist.txt")
        try:
            seen = {os.path.normpath(p) for h in parse_patch(text) for p in h.paths}
        except PatchError:
            refused += 1  # the gate refuses it: codex never gets to apply it
            continue
        assert touched <= seen, (text, touched, seen)
    assert 60 - refused >= 15, refused  # enough parse for the comparison to mean something


# -- gemini: a glob's braces expanded as its glob library does -------------------------------------------

def gemini_call(ws: Path, tool: str, args: dict) -> dict:
    return {"hook_event_name": "BeforeTool", "tool_name": tool, "tool_input": args, "cwd": str(ws)}


@pytest.mark.parametrize("tool, args", [
    ("glob", {"pattern": "{/etc,x}/host*"}),
    ("glob", {"pattern": "{../../home/.gemini,x}/*"}),
    ("glob", {"pattern": "{x},/etc}/*"}),  # brace-expansion's `{a},b}` rule: `/etc/*` is one expansion
    ("glob", {"pattern": "{..,b}/{..,c}/*"}),
    ("read_many_files", {"include": ["{\\etc,x}/hosts"]}),  # backslashes become slashes in that tool
])
def test_every_brace_expansion_of_a_glob_is_checked(ws, tool, args):
    t = task(ws, {tool: "read"})
    control = {"glob": {"pattern": "{sub,x}/*.py"}, "read_many_files": {"include": ["{sub,x}/*.py"]}}[tool]
    assert decide(GeminiDialect(), t, gemini_call(ws, tool, control), ws).code is GateCode.OK
    d = decide(GeminiDialect(), t, gemini_call(ws, tool, args), ws)
    assert d.code is GateCode.OUTSIDE_WORKSPACE, d


def test_a_glob_whose_walk_cannot_be_bounded_is_refused(ws):
    t = task(ws, {"glob": "read"})
    for pattern in ["*/../../etc/*", "{" + ",".join(map(str, range(300))) + "}", "x{1..100000}"]:
        d = decide(GeminiDialect(), t, gemini_call(ws, "glob", {"pattern": pattern}), ws)
        assert d.code is GateCode.CALL_INVALID and "gemini's glob" in d.reason, (pattern, d)
    assert decide(GeminiDialect(), t, gemini_call(ws, "glob", {"pattern": "**/*.py"}), ws).code is GateCode.OK


@pytest.mark.skipif(not (GEMINI_BUNDLE.exists() and shutil.which("node")), reason="gemini or node not installed")
def test_brace_expansion_matches_the_one_gemini_bundles(tmp_path):
    """Differential, against the balanced-match + brace-expansion code in gemini 0.61's own bundle."""
    src = GEMINI_BUNDLE.read_text().splitlines()
    start = src.index("// node_modules/balanced-match/dist/esm/index.js")
    end = src.index("// node_modules/minimatch/dist/esm/assert-valid-pattern.js")
    js = tmp_path / "brace.js"
    js.write_text("\n".join(src[start:end]) + "\nconst ps = JSON.parse(require('fs').readFileSync(0, 'utf8'));\n"
                  "const has = (p) => /\\{(?:(?!\\{).)*\\}/.test(p);\n"
                  "console.log(JSON.stringify(ps.map(p => has(p) ? expand(p) : [p])));\n")
    alphabet = ["{", "}", ",", "a", "/", "..", "\\", "$", "1", "-", ".", "{}", "{a..c}", "{01..3}", "\u2028"]
    r = random.Random(3)
    pats = ["".join(r.choice(alphabet) for _ in range(r.randint(1, 12))) for _ in range(2000)]
    want = json.loads(subprocess.run(["node", str(js)], input=json.dumps(pats), capture_output=True, text=True,
                                     timeout=60, check=True).stdout)
    for p, w in zip(pats, want):
        try:
            assert brace_expand(p) == w, p
        except GlobError:
            pass  # refused: more expansions than the gate checks


# -- every built-in tool's effect, and a declaration cannot weaken it -----------------------------------

def test_a_skill_declared_harmless_is_still_a_shell(ws):
    payload = {"tool_name": "Skill", "tool_input": {"skill": "commit"}, "tool_use_id": "s1"}
    from proctor.mechanisms.gatekeeper.claude import ClaudeDialect

    d = decide(ClaudeDialect(), task(ws, {"Skill": "none"}), payload, ws)
    assert d.code is GateCode.PERMISSION and "'shell'" in d.reason, d
    assert decide(ClaudeDialect(), task(ws, {"Skill": "none"}, shell=True), payload, ws).code is GateCode.OK
    mcp = {"tool_name": "mcp__srv__do", "tool_input": {}, "tool_use_id": "m1"}
    assert decide(ClaudeDialect(), task(ws, {"mcp__srv__do": "none"}), mcp, ws).code is GateCode.PERMISSION
    assert CLAUDE_TOOLS["Skill"][0].value == "shell"


# -- the job's diff against its declaration ----------------------------------------------------------

def test_the_diff_names_forbidden_undeclared_and_outside_paths(ws):
    writes = task(ws, {"Write": "write"})
    assert undeclared(writes, ("secrets/*",), ["a.py", "sub/b.py"]) == []  # the control
    risks = undeclared(writes, ("secrets/*", ".git"), ["a.py", "secrets/k", "x/.git/config"])
    assert len(risks) == 1 and "secrets/k (pattern 'secrets/*')" in risks[0] and "x/.git/config" in risks[0]
    reads = task(ws, {"Read": "read"})
    risks = undeclared(reads, (), ["a.py"])
    assert len(risks) == 1 and "no permitted write" in risks[0] and "a.py" in risks[0]
    assert undeclared(task(ws, {"Bash": "shell"}, shell=True, write_files=False), (), ["a.py"]) == []
    assert "outside its workspace" in undeclared(None, (), ["../x"])[0]
    assert undeclared(None, ("secrets/*",), ["secrets/a"]) and undeclared(None, (), ["a"]) == []


# -- gemini's hooks load in every confinement mode ----------------------------------------------------

@pytest.mark.skipif(os.geteuid() != 0, reason="gemini loads system settings only from root-owned files")
def test_gemini_is_pointed_at_settings_it_loads_wherever_the_gate_dir_is(tmp_path):
    gate_dir = tmp_path / "gate"  # under /tmp: gemini skips a system settings file there
    gate_dir.mkdir()
    (gate_dir / "gemini-settings.json").write_text('{"hooks": {}}')
    assert not system_file_loads(gate_dir / "gemini-settings.json")  # the breach: hooks never loaded
    path = Path(GeminiDialect().env(gate_dir)["GEMINI_CLI_SYSTEM_SETTINGS_PATH"])
    try:
        assert system_file_loads(path) and path.read_text() == '{"hooks": {}}'
    finally:
        shutil.rmtree(path.parent, ignore_errors=True)


@pytest.mark.realcli
@pytest.mark.parametrize("confine", ["off", "required"])
def test_the_real_gemini_is_gated_in_every_confinement_mode(confine, tmp_path):
    """The breach: `--confine off` ended BYPASS, "its hooks were not loaded". `required` is the control."""
    import test_real_cli_jobs as real

    job = real.run_job("gemini", tmp_path, extra=("--confine", confine))
    r = job.result
    assert r["status"] == "completed" and r["code"] == "OK", job.explain()
    assert r["gate"]["armed"] is True and r["gate"]["calls"] == 1 and r["gate"]["refused"] == 0, r["gate"]
    assert r["changed_files"] == [real.ACTION.name], job.explain()
    assert (r["confinement"] == "none") == (confine == "off"), r["confinement"]


def test_an_mcp_resource_tool_is_a_shell_and_never_in_a_default_task(ws):
    from proctor.mechanisms.gatekeeper.claude import ClaudeDialect
    from proctor.mechanisms.gatekeeper.task import default_task

    assert "ReadMcpResourceTool" not in {t.name for t in default_task("g", ws, True, CLAUDE_TOOLS).tools}
    call = {"tool_name": "ReadMcpResourceTool", "tool_input": {"server": "s", "uri": "x"}, "tool_use_id": "r1"}
    assert decide(ClaudeDialect(), task(ws, {"ReadMcpResourceTool": "read"}), call, ws).code is GateCode.PERMISSION
    assert decide(ClaudeDialect(), task(ws, {"ReadMcpResourceTool": "read"}, shell=True), call, ws).code is GateCode.OK
