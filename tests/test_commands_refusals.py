"""Every refusal of a command request, each beside its control: the same call with the one defect removed
runs, and the file it writes proves it. Real git repos, real processes, a real SQLite ledger."""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from proctor.services.commands import ProposalError, RequestCode, run_request
from test_commands_support import (  # noqa: F401  (fixtures)
    PY,
    base_policy,
    git,
    home,
    ledger_kinds,
    ledger_rows,
    policy_file,
    project,
    request,
    tools,
)


@dataclass
class Ctx:
    tmp: Path
    home: Path
    tools: Path
    project: Path
    policy: Path

    @property
    def evidence(self) -> Path:
        return self.project / "out" / "e.txt"

    def ok(self, **fields: Any) -> dict[str, Any]:
        return request(self.tools, "write", "out/e.txt", **{"expected_writes": ["out/e.txt"], **fields})

    def call(self, req: dict[str, Any] | None = None, **kw: Any) -> dict[str, Any]:
        return {"request": req if req is not None else self.ok(), "project": self.project, "policy": self.policy, **kw}

    def policy_with(self, name: str, extra: str = "", *, transform: Callable[[str], str] = lambda s: s) -> Path:
        path = self.tmp / f"{name}.toml"
        path.write_text(transform(base_policy(self.tools, extra=extra)))
        return path


Pair = tuple[dict[str, Any], dict[str, Any]]


def _without(d: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k != key}


def c_unknown_key(c: Ctx) -> Pair:
    return c.call({**c.ok(), "approved": True}), c.call()


def c_missing_key(c: Ctx) -> Pair:
    return c.call(_without(c.ok(), "purpose")), c.call()


def c_kind(c: Ctx) -> Pair:
    return c.call({**c.ok(), "kind": "change-proposal"}), c.call()


def c_agent_mismatch(c: Ctx) -> Pair:
    return c.call(expect_agent="claude"), c.call(expect_agent="codex")


def c_agent_refused(c: Ctx) -> Pair:
    return c.call(refuse_agents=frozenset({"codex"})), c.call(refuse_agents=frozenset({"claude"}))


def c_shell_string(c: Ctx) -> Pair:
    return c.call({**c.ok(), "argv": shlex.join(c.ok()["argv"])}), c.call()


def c_argv_not_strings(c: Ctx) -> Pair:
    return c.call({**c.ok(), "argv": [*c.ok()["argv"][:-1], 7]}), c.call()


def c_argv_empty(c: Ctx) -> Pair:
    return c.call({**c.ok(), "argv": []}), c.call()


def c_argv_nul(c: Ctx) -> Pair:
    return c.call({**c.ok(), "argv": [*c.ok()["argv"][:-1], "out/e.txt\x00"]}), c.call()


def c_purpose(c: Ctx) -> Pair:
    return c.call(c.ok(purpose="   ")), c.call()


def c_policy_invalid(c: Ctx) -> Pair:
    bad = c.policy_with("bad", transform=lambda s: s.replace('not_match = [', 'not_match = [["x"], ', 1)
                        .replace('"write", "--force"]', '"write", "out/a.txt"]', 1))
    return c.call(policy=bad), c.call()


def c_policy_missing(c: Ctx) -> Pair:
    return c.call(policy=c.tmp / "nope.toml"), c.call()


def c_project_relative(c: Ctx) -> Pair:
    return c.call(project=os.path.relpath(c.project)), c.call()


def c_project_holds_home(c: Ctx) -> Pair:
    return c.call(project=c.tmp), c.call()


def c_no_allowlist(c: Ctx) -> Pair:
    return c.call(c.ok(agent="gemini")), c.call()


def c_not_allowlisted(c: Ctx) -> Pair:
    return c.call(request(c.tools, "write", "--force", "out/e.txt", expected_writes=["out/e.txt"])), c.call()


def c_unknown_action(c: Ctx) -> Pair:
    return c.call(request(c.tools, "explode", "out/e.txt", expected_writes=["out/e.txt"])), c.call()


