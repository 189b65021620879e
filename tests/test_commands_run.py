"""Running a command request: every kind of undeclared write is caught, dry runs run nothing, timeouts kill
the group and still account for writes, the environment is scrubbed, output is capped, and a changed ledger
or dispatch file stops the accounting. Real git repos, real processes, a real SQLite ledger."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import psutil
import pytest
from conftest import wait_until

from proctor.mechanisms.ledger.store import Ledger
from proctor.services.commands import (
    LedgerTamperedError,
    RequestCode,
    UndeclaredWritesError,
    run_request,
    snapshot,
)
from test_commands_support import (  # noqa: F401  (fixtures)
    PY,
    base_policy,
    home,
    isolation_mode,
    ledger_kinds,
    ledger_rows,
    policy_file,
    project,
    request,
    toml_str,
    tools,
)


def run(tools: Path, project: Path, policy_file: Path, *args: str, **kw):
    fields = {k: kw.pop(k) for k in ("expected_writes", "stdin_from_content", "cwd") if k in kw}
    return run_request(request(tools, *args, **fields), project=project, policy=policy_file, **kw)


UNDECLARED = [
    # (what the command does, the paths it changes, files it needs first)
    (("write", "build/new.o"), ["build/new.o"]),  # inside a git-ignored folder
    (("write", "build/old.o"), ["build/old.o"]),  # an ignored file that already existed
    (("rename", "notes.txt", "out/moved.txt"), ["notes.txt", "out/moved.txt"]),
    (("delete", "src/app.py"), ["src/app.py"]),
    (("chmod", "src/app.py"), ["src/app.py"]),
    (("rewrite", "src/app.py"), ["src/app.py"]),  # same size, mtime restored with os.utime
]


@pytest.mark.parametrize("racy_window", [snapshot.RACY_WINDOW_NS, 0], ids=["hashing-racy", "metadata-only"])
@pytest.mark.parametrize(("argv", "changed"), UNDECLARED, ids=[a[0][0] + "-" + a[0][1] for a in UNDECLARED])
def test_undeclared_writes_are_caught_and_declared_ones_run(
    argv, changed, racy_window, tools, project, policy_file, home, monkeypatch
) -> None:
    monkeypatch.setattr(snapshot, "RACY_WINDOW_NS", racy_window)
    target = project / argv[1]
    before = target.stat() if target.exists() else None
    with pytest.raises(UndeclaredWritesError) as info:
        run(tools, project, policy_file, *argv)
    result = info.value.result
    assert result.ran and result.exit == 0
    assert result.undeclared_writes == sorted(changed)
    assert result.code == RequestCode.UNDECLARED_WRITES
    assert ledger_kinds(home)[-2:] == ["run-request-start", "run-request-undeclared-writes"]
    assert ledger_rows(home)[-1].payload["undeclared_writes"] == sorted(changed)
    if argv[0] == "rewrite":  # the test does what it says: same size, same mtime, other bytes
        after = target.stat()
        assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
        assert target.read_text() != "print('app')\n"
    # Control: the same command with its writes declared runs clean (on a fresh file for the one-shot ones).
    if argv[0] == "rename":
        (project / "notes.txt").write_text("again\n")
        (project / "out" / "moved.txt").unlink()
    if argv[0] == "delete":
        (project / "src" / "app.py").write_text("print('app')\n")
    result = run(tools, project, policy_file, *argv, expected_writes=changed)
    assert result.ok and result.undeclared_writes == [] and sorted(result.changed) == sorted(changed)


def test_a_declared_folder_covers_what_is_made_inside_it(tools, project, policy_file) -> None:
    result = run(tools, project, policy_file, "write", "build/deep/a.o", "build/deep/b.o", expected_writes=["build/"])
    assert result.ok and set(result.changed) >= {"build/deep", "build/deep/a.o", "build/deep/b.o"}
    # A new folder on the way to a declared file is part of that write; a sibling is not.
    (project / "build" / "deep2").mkdir()
    with pytest.raises(UndeclaredWritesError) as info:
        run(tools, project, policy_file, "write", "out/x/y.txt", "out/z.txt", expected_writes=["out/x/y.txt"])
    assert info.value.result.undeclared_writes == ["out/z.txt"]


def test_a_dry_run_runs_nothing_and_the_same_request_runs_for_real(tools, project, policy_file, home) -> None:
    out = project / "out" / "dry.txt"
    result = run(tools, project, policy_file, "write", "out/dry.txt", expected_writes=["out/dry.txt"], dry_run=True)
    assert (result.ran, result.dry_run, result.code, result.exit) == (False, True, RequestCode.DRY_RUN, None)
    assert not out.exists()
    assert ledger_kinds(home) == []
    result = run(tools, project, policy_file, "write", "out/dry.txt", expected_writes=["out/dry.txt"])
    assert result.ok and out.read_text() == "written\n"


def test_a_timeout_kills_the_group_and_writes_are_still_checked(tools, project, policy_file, home) -> None:
    with pytest.raises(UndeclaredWritesError) as info:
        run(tools, project, policy_file, "sleep", "60", expected_writes=["child.pid"])
    result = info.value.result
    # Timed out (the policy's 5 s, not the 60 s asked): ended by the deadline; how soon is not asserted.
    assert result.timed_out and result.ran and result.exit != 0
    assert result.undeclared_writes == ["before.txt"]
    # The pid it wrote is the one it saw: in bwrap's pid namespace (every run hides $PROCTOR_HOME in one)
    # that is not a host pid, so the child is looked for by what it runs.
    assert int((project / "child.pid").read_text()) > 0
    def alive() -> list[psutil.Process]:
        return [p for p in psutil.process_iter(["cmdline", "status"])
                if "time.sleep(120)" in " ".join(p.info["cmdline"] or []) and p.info["status"] != psutil.STATUS_ZOMBIE]

    # A pid namespace's members die with it, but the kernel's teardown is asynchronous: one can still be
    # on its way out (SIGKILL pending) as the run returns on a loaded machine. One that was never killed
    # sleeps 120 s, past this bound.
    wait_until(lambda: not alive(), 60, "the timed-out command's child to be gone")
    # With every write declared, a timeout is a result (TIMED_OUT), not an error; timeout_cap lowers it.
    for name in ("child.pid", "before.txt"):
        (project / name).unlink()
    result = run(tools, project, policy_file, "sleep", "60", expected_writes=["child.pid", "before.txt"],
                 timeout_cap=0.5)
    assert result.code == RequestCode.TIMED_OUT and result.timeout_s == 0.5 and not result.ok
    assert ledger_rows(home)[-1].payload["code"] == "TIMED_OUT"


def test_the_environment_is_an_allowlist(tools, project, policy_file, monkeypatch) -> None:
    monkeypatch.setenv("PROCTOR_TEST_SECRET", "hunter2-secret")
    monkeypatch.setenv("PROCTOR_TEST_PASSED", "allowlisted-value")
    monkeypatch.setenv("PATH", f"relative/bin{os.pathsep}{os.environ['PATH']}")
    result = run(tools, project, policy_file, "env")
    env = json.loads(result.stdout)
    assert "PROCTOR_TEST_SECRET" not in env and "hunter2-secret" not in result.stdout
    # Control: the same mechanism passes a variable the entry names.
    assert env["PROCTOR_TEST_PASSED"] == "allowlisted-value"
    assert all(os.path.isabs(d) for d in env["PATH"].split(os.pathsep))
    # TMPDIR: the run's private temp folder; PWD: bwrap's, where it runs.
    assert set(env) - {"PROCTOR_RUN_MARKER", "PROCTOR_TEST_PASSED", "PATH", "LC_CTYPE", "TMPDIR", "PWD"} <= {
        "HOME", "LANG", "LANGUAGE", "LC_ALL", "LC_MESSAGES", "LOGNAME", "TERM", "TZ", "USER"}


def test_output_is_capped_per_stream(tools, project, policy_file) -> None:
    result = run(tools, project, policy_file, "spam", "3000000")
    assert result.ok and result.truncated
    assert len(result.stdout) == 1000 and result.stdout_dropped == 3_000_000 - 1000
    assert result.stderr == "e" * 10 and result.stderr_dropped == 0
    result = run(tools, project, policy_file, "spam", "1000")
    assert result.ok and not result.truncated and len(result.stdout) == 1000


def test_stdin_content_passes_its_gates_and_reaches_the_command(tools, project, policy_file) -> None:
    stdin = {"path": "out/e.txt", "content": "line one\nline two\n"}
    result = run(tools, project, policy_file, "stdin", "out/e.txt", expected_writes=["out/e.txt"],
                 stdin_from_content=stdin)
    assert result.ok and (project / "out" / "e.txt").read_text() == stdin["content"]


def test_exit_status_and_leftover_processes_fail_the_run(tools, project, policy_file, home, isolation_mode) -> None:
    result = run(tools, project, policy_file, "exit", "3")
    assert (result.ran, result.exit, result.code, result.ok) == (True, 3, RequestCode.EXIT_NONZERO, False)
    result = run(tools, project, policy_file, "daemon")
    if isolation_mode == "bwrap":
        # In bwrap's pid namespace the daemon dies with its pid 1, by the kernel: nothing is left over.
        assert result.confinement_details["cleanup"] == "pidns"
    else:
        assert result.code == RequestCode.LEFTOVER_PROCESSES and result.leftovers_killed >= 1 and not result.ok
    alive = [p for p in psutil.process_iter(["cmdline", "status"])
             if str(project) in " ".join(p.info["cmdline"] or []) and p.info["status"] != psutil.STATUS_ZOMBIE]
    assert alive == []
    assert ledger_kinds(home)[-1] == "run-request-end"


def test_a_pinned_cwd_runs_there(tools, project, policy_file) -> None:
    result = run(tools, project, policy_file, "write", "here.txt", cwd="src", expected_writes=["src/here.txt"])
    assert result.ok and result.entry == "in-src" and (project / "src" / "here.txt").exists()


def test_rows_link_start_and_end(tools, project, policy_file, home) -> None:
    result = run(tools, project, policy_file, "write", "out/a.txt", expected_writes=["out/a.txt"])
    start, end = ledger_rows(home)[-2:]
    assert start.kind == "run-request-start" and end.kind == "run-request-end"
    assert start.job_id == end.job_id == result.request_id
    assert end.payload["start_row"] == start.id and start.payload["argv"] == result.argv
    assert list(json.loads(result.to_json()))[:9] == [
        "agent", "argv", "exit", "duration_ms", "stdout", "stderr", "truncated", "undeclared_writes", "ran"]


@pytest.mark.parametrize("target", ["ledger", "head", "policy"])
def test_a_changed_ledger_or_dispatch_file_raises_and_nothing_more_is_recorded(
    target, tools, project, policy_file, home, isolation_mode
) -> None:
    run(tools, project, policy_file, "exit", "0")  # control: the untouched ledger accounts normally
    assert ledger_kinds(home)[-1] == "run-request-end"
    path = {"ledger": home / "ledger.sqlite3", "head": home / "ledger.head", "policy": policy_file}[target]
    rows_before = len(ledger_rows(home))
    original = path.read_bytes()
    if isolation_mode == "bwrap":
        # $PROCTOR_HOME is an empty read-only folder to the command: the edit cannot even be made.
        result = run(tools, project, policy_file, "tamper", str(path))
        assert result.ran and result.exit != 0 and result.code == RequestCode.EXIT_NONZERO
        assert str(real_home(home)) in result.hidden and result.exposed == []
        assert ledger_kinds(home)[-1] == "run-request-end"  # accounted normally: nothing was tampered with
        with Ledger(home / "ledger.sqlite3") as led:
            assert led.verify() == []
        if target == "policy":
            assert path.read_bytes() == original
        return
    with pytest.raises(LedgerTamperedError) as info:
        run(tools, project, policy_file, "tamper", str(path))
    assert info.value.code == RequestCode.LEDGER_TAMPERED and str(path) in info.value.message
    kinds = ledger_kinds(home)
    assert len(kinds) == rows_before + 1 and kinds[-1] == "run-request-start"
    if target == "policy":  # the allowlist is put back; the ledger never is (that would hide a real row)
        assert path.read_bytes() == original and "put back" in info.value.message


def real_home(home: Path) -> Path:
    return Path(os.path.realpath(home))


GIT_TARGETS = [".git/refs/heads/master", ".git/objects/info/alternates", ".git/modules/sub/hooks/post-checkout",
               ".git/packed-refs", ".git/hooks/post-checkout", "src/.git/payload", "src/.git/hooks/pre-commit"]


@pytest.mark.parametrize("target", GIT_TARGETS)
def test_writes_in_git_internals_or_a_nested_git_dir_are_undeclared(target, tools, project, home, tmp_path) -> None:
    gitbin = shutil.which("git")
    act = toml_str(tools / "act.py")
    pol = tmp_path / "git.toml"
    pol.write_text(base_policy(tools, extra=f"""
