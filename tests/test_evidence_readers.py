"""The evidence readers against the real runners' own output (issue 20): cargo/libtest and node's test
runner, each run for real on a tiny project, honest beside hostile (the process ends in the middle of the
run with exit 0, which both runners report as success). Under CI a missing cargo or node fails."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
from pathlib import Path

import pytest

from proctor.mechanisms.evidence import readers
from proctor.mechanisms.evidence.verdict import judge

CI = os.environ.get("CI") == "true"


def need(tool: str) -> None:
    if shutil.which(tool) is None:
        if CI:
            pytest.fail(f"CI must have {tool} for the evidence reader tests", pytrace=False)
        pytest.skip(f"needs {tool}")


def verdict(label: str, code: int, ev: readers.Evidence | None, expected: str | None):
    """The plain rules (no base to hold the step to)."""
    return judge(label, code, {ev.source: ev} if ev is not None else {}, None, expected=expected)


def cargo_test(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    crate = tmp_path / "c"
    (crate / "src").mkdir(parents=True)
    (crate / "Cargo.toml").write_text('[package]\nname = "c"\nversion = "0.1.0"\nedition = "2021"\n')
    (crate / "src" / "lib.rs").write_text("pub fn add(a: i32, b: i32) -> i32 { a + b }\n#[cfg(test)]\nmod tests {\n"
                                         + body + "}\n")
    real_home = Path(pwd.getpwuid(os.getuid()).pw_dir)  # the tests' HOME is a throw-away one (conftest)
    tools = {var: str(real_home / rel) for var, rel in (("RUSTUP_HOME", ".rustup"), ("CARGO_HOME", ".cargo"))
             if var not in os.environ and (real_home / rel).is_dir()}
    env = {**os.environ, **tools, "CARGO_NET_OFFLINE": "true", "CARGO_TARGET_DIR": str(tmp_path / "target")}
    return subprocess.run(["cargo", "test"], cwd=crate, env=env, capture_output=True, timeout=300)


def test_libtest_honest_run_is_counted(tmp_path):
    need("cargo")
    p = cargo_test(tmp_path, "    #[test] fn t1() { assert_eq!(super::add(1, 1), 2); }\n"
                             "    #[test] fn t2() { assert_eq!(super::add(2, 2), 4); }\n")
    assert p.returncode == 0, p.stderr[-2000:]
    ev = readers.read_libtest(p.stdout, p.stderr)
    assert ev is not None and ev.passed == 2 and ev.failed == 0 and not ev.problems, ev
    assert verdict("cargo test", 0, ev, "libtest").failure is None


def test_libtest_exit_in_a_test_is_caught_though_cargo_says_ok(tmp_path):
    need("cargo")
    p = cargo_test(tmp_path, "    #[test] fn t1() { assert_eq!(super::add(1, 1), 2); }\n"
                             "    #[test] fn t2() { std::process::exit(0); }\n"
                             "    #[test] fn t3() { assert_eq!(super::add(1, 1), 3); }\n")
    assert p.returncode == 0, "control: cargo reports a test binary that exited 0 mid-run as success"
    ev = readers.read_libtest(p.stdout, p.stderr)
    assert ev is not None and ev.problems, ev
    assert "never reached its normal end" in (verdict("cargo test", 0, ev, "libtest").failure or "")


def node_test(tmp_path: Path, files: dict[str, str]) -> subprocess.CompletedProcess:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    # Off a terminal node 20's runner reports TAP, the stream the reader reads.
    return subprocess.run(["node", "--test"], cwd=tmp_path, capture_output=True, timeout=120)


HEAD = "const test = require('node:test'); const assert = require('node:assert');\n"


def test_tap_honest_run_is_counted(tmp_path):
    need("node")
    p = node_test(tmp_path, {"a.test.js": HEAD + "test('one', () => assert.strictEqual(1 + 1, 2));\n"
                                                 "test('two', () => assert.strictEqual(2 + 2, 4));\n"})
    assert p.returncode == 0, p.stdout[-2000:]
    ev = readers.read_tap(p.stdout)
    assert ev is not None and ev.passed == 2 and not ev.problems, ev
    assert verdict("npm test", 0, ev, None).failure is None


def test_tap_a_file_that_exits_early_is_caught_though_node_says_ok(tmp_path):
    need("node")
    p = node_test(tmp_path, {"a.test.js": HEAD + "test('one', () => assert.strictEqual(1 + 1, 2));\n"
                                                 "test('two', () => { process.exit(0); });\n"
                                                 "test('three', () => assert.strictEqual(1 + 1, 3));\n",
                             "b.test.js": HEAD + "test('b1', () => assert.strictEqual(1, 1));\n"})
    assert p.returncode == 0, "control: node's runner reports the file that exited 0 mid-run as passing"
    ev = readers.read_tap(p.stdout)
    assert ev is not None and any("a.test.js" in x for x in ev.problems), (ev, p.stdout[-2000:])
    assert verdict("npm test", 0, ev, None).failure


def test_a_tap_stream_cut_before_its_plan_fails():
    ev = readers.read_tap(b"TAP version 13\nok 1 - one\nok 2 - two\n")
    assert ev is not None and ev.problems and verdict("npm test", 0, ev, None).failure
    whole = readers.read_tap(b"TAP version 13\nok 1 - one\nok 2 - two\n1..2\n")
    assert whole is not None and not whole.problems and verdict("npm test", 0, whole, None).failure is None


def test_no_evidence_from_a_runner_proctor_chose_fails_and_from_any_other_is_a_risk():
    assert verdict("python -m pytest", 0, None, "pytest").failure
    other = verdict("make test", 0, None, None)
    assert other.failure is None and any("exit code alone" in r for r in other.risks)


def test_a_torn_plugin_report_has_no_normal_end():
    report = (b'{"e":"start","pid":1}\n{"e":"collected","n":2,"pid":1}\n'
              b'{"e":"test","id":"t::a","when":"call","outcome":"passed","pid":1}\n{"e":"te')
    ev = readers.read_pytest(report)
    assert ev is not None and ev.sessions == 1 and ev.ended == 0
    assert "never reached its normal end" in (verdict("python -m pytest", 0, ev, "pytest").failure or "")


def test_the_resolution_probe_imports_nothing_the_tree_can_shadow(tmp_path):
    """A root-level `json.py` (or `importlib/`) answered proctor's "where does the package resolve" probe."""
    import sys

    from proctor.mechanisms.validation.probe import PY_PROBE, _parse

    (tmp_path / "json.py").write_text("print('PROCTOR-PROBE {}')\nraise SystemExit(0)\n")
    (tmp_path / "importlib").mkdir()
    (tmp_path / "importlib" / "__init__.py").write_text("raise SystemExit(0)\n")
    (tmp_path / "calc.py").write_text("")
    naive = subprocess.run([sys.executable, "-c", "import json; print(json.dumps({}))"], cwd=tmp_path,
                           capture_output=True, text=True)
    assert "PROCTOR-PROBE {}" in naive.stdout, "control: the planted json.py answers a probe that imports json"
    got = subprocess.run([sys.executable, "-c", PY_PROBE, "calc"], cwd=tmp_path, capture_output=True)
    found = _parse(got.stdout)
    assert found is not None and found["calc"]["origin"] == str(tmp_path / "calc.py"), got