def c_arg_outside(c: Ctx) -> Pair:
    return c.call(request(c.tools, "write", "../e.txt", expected_writes=["out/e.txt"])), c.call()


def c_arg_symlink_out(c: Ctx) -> Pair:
    (c.project / "out" / "link").symlink_to(c.tmp)
    return c.call(request(c.tools, "write", "out/link/e.txt", expected_writes=["out/e.txt"])), c.call()


def c_arg_protected(c: Ctx) -> Pair:
    return c.call(request(c.tools, "write", ".git/e.txt", expected_writes=["out/e.txt"])), c.call()


def c_cwd(c: Ctx) -> Pair:
    return c.call(c.ok(cwd="src")), c.call()


def c_cwd_symlink_out(c: Ctx) -> Pair:
    # The pinned cwd replaced by a link out of the project; the control's pinned cwd is a link that stays in.
    import json

    (c.tmp / "elsewhere").mkdir()
    (c.project / "ext").symlink_to(c.tmp / "elsewhere")
    (c.project / "inner").symlink_to(c.project / "src")
    act, evidence = json.dumps(str(c.tools / "act.py")), json.dumps(str(c.evidence))
    extra = "".join(
        f'\n[[agents.codex.commands]]\nname = "{d}"\nargv = [{json.dumps(PY)}, {act}, "write", {evidence}]\n'
        f'cwd = "{d}"\nwrites = ["out/**"]\n' for d in ("ext", "inner")
    )
    pol = c.policy_with("cwds", extra)
    req = request(c.tools, "write", str(c.evidence), expected_writes=["out/e.txt"])
    return c.call({**req, "cwd": "ext"}, policy=pol), c.call({**req, "cwd": "inner"}, policy=pol)


_PROGS = """
[[agents.codex.commands]]
name = "missing"
argv = ["proctor-no-such-program", {act}, "write", "out/e.txt"]
writes = ["out/**"]
[[agents.codex.commands]]
name = "on-path"
argv = ["{py_name}", {act}, "write", "out/e.txt"]
writes = ["out/**"]
[[agents.codex.commands]]
name = "in-project"
argv = [{inside}, {act}, "write", "out/e.txt"]
writes = ["out/**"]
[[agents.codex.commands]]
name = "outside"
argv = [{outside}, {act}, "write", "out/e.txt"]
writes = ["out/**"]
"""


def _programs(c: Ctx) -> Path:
    import json

    bindir = c.tmp / "bin"
    bindir.mkdir(exist_ok=True)
    for d in (bindir, c.project / "tools"):
        d.mkdir(exist_ok=True)
        if not (d / "py").exists():
            (d / "py").symlink_to(PY)
    extra = _PROGS.format(act=json.dumps(str(c.tools / "act.py")), py_name=os.path.basename(PY),
                          inside=json.dumps(str(c.project / "tools" / "py")), outside=json.dumps(str(bindir / "py")))
    return c.policy_with("progs", extra)


def _argv0(c: Ctx, program: str) -> dict[str, Any]:
    req = c.ok()
    req["argv"] = [program, *req["argv"][1:]]
    return req


def c_program_missing(c: Ctx, monkeypatch: pytest.MonkeyPatch) -> Pair:
    pol = _programs(c)
    monkeypatch.setenv("PATH", f"{os.path.dirname(PY)}{os.pathsep}{os.environ['PATH']}")
    return (c.call(_argv0(c, "proctor-no-such-program"), policy=pol),
            c.call(_argv0(c, os.path.basename(PY)), policy=pol))


def c_program_in_project(c: Ctx) -> Pair:
    pol = _programs(c)
    return (c.call(_argv0(c, str(c.project / "tools" / "py")), policy=pol),
            c.call(_argv0(c, str(c.tmp / "bin" / "py")), policy=pol))


