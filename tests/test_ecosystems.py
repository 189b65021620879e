"""The job's environment on real public projects, one per ecosystem, under bwrap+landlock (issue 12).

Each project comes from its registry (tests/ecosystems_fetch.py: fetched once, cached) and is committed into
a fresh repo, the developer's main checkout, with its dependencies installed there as its developer would:

    python-src   cachetools (src layout), installed editable into the ACTIVE venv, pointing at the main checkout
    python-flat  six (flat layout, one module), installed editable into the repo's own `.venv` (not active)
    node         xtend, `npm install` in the main checkout (devDependency tape), `npm test`
    rust         itoa (from Debian's librust-itoa-dev), `cargo test`, the developer's own target/ in main

Every job is autodetected (no config, no --validate-cmd). A fix job starts from a base with one real bug and
restores the published code: `completed` with needs_human_review false. A break job puts that bug into the
published code: `failed`/VALIDATION_FAILED, needs_human_review true. For Python the control shows the trap
is real: the same broken tree, tested the naive way with the venv's python, passes, because the editable
install imports the main checkout's code. The ledger's `job.probe` row says where the code under test
resolved; it must be inside the validated tree. The main checkout is never written.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

import ecosystems_fetch as fx
from proctor import RunAgentRequest, Status, run_agent
from proctor.config import load_config
from proctor.confine import detect
from proctor.contract import Code
from proctor.job import environment, validate
from proctor.ledger import Ledger

CAPS = detect()
BOTH = CAPS.bwrap is not None and CAPS.landlock
if not BOTH and os.environ.get("CI") == "true":
    pytest.fail("CI must have bwrap and Landlock for the ecosystem tests", pytrace=False)
pytestmark = pytest.mark.skipif(not BOTH, reason="needs bubblewrap and Landlock (bwrap+landlock)")


# -- helpers -----------------------------------------------------------------------------------------------

def job(repo: Path, tmp_path: Path, script: str, branch: str):
    """One autodetected job of a `sh` agent running `script` in its worktree, confine = required."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = tmp_path / "agent.toml"
    cfg.write_text(f'confine = "required"\n[agents.sh]\ncommand = ["/bin/sh", "-c", {json.dumps(script)}]\n'
                   'prompt = "stdin"\nnetwork = false\n')
    with Ledger(tmp_path / "ledger.sqlite3") as ledger:
        res = run_agent(RunAgentRequest(agent="sh", task="t", repo=str(repo), ticket="T", branch=branch),
                        config=load_config(cfg), ledger=ledger)
        rows = {r.kind: r.payload for r in ledger.rows(job_id=res.job_id)}
    assert res.confinement == "bwrap+landlock", res
    return res, rows


def assert_fixed(res, rows) -> None:
    assert res.status is Status.completed and res.code is Code.OK, (res.known_risks, res.tests_attempted)
    assert res.needs_human_review is False and res.known_risks == [], res.known_risks
    assert len(res.tests_attempted) == 1 and res.tests_attempted[0].endswith("=> exit 0"), res.tests_attempted
    assert rows["job.probe"]["risks"] == []


def assert_broken(res, rows) -> None:
    assert res.status is Status.failed and res.code is Code.VALIDATION_FAILED, (res.known_risks, res)
    assert res.needs_human_review is True
    assert any(r.startswith("validation failed: ") for r in res.known_risks), res.known_risks
    assert rows["job.probe"]["risks"] == []


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True).stdout


def main_state(repo: Path) -> tuple:
    """What a job must never change in the main checkout: HEAD, refs, the status of every file, ignored
    ones (node_modules, .venv, target/) included, and each file's size and mtime."""
    listing = subprocess.run(["find", ".", "-path", "./.git", "-prune", "-o", "-type", "f", "-printf",
                              "%P %s %T@\n"], cwd=repo, capture_output=True, text=True, check=True).stdout
    return (_git(repo, "rev-parse", "HEAD"), _git(repo, "for-each-ref"),
            _git(repo, "status", "--porcelain", "--ignored"), sorted(listing.splitlines()))


def probe_origins(rows, kind: str) -> list[str]:
    found = rows["job.probe"]["found"][kind]
    if kind == "python":
        return [p for info in found.values() for p in [info.get("origin"), *info.get("locations", [])] if p]
    return [p for p in (found.get("self"), found.get("entry")) if p]