[[agents.codex.commands]]
name = "git-write"
argv = [{toml_str(PY)}, {act}, "write", {toml_str(project / target)}]
[[agents.codex.commands]]
name = "git-status"
argv = [{toml_str(gitbin)}, "status", "--porcelain"]
"""))
    original = (project / target).read_bytes() if (project / target).exists() else None
    try:
        result = run_request(request(tools, "write", str(project / target)), project=project, policy=pol)
        # Only where the OS refused the write: hooks/ is mounted read-only (bwrap), so nothing changed.
        assert target == ".git/hooks/post-checkout" and result.exit != 0 and result.undeclared_writes == []
    except UndeclaredWritesError as exc:
        assert target in exc.result.undeclared_writes
        if target == ".git/hooks/post-checkout":  # without bwrap: seen, and put back
            assert any(r.startswith(str(project / ".git" / "hooks")) for r in exc.result.rolled_back)
    if target == ".git/hooks/post-checkout":
        assert not (project / target).exists()  # a planted hook never survives the run
    elif original is None:
        (project / target).unlink()
    else:
        (project / target).write_bytes(original)
    # Control: git's own churn (status refreshing .git/index after a touch) is not a write of the command's.
    os.utime(project / "src" / "app.py", ns=(1, time.time_ns()))
    index = (project / ".git" / "index").stat().st_mtime_ns
    req = {**request(tools), "argv": [gitbin, "status", "--porcelain"]}
    result = run_request(req, project=project, policy=pol)
    assert result.ok and result.undeclared_writes == [], result
    assert (project / ".git" / "index").stat().st_mtime_ns != index  # the control did touch the git dir


@pytest.mark.parametrize("name", ["signers.toml", "keys/host.key", "keys/new.key", "config.toml", "policy.toml",
                                  "commands.toml"])
def test_a_command_rewriting_proctor_trust_or_config_is_tamper(name, tools, project, home, tmp_path,
                                                               isolation_mode) -> None:
    (home / "keys").mkdir()
    for n in ("signers.toml", "keys/host.key", "config.toml", "policy.toml"):
        (home / n).write_text("trusted\n")
    target = home / name
    pol = tmp_path / "tamper.toml"  # outside the home, so only the home's own files are at stake
    pol.write_text(base_policy(tools, extra=f"""