def c_path_in_project_dropped(c: Ctx, monkeypatch: pytest.MonkeyPatch) -> Pair:
    # A PATH entry inside the project is dropped, so the planted `py` there is never found.
    pol = _programs(c)
    (c.project / "tools" / "py").unlink()
    (c.project / "tools" / "py").symlink_to(PY)
    monkeypatch.setenv("PATH", f"{c.project / 'tools'}{os.pathsep}{os.environ['PATH']}")
    return (c.call(_argv0(c, "proctor-no-such-program"), policy=pol),
            c.call(_argv0(c, str(c.tmp / "bin" / "py")), policy=pol))


def c_write_outside(c: Ctx) -> Pair:
    return c.call(c.ok(expected_writes=["out/e.txt", "../x.txt"])), c.call()


def c_write_git(c: Ctx) -> Pair:
    return c.call(c.ok(expected_writes=["out/e.txt", ".git/config"])), c.call()


def c_write_brief(c: Ctx) -> Pair:
    return c.call(c.ok(expected_writes=["out/e.txt", "docs/brief.md"])), c.call()


def c_write_home_via_link(c: Ctx) -> Pair:
    (c.project / "out" / "h").symlink_to(c.home)
    return c.call(c.ok(expected_writes=["out/e.txt", "out/h/commands.toml"])), c.call()


def c_write_folder_holding_brief(c: Ctx) -> Pair:
    return c.call(c.ok(expected_writes=["out/e.txt", "docs/"])), c.call()


def c_write_root_folder(c: Ctx) -> Pair:
    return c.call(c.ok(expected_writes=["out/e.txt", "./"])), c.call()


def c_write_not_allowed(c: Ctx) -> Pair:
    req = request(c.tools, "write-narrow", "out/e.txt", expected_writes=["out/e.txt", "notes.txt"])
    return c.call(req), c.call({**req, "expected_writes": ["out/e.txt"]})


def c_write_folder_not_covered(c: Ctx) -> Pair:
    req = request(c.tools, "write-narrow", "out/e.txt", expected_writes=["build/"])
    return c.call(req), c.call({**req, "expected_writes": ["out/"]})


def _stdin_req(c: Ctx, **stdin: Any) -> dict[str, Any]:
    body = {"path": "out/e.txt", "content": "hello", **stdin}
    return request(c.tools, "stdin", "out/e.txt", expected_writes=["out/e.txt"], stdin_from_content=body)


def c_stdin_shape(c: Ctx) -> Pair:
    return c.call(_stdin_req(c, mode="0600")), c.call(_stdin_req(c))


def c_stdin_not_string(c: Ctx) -> Pair:
    return c.call(_stdin_req(c, content=["hello"])), c.call(_stdin_req(c))


def c_stdin_path_protected(c: Ctx) -> Pair:
    return c.call(_stdin_req(c, path=".git/config")), c.call(_stdin_req(c))


def c_stdin_not_gated(c: Ctx) -> Pair:
    ungated = c.policy_with("ungated", transform=lambda s: s.replace("stdin_gates = [", "stdin_gates_off = [", 1)
                            .replace("stdin_gates_off = [{type = \"max_bytes\", limit = 1000}, {type = \"deny_regex\", "
                                     "patterns = [\"SECRET\"]}]", ""))
    return c.call(_stdin_req(c), policy=ungated), c.call(_stdin_req(c))


def c_stdin_gate_regex(c: Ctx) -> Pair:
    return c.call(_stdin_req(c, content="the SECRET is out")), c.call(_stdin_req(c))


def c_stdin_gate_size(c: Ctx) -> Pair:
    return c.call(_stdin_req(c, content="x" * 1001)), c.call(_stdin_req(c, content="x" * 1000))


def c_not_git(c: Ctx) -> Pair:
    plain = c.tmp / "plain"
    (plain / "out").mkdir(parents=True)
    defect = c.call(project=plain)
    return defect, defect


def c_git_subdir(c: Ctx) -> Pair:
    sub = c.project / "src"
    (sub / "out").mkdir()
    return c.call(project=sub), c.call()