def assert_inside_validated_tree(paths: list[str], repo: Path) -> None:
    """The validated tree is the job's work dir beside the main checkout ({repo}-agents/.<jobId>.work)."""
    assert paths, "the probe found nothing"
    agents = Path(f"{repo}-agents").resolve()
    for p in paths:
        real = Path(p).resolve()
        assert real.is_relative_to(agents) and not real.is_relative_to(repo.resolve()), p


# -- python, src layout, editable install in the active venv ------------------------------------------------

@pytest.fixture(scope="module")
def src_project(tmp_path_factory):
    root = tmp_path_factory.mktemp("eco-python-src")
    repo = fx.require(fx.make_repo, "python-src", root)
    venv = root / "venv"
    fx.require(fx.make_venv, venv, repo)  # editable: the venv imports cachetools from the main checkout
    return repo, venv


@pytest.fixture
def active_venv(src_project, monkeypatch):
    repo, venv = src_project
    monkeypatch.setenv("VIRTUAL_ENV", str(venv))
    monkeypatch.setenv("PATH", f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}")
    return repo, venv


def test_python_src_layout_editable_in_the_active_venv(active_venv, tmp_path):
    repo, venv = active_venv
    proj = fx.PROJECTS["python-src"]
    # Control: the broken tree tested the naive way (a clone, the active venv's python) passes, because the
    # editable install imports the main checkout's cachetools.
    clone = tmp_path / "control"
    subprocess.run(["git", "clone", "-q", str(repo), str(clone)], check=True)
    subprocess.run(["/bin/sh", "-c", proj.edit.breaks], cwd=clone, check=True)
    naive = subprocess.run([str(venv / "bin/python"), "-m", "pytest", "-q", "-p", "no:cacheprovider"],
                           cwd=clone, capture_output=True, text=True)
    assert naive.returncode == 0, "control: the naive run should have imported the main checkout's code"
    before = main_state(repo)

    res, rows = job(repo, tmp_path / "fix", proj.edit.fix, "broken")
    assert_fixed(res, rows)
    assert res.changed_files == [proj.edit.path]
    assert_inside_validated_tree(probe_origins(rows, "python"), repo)

    res, rows = job(repo, tmp_path / "break", proj.edit.breaks, "master")
    assert_broken(res, rows)
    assert_inside_validated_tree(probe_origins(rows, "python"), repo)
    assert {"HOME", "XDG_CACHE_HOME", "PYTHONPATH"} <= set(rows["job.environment"]["env"])
    assert rows["job.environment"]["python_packages"][0] == "cachetools"
    assert main_state(repo) == before


def test_python_package_resolving_outside_the_tree_needs_review(active_venv, tmp_path):
    """A legacy editable install (`setup.py develop`'s easy-install.pth) puts the main checkout ahead of
    PYTHONPATH: validation then tests the main checkout's code, whatever the job's tree holds. The probe
    names it, and the job is never trusted: needs_human_review stays true, even when every test passed."""
    repo, venv = active_venv
    site = next((venv / "lib").glob("python3*/site-packages"))
    pth = site / "zz-legacy-develop.pth"
    pth.write_text(f"import sys; sys.path.insert(0, {str(repo / 'src')!r})\n")
    try:
        res, rows = job(repo, tmp_path / "fix", fx.PROJECTS["python-src"].edit.breaks, "master")
    finally:
        pth.unlink()
    assert res.status is Status.completed, res  # the main checkout's good code was tested
    assert res.needs_human_review is True
    outside = [r for r in res.known_risks if "resolves outside the validated tree" in r]
    assert outside and str(repo / "src") in outside[0], res.known_risks
    assert rows["job.probe"]["risks"] == outside


# -- python, flat layout, the repo's own .venv ---------------------------------------------------------------

@pytest.fixture(scope="module")
def flat_project(tmp_path_factory):
    root = tmp_path_factory.mktemp("eco-python-flat")
    repo = fx.require(fx.make_repo, "python-flat", root)
    fx.require(fx.make_venv, repo / ".venv", repo)  # ignored by git; a finder-style editable install
    return repo


