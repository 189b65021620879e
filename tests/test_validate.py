"""Validation autodetect at the worktree root, and the host running it with real exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from proctor.mechanisms.validation import plan as validate
from proctor.mechanisms.process.local import LocalRunner


def layout(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


@pytest.mark.parametrize("files,labels", [
    ({"pyproject.toml": ""}, ["-m pytest"]),
    ({"setup.cfg": ""}, ["-m pytest"]),
    ({"pytest.ini": ""}, ["-m pytest"]),
    ({"tox.ini": ""}, ["-m pytest"]),
    ({"package.json": json.dumps({"scripts": {"test": "jest"}})}, ["npm test"]),
    ({"Cargo.toml": ""}, ["cargo test"]),
    ({"go.mod": ""}, ["go test ./..."]),
    ({"go.mod": "", "vendor/modules.txt": ""}, ["go test -mod=vendor ./..."]),
    ({"App.sln": "", "a/A.csproj": ""}, ["dotnet build App.sln", "dotnet test App.sln"]),
    ({"A.csproj": ""}, ["dotnet build A.csproj", "dotnet test A.csproj"]),
    ({"Makefile": "test:\n\ttrue\n"}, ["make test"]),
    ({"Makefile": "test:\n\ttrue\n", "pyproject.toml": ""}, ["make test"]),
])
def test_detects(tmp_path, files, labels):
    plan = validate.detect(layout(tmp_path, files))
    assert plan.skipped_reason is None
    got = [s.label for s in plan.steps]
    assert len(got) == len(labels) and all(g.endswith(w) for g, w in zip(got, labels))


@pytest.mark.parametrize("files,needle", [
    ({}, "no test command detected"),
    ({"package.json": json.dumps({"scripts": {"build": "tsc"}})}, "no test command"),
    ({"package.json": json.dumps({"scripts": {"test": validate.NPM_PLACEHOLDER}})}, "no test command"),
    ({"Makefile": "build:\n\ttrue\ntest-all:\n\ttrue\n"}, "no test command"),
    ({"pyproject.toml": "", "go.mod": ""}, "ambiguous root (go, python)"),
    ({"A.sln": "", "B.sln": ""}, "ambiguous .NET root"),
    ({"A.csproj": "", "B.csproj": ""}, "ambiguous .NET root"),
])
def test_skips_with_a_reason(tmp_path, files, needle):
    plan = validate.detect(layout(tmp_path, files))
    assert plan.steps == () and needle in plan.skipped_reason


def test_run_records_real_exit_codes_and_stops_at_first_failure(tmp_path):
    plan = validate.Plan((validate.Step("a", ("/bin/sh", "-c", "exit 0")), validate.Step("b", ("/bin/sh", "-c", "exit 3")),
                          validate.Step("c", ("/bin/sh", "-c", "exit 0"))))
    run = validate.run(plan, LocalRunner(), cwd=tmp_path, env={"PATH": "/usr/bin:/bin"})
    assert [a.line(1) for a in run.attempts] == ["a => exit 0", "b => exit 3"]


def test_validation_has_its_own_deadline(tmp_path):
    attempts = validate.run(validate.given("sleep 30"), LocalRunner(), cwd=tmp_path, env={"PATH": "/usr/bin:/bin"}, timeout_s=1).attempts
    assert attempts[0].timed_out and attempts[0].line(1) == "sleep 30 => timed out after 1s"


def test_given_command_is_a_shell_command(tmp_path):
    attempts = validate.run(validate.given("test -d . && exit 4"), LocalRunner(), cwd=tmp_path, env={"PATH": "/usr/bin:/bin"}).attempts
    assert attempts[0].line(1) == "test -d . && exit 4 => exit 4"


def test_validation_honours_a_stop(tmp_path):
    run = validate.run(validate.given("sleep 30"), LocalRunner(), cwd=tmp_path, env={"PATH": "/usr/bin:/bin"},
                       poll=lambda: "stopped: test")
    assert run.killed_reason == "stopped: test" and not run.attempts[0].passed