def c_spawn_failed(c: Ctx) -> Pair:
    import json

    bindir = c.tmp / "bin"
    bindir.mkdir(exist_ok=True)
    broken, good = bindir / "broken", bindir / "good"
    # An interpreter that does not exist: exec fails whether the runner starts it or bwrap's `env -C` does.
    # (Not a garbage ELF: glibc's execvp, which env uses, hands an ENOEXEC file to /bin/sh.)
    broken.write_bytes(b"#!/nonexistent/interpreter\n")
    good.write_text(f"#!{PY}\n" + (c.tools / "act.py").read_text())
    for p in (broken, good):
        p.chmod(0o755)
    extra = "".join(
        f'\n[[agents.codex.commands]]\nname = "{p.name}"\nargv = [{json.dumps(str(p))}, "write", "out/e.txt"]\n'
        'writes = ["out/**"]\n' for p in (broken, good)
    )
    pol = c.policy_with("spawn", extra)
    req = c.ok()
    return (c.call({**req, "argv": [str(broken), "write", "out/e.txt"]}, policy=pol),
            c.call({**req, "argv": [str(good), "write", "out/e.txt"]}, policy=pol))


CASES: list[tuple[RequestCode, Callable[..., Pair]]] = [
    (RequestCode.REQUEST_SHAPE, c_unknown_key),
    (RequestCode.REQUEST_SHAPE, c_missing_key),
    (RequestCode.NOT_A_COMMAND_REQUEST, c_kind),
    (RequestCode.AGENT_MISMATCH, c_agent_mismatch),
    (RequestCode.AGENT_REFUSED, c_agent_refused),
    (RequestCode.ARGV_SHELL_STRING, c_shell_string),
    (RequestCode.ARGV_INVALID, c_argv_not_strings),
    (RequestCode.ARGV_INVALID, c_argv_empty),
    (RequestCode.ARGV_INVALID, c_argv_nul),
    (RequestCode.PURPOSE_EMPTY, c_purpose),
    (RequestCode.POLICY_INVALID, c_policy_invalid),
    (RequestCode.POLICY_INVALID, c_policy_missing),
    (RequestCode.PROJECT_INVALID, c_project_relative),
    (RequestCode.PROJECT_INVALID, c_project_holds_home),
    (RequestCode.NO_ALLOWLIST, c_no_allowlist),
    (RequestCode.NOT_ALLOWLISTED, c_not_allowlisted),
    (RequestCode.NOT_ALLOWLISTED, c_unknown_action),
    (RequestCode.ARG_PATH_OUTSIDE_PROJECT, c_arg_outside),
    (RequestCode.ARG_PATH_OUTSIDE_PROJECT, c_arg_symlink_out),
    (RequestCode.ARG_PATH_PROTECTED, c_arg_protected),
    (RequestCode.CWD_MISMATCH, c_cwd),
    (RequestCode.CWD_MISMATCH, c_cwd_symlink_out),
    (RequestCode.PROGRAM_NOT_FOUND, c_program_missing),
    (RequestCode.PROGRAM_NOT_FOUND, c_path_in_project_dropped),
    (RequestCode.PROGRAM_IN_PROJECT, c_program_in_project),
    (RequestCode.WRITE_OUTSIDE_PROJECT, c_write_outside),
    (RequestCode.WRITE_IN_CONTROL_PLANE, c_write_git),
    (RequestCode.WRITE_IN_CONTROL_PLANE, c_write_brief),
    (RequestCode.WRITE_OUTSIDE_PROJECT, c_write_home_via_link),
    (RequestCode.WRITE_IN_CONTROL_PLANE, c_write_root_folder),
    (RequestCode.WRITE_IN_CONTROL_PLANE, c_write_folder_holding_brief),
    (RequestCode.WRITE_NOT_ALLOWED, c_write_not_allowed),
    (RequestCode.WRITE_NOT_ALLOWED, c_write_folder_not_covered),
    (RequestCode.STDIN_SHAPE, c_stdin_shape),
    (RequestCode.STDIN_SHAPE, c_stdin_not_string),
    (RequestCode.STDIN_SHAPE, c_stdin_path_protected),
    (RequestCode.STDIN_NOT_GATED, c_stdin_not_gated),
    (RequestCode.STDIN_GATE_FAILED, c_stdin_gate_regex),
    (RequestCode.STDIN_GATE_FAILED, c_stdin_gate_size),
    (RequestCode.NOT_A_GIT_WORKTREE, c_not_git),
    (RequestCode.NOT_A_GIT_WORKTREE, c_git_subdir),
    (RequestCode.SPAWN_FAILED, c_spawn_failed),
]