def test_python_flat_layout_with_the_repos_own_venv(flat_project, tmp_path, monkeypatch):
    repo = flat_project
    monkeypatch.delenv("VIRTUAL_ENV", raising=False)  # not active: autodetected from the main checkout
    proj = fx.PROJECTS["python-flat"]
    before = main_state(repo)

    res, rows = job(repo, tmp_path / "fix", proj.edit.fix, "broken")
    assert_fixed(res, rows)
    assert_inside_validated_tree(probe_origins(rows, "python"), repo)
    assert {"VIRTUAL_ENV", "PATH", "PYTHONPATH"} <= set(rows["job.environment"]["env"])

    res, rows = job(repo, tmp_path / "break", proj.edit.breaks, "master")
    assert_broken(res, rows)
    assert_inside_validated_tree(probe_origins(rows, "python"), repo)
    assert main_state(repo) == before


# -- node: devDependencies installed in the main checkout --------------------------------------------------

@pytest.fixture(scope="module")
def node_project(tmp_path_factory):
    root = tmp_path_factory.mktemp("eco-node")
    repo = fx.require(fx.make_repo, "node", root)
    fx.require(fx.node_modules_installed, repo)  # writes node_modules/ and an untracked package-lock.json
    return repo


def test_node_dev_dependencies_from_the_main_checkout(node_project, tmp_path):
    repo = node_project
    proj = fx.PROJECTS["node"]
    before = main_state(repo)

    res, rows = job(repo, tmp_path / "fix", proj.edit.fix, "broken")
    assert_fixed(res, rows)
    assert res.tests_attempted == ["npm test => exit 0"]
    shares = rows["job.environment"]["shares"]
    assert len(shares) == 1 and shares[0].startswith(f"{repo / 'node_modules'} -> "), shares
    assert rows["job.environment"]["bind"] is True  # a read-only bind mount, not a link
    assert_inside_validated_tree(probe_origins(rows, "node"), repo)
    assert rows["job.probe"]["found"]["node"]["links"] == []

    res, rows = job(repo, tmp_path / "break", proj.edit.breaks, "master")
    assert_broken(res, rows)
    assert res.tests_attempted == ["npm test => exit 1"]
    assert {"HOME", "npm_config_cache"} <= set(rows["job.environment"]["env"])
    assert main_state(repo) == before


# -- rust ------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def rust_project(tmp_path_factory):
    root = tmp_path_factory.mktemp("eco-rust")
    env = fx.require(fx.rust_env)
    repo = fx.require(fx.make_repo, "rust", root)
    # The developer's own build in the main checkout: a target/ a job must neither use nor write.
    subprocess.run(["cargo", "test", "--offline", "-q"], cwd=repo, env={**os.environ, **env}, check=True,
                   capture_output=True)
    assert (repo / "target").is_dir()
    return repo, env


def test_rust_crate_with_private_target_dir(rust_project, tmp_path, monkeypatch):
    repo, env = rust_project
    for k, v in env.items():  # a rustup proxy finds its toolchain through these, as HOME moved
        monkeypatch.setenv(k, v)
    proj = fx.PROJECTS["rust"]
    before = main_state(repo)
    cargo_home = Path(env["CARGO_HOME"]) if "CARGO_HOME" in env else None
    home_before = sorted(os.listdir(cargo_home)) if cargo_home else None

    res, rows = job(repo, tmp_path / "fix", proj.edit.fix, "broken")
    assert_fixed(res, rows)
    assert res.tests_attempted == ["cargo test => exit 0"]
    assert {"HOME", "CARGO_TARGET_DIR", "CARGO_NET_OFFLINE"} <= set(rows["job.environment"]["env"])

    res, rows = job(repo, tmp_path / "break", proj.edit.breaks, "master")
    assert_broken(res, rows)
    assert res.tests_attempted == ["cargo test => exit 101"]
    assert main_state(repo) == before  # target/ included: the job built into its own CARGO_TARGET_DIR
    if cargo_home:
        assert sorted(os.listdir(cargo_home)) == home_before


DEPENDENT_LIB = """pub fn signed(n: i64) -> String {
    let mut buf = itoa::Buffer::new();
    buf.format(n).to_owned()
}

#[cfg(test)]
mod tests {
    #[test]
    fn negative() {
        assert_eq!(super::signed(-42), "-42");
    }
}
"""