[[agents.codex.commands]]
name = "rewrite-home"
argv = [{toml_str(PY)}, {toml_str(tools / "act.py")}, "tamper", {toml_str(target)}]
"""))
    (home / "commands.toml").write_text(pol.read_text())
    run(tools, project, pol, "exit", "0")  # control: untouched, the run accounts normally
    assert ledger_kinds(home)[-1] == "run-request-end"
    before = {n: (home / n).read_bytes() for n in ("signers.toml", "keys/host.key", "config.toml", "policy.toml",
                                                   "commands.toml")}
    tamper = {**request(tools), "argv": [PY, str(tools / "act.py"), "tamper", str(target)]}
    if isolation_mode == "bwrap":
        result = run_request(tamper, project=project, policy=pol)  # impossible: the home is not there
        assert result.ran and result.exit != 0 and ledger_kinds(home)[-1] == "run-request-end"
    else:
        with pytest.raises(LedgerTamperedError) as info:
            run_request(tamper, project=project, policy=pol)
        assert info.value.code == RequestCode.LEDGER_TAMPERED and str(target.parent if name == "keys/new.key"
                                                                      else target) in info.value.message
        assert ledger_kinds(home)[-1] == "run-request-start" and "put back" in info.value.message
    # Either way the edit does not stay: every trust and config file holds its old bytes, no new key.
    assert {n: (home / n).read_bytes() for n in before} == before
    assert sorted(os.listdir(home / "keys")) == ["host.key"]