@pytest.fixture
def ctx(tmp_path: Path, home: Path, tools: Path, project: Path, policy_file: Path) -> Ctx:
    return Ctx(tmp_path, home, tools, project, policy_file)


@pytest.mark.parametrize(("code", "case"), CASES, ids=[f.__name__[2:] for _, f in CASES])
def test_refused_with_its_code_and_the_control_runs(code, case, ctx: Ctx, monkeypatch: pytest.MonkeyPatch) -> None:
    needs_mp = "monkeypatch" in case.__code__.co_varnames[: case.__code__.co_argcount]
    defect, control = case(ctx, monkeypatch) if needs_mp else case(ctx)
    with pytest.raises(ProposalError) as info:
        run_request(**defect)
    assert info.value.code == code, info.value.message
    assert info.value.message and "Traceback" not in info.value.message
    rows = ledger_rows(ctx.home)
    assert rows[-1].kind == "run-request-refused" and rows[-1].payload["code"] == code.value
    evidence = Path(control["project"]) / "out" / "e.txt"
    assert not evidence.exists(), "a refused request must not run"
    if case is c_not_git:  # the control is the same folder once it is a worktree
        git("init", "-q", cwd=Path(control["project"]))
        git("commit", "-q", "--allow-empty", "-m", "init", cwd=Path(control["project"]))
    result = run_request(**control)
    assert result.ran and result.code == RequestCode.OK, result
    assert evidence.exists()
    assert ledger_kinds(ctx.home)[-2:] == ["run-request-start", "run-request-end"]


def test_checks_run_in_the_documented_order(ctx: Ctx) -> None:
    # Wrong identity, a shell-string argv and an unknown program all at once: identity (check 1) wins.
    req = {**ctx.ok(agent="gemini"), "argv": "rm -rf /"}
    with pytest.raises(ProposalError) as info:
        run_request(**ctx.call(req, expect_agent="codex"))
    assert info.value.code == RequestCode.AGENT_MISMATCH
    # Arguments (2) before the allowlist (3); allowlist before declared writes (4); writes before stdin (6).
    with pytest.raises(ProposalError) as info:
        run_request(**ctx.call({**req, "agent": "codex"}))
    assert info.value.code == RequestCode.ARGV_SHELL_STRING
    bad = request(ctx.tools, "explode", expected_writes=[".git/config"], stdin_from_content={"x": 1})
    with pytest.raises(ProposalError) as info:
        run_request(**ctx.call(bad))
    assert info.value.code == RequestCode.NOT_ALLOWLISTED
    bad = request(ctx.tools, "stdin", "out/e.txt", expected_writes=[".git/config"], stdin_from_content={"x": 1})
    with pytest.raises(ProposalError) as info:
        run_request(**ctx.call(bad))
    assert info.value.code == RequestCode.WRITE_IN_CONTROL_PLANE


def test_a_dry_run_refusal_records_nothing(ctx: Ctx) -> None:
    with pytest.raises(ProposalError) as info:
        run_request(**ctx.call({**ctx.ok(), "argv": "python x"}, dry_run=True))
    assert info.value.code == RequestCode.ARGV_SHELL_STRING
    assert ledger_kinds(ctx.home) == []