def test_rust_dependency_from_a_shared_read_only_registry(rust_project, tmp_path, monkeypatch):
    """A crate depending on itoa, its `.cargo/config.toml` replacing crates.io with a directory registry
    outside the repo (Debian's /usr/share/cargo/registry way): the job builds it offline, reading the shared
    source and writing none of it."""
    _, env = rust_project
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    registry = fx.require(fx.cargo_registry)
    repo = tmp_path / "dependent"
    (repo / "src").mkdir(parents=True)
    (repo / ".cargo").mkdir()
    (repo / "Cargo.toml").write_text('[package]\nname = "dependent"\nversion = "0.1.0"\nedition = "2018"\n\n'
                                     '[dependencies]\nitoa = "1"\n')
    (repo / ".cargo/config.toml").write_text('[source.crates-io]\nreplace-with = "shared"\n\n'
                                             f'[source.shared]\ndirectory = {json.dumps(str(registry))}\n')
    (repo / "src/lib.rs").write_text(DEPENDENT_LIB)
    (repo / ".gitignore").write_text("target/\nCargo.lock\n")
    for argv in (["init", "-q", "-b", "master"], ["add", "-A"], ["commit", "-qm", "dependent crate"]):
        subprocess.run([*fx.GIT, *argv], cwd=repo, check=True, capture_output=True)
    shared_before = sorted(p.stat().st_mtime_ns for p in registry.rglob("*"))
    before = main_state(repo)

    res, rows = job(repo, tmp_path / "ok", "sed -i 's/to_owned()/to_string()/' src/lib.rs", "master")
    assert_fixed(res, rows)
    assert res.tests_attempted == ["cargo test => exit 0"]
    res, rows = job(repo, tmp_path / "bad", "sed -i 's/buf.format(n)/buf.format(-n)/' src/lib.rs", "master")
    assert_broken(res, rows)
    assert sorted(p.stat().st_mtime_ns for p in registry.rglob("*")) == shared_before
    assert main_state(repo) == before


# -- the environment's rules, on the same shapes without a job -----------------------------------------------

def _node_tree(root: Path, lock: str | None) -> Path:
    root.mkdir()
    (root / "package.json").write_text('{"name": "p", "scripts": {"test": "node t"}}\n')
    if lock is not None:
        (root / "package-lock.json").write_text(lock)
    return root


def test_a_lockfile_only_the_main_checkout_has_does_not_stop_the_share(tmp_path):
    main = _node_tree(tmp_path / "main", '{"lockfileVersion": 3}\n')  # npm install wrote it, untracked
    (main / "node_modules").mkdir()
    tree = _node_tree(tmp_path / "tree", None)
    jenv = environment.prepare(tree, main, validate.detect(tree), tmp=tmp_path / "t", env={"HOME": str(tmp_path)})
    assert [s.source for s in jenv.shares] == [main / "node_modules"] and jenv.risks == ()


def test_a_lockfile_the_tree_changed_stops_the_share(tmp_path):
    main = _node_tree(tmp_path / "main", '{"lockfileVersion": 3}\n')
    (main / "node_modules").mkdir()
    tree = _node_tree(tmp_path / "tree", '{"lockfileVersion": 3, "x": 1}\n')
    jenv = environment.prepare(tree, main, validate.detect(tree), tmp=tmp_path / "t", env={"HOME": str(tmp_path)})
    assert jenv.shares == () and "the lockfile changed (package-lock.json)" in jenv.risks[0]


def test_the_package_under_test_found_in_a_share_is_outside_the_tree(tmp_path):
    """A copy of the package itself installed in the shared node_modules (or .venv) is the main checkout's
    dependency, not the job's code, though its path is inside the tree where the share is mounted."""
    main = _node_tree(tmp_path / "main", None)
    (main / "node_modules").mkdir()
    tree = _node_tree(tmp_path / "tree", None)
    jenv = environment.prepare(tree, main, validate.detect(tree), tmp=tmp_path / "t", env={"HOME": str(tmp_path)})
    assert jenv.shares
    stale = str(tree / "node_modules" / "p" / "index.js")
    out = f"PROCTOR-PROBE {json.dumps({'self': stale, 'entry': str(tree / 'index.js'), 'links': []})}".encode()
    risks, _ = environment.judge(jenv, "node", out)
    assert len(risks) == 1 and stale in risks[0]
    py = f"PROCTOR-PROBE {json.dumps({'p': {'origin': str(tree / 'node_modules/p/__init__.py')}})}".encode()
    assert environment.judge(jenv, "python", py)[0]
