"""The job's environment on real public projects, one per ecosystem, under bwrap+landlock (issue 12).

Each project comes from its registry (tests/ecosystems_fetch.py: fetched once, cached) and is committed into
a fresh repo, the developer's main checkout, with its dependencies installed there as its developer would:

    python-src   cachetools (src layout), installed editable into the ACTIVE venv, pointing at the main checkout
    python-flat  six (flat layout, one module), installed editable into the repo's own `.venv` (not active)
    python-uv    cachetools as a uv project (hatchling, uv.lock, `uv sync`'s .venv with it editable), tested
                 with `python -m pytest`, and again with `make test` running `uv run pytest` (issue 24)
    node         xtend, `npm install` in the main checkout (devDependency tape), `npm test`
    rust         itoa (from Debian's librust-itoa-dev), `cargo test`, the developer's own target/ in main;
                 and a two-crate workspace whose build script writes into the workspace's target/ (issue 24)
    go           a module with its dependency vendored, `go test -mod=vendor` offline (issue 24)

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
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import ecosystems_fetch as fx
from conftest import sh_job
from proctor import Status
from proctor.mechanisms.confine import detect
from proctor.contract import Code
from proctor.mechanisms.validation import environment, plan as validate
from proctor.mechanisms.validation.probe import judge
from proctor.mechanisms.validation.venvs import hatch_env_path, poetry_env_name, python_env

CAPS = detect()
BOTH = CAPS.bwrap is not None and CAPS.landlock
if not BOTH and os.environ.get("CI") == "true":
    pytest.fail("CI must have bwrap and Landlock for the ecosystem tests", pytrace=False)
pytestmark = pytest.mark.skipif(not BOTH, reason="needs bubblewrap and Landlock (bwrap+landlock)")


# -- helpers -----------------------------------------------------------------------------------------------

def job(repo: Path, tmp_path: Path, script: str, branch: str):
    """One autodetected job of a `sh` agent running `script` in its worktree, confine = required."""
    res, rows = sh_job(repo, tmp_path, script, branch)
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
    PYTHONPATH: validation used to test the main checkout's code, whatever the job's tree held. The person's
    checkout is hidden from validation now (its code is the agent's, and it may not read the person's
    files): the path leads nowhere, the job's own code is what is tested, and the break fails."""
    repo, venv = active_venv
    site = next((venv / "lib").glob("python3*/site-packages"))
    pth = site / "zz-legacy-develop.pth"
    pth.write_text(f"import sys; sys.path.insert(0, {str(repo / 'src')!r})\n")
    try:
        res, rows = job(repo, tmp_path / "fix", fx.PROJECTS["python-src"].edit.breaks, "master")
    finally:
        pth.unlink()
    assert res.status is Status.failed and res.code is Code.VALIDATION_FAILED, res  # the job's code was tested
    assert res.needs_human_review is True
    assert rows["job.probe"]["risks"] == [], rows["job.probe"]


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


# -- python: a uv project, zero config (issue 24) -------------------------------------------------------------

def uv_repo(tmp_path_factory, key: str) -> Path:
    root = tmp_path_factory.mktemp(f"eco-{key}")
    repo = fx.require(fx.make_repo, key, root)
    fx.require(fx.uv_synced, repo)  # .venv: pytest, and cachetools editable from the main checkout's src
    return repo


@pytest.fixture(scope="module")
def uv_project(tmp_path_factory):
    return uv_repo(tmp_path_factory, "python-uv")


@pytest.fixture(scope="module")
def uv_make_project(tmp_path_factory):
    return uv_repo(tmp_path_factory, "python-uv-make")


def failed_test_named(res, name: str) -> bool:
    """The failing test is named in what the result keeps of validation's output."""
    return any(name in (v.get("output_tail") or "") for v in res.validation)


def assert_uv_env(rows, repo: Path) -> None:
    """Validation used the venv uv made for the main checkout, found from uv.lock, and kept uv on it."""
    envrow = rows["job.environment"]
    assert envrow["python_env"]["venv"] == str(repo / ".venv") and envrow["python_env"]["manager"] == "uv", envrow
    assert {"VIRTUAL_ENV", "UV_PROJECT_ENVIRONMENT", "UV_NO_SYNC", "UV_OFFLINE"} <= set(envrow["env"]), envrow


def test_uv_project_with_zero_config(uv_project, tmp_path):
    repo = uv_project
    proj = fx.PROJECTS["python-uv"]
    before = main_state(repo)

    res, rows = job(repo, tmp_path / "fix", proj.edit.fix, "broken")
    assert_fixed(res, rows)
    assert res.tests_attempted[0].endswith("-m pytest => exit 0"), res.tests_attempted
    assert_uv_env(rows, repo)
    # The package is installed editable from the main checkout (hatchling's .pth names its src), yet the
    # code tested is the job's: the validated tree's src comes first.
    assert_inside_validated_tree(probe_origins(rows, "python"), repo)

    res, rows = job(repo, tmp_path / "break", proj.edit.breaks, "master")
    assert_broken(res, rows)
    assert failed_test_named(res, "tests/test_lru.py"), res.validation
    assert_inside_validated_tree(probe_origins(rows, "python"), repo)
    assert main_state(repo) == before  # .venv included: used read-only, never synced


def test_uv_venv_for_another_lockfile_is_a_risk(uv_project, tmp_path):
    """The venv was installed from the main checkout's uv.lock: a tree with another lockfile is tested with
    dependencies it may not declare. The job still runs on it (nothing else has the project's deps), but
    the verdict says so and is never trusted alone (beside the zero-config fix above, which has no risk)."""
    repo = uv_project
    proj = fx.PROJECTS["python-uv"]
    res, rows = job(repo, tmp_path / "lock", f"{proj.edit.fix} && printf '# a newer lock\\n' >> uv.lock", "broken")
    assert res.status is Status.completed and res.tests_attempted[0].endswith("=> exit 0"), res
    assert res.needs_human_review is True
    venv = [r for r in res.known_risks if str(repo / ".venv") in r]
    assert len(venv) == 1 and "uv.lock" in venv[0], res.known_risks
    assert_uv_env(rows, repo)


def test_uv_run_with_zero_config(uv_make_project, tmp_path, monkeypatch):
    """`make test` running `uv run pytest`: in a checkout of its own with no network, uv builds a venv of
    its own there and syncs it from the index (the control: it fails). The job keeps uv on the main
    checkout's venv, offline and without syncing."""
    repo = uv_make_project
    proj = fx.PROJECTS["python-uv-make"]
    uv = fx.require(fx.uv_binary)
    monkeypatch.setenv("PATH", f"{Path(uv).parent}{os.pathsep}{os.environ['PATH']}")
    clone = tmp_path / "control"
    subprocess.run(["git", "clone", "-q", str(repo), str(clone)], check=True)
    naive = subprocess.run(["make", "test"], cwd=clone, capture_output=True, text=True,
                           env={**os.environ, "UV_OFFLINE": "1", "UV_CACHE_DIR": str(tmp_path / "empty-cache"),
                                "UV_PYTHON_DOWNLOADS": "never"})
    assert naive.returncode != 0 and (clone / ".venv").is_dir(), "control: uv run should have made its own venv"
    before = main_state(repo)

    res, rows = job(repo, tmp_path / "fix", proj.edit.fix, "broken")
    assert_fixed(res, rows)
    assert res.tests_attempted == ["make test => exit 0"], res.tests_attempted
    assert_uv_env(rows, repo)

    res, rows = job(repo, tmp_path / "break", proj.edit.breaks, "master")
    assert_broken(res, rows)
    assert res.tests_attempted[0].startswith("make test => exit "), res.tests_attempted
    assert failed_test_named(res, "tests/test_lru.py"), res.validation
    assert main_state(repo) == before


@pytest.fixture(scope="module")
def poetry_project(tmp_path_factory):
    """six as a poetry project, its venv where poetry keeps one (`{virtualenvs.path}/<name>-<hash>-pyX.Y`),
    here under the test's /tmp, which the sandbox does not show (bwrap gives it a private /tmp) unless the
    job environment names it."""
    root = tmp_path_factory.mktemp("eco-python-poetry")
    repo = fx.require(fx.make_repo, "python-poetry", root)
    venvs = root / "poetry-virtualenvs"
    minor = f"{sys.version_info.major}.{sys.version_info.minor}"
    venv = venvs / f"{poetry_env_name('six', repo)}-py{minor}"
    fx.require(fx.make_venv, venv, repo)
    return repo, venvs, venv


def test_poetry_venv_outside_the_checkout_with_zero_config(poetry_project, tmp_path, monkeypatch):
    repo, venvs, venv = poetry_project
    monkeypatch.setenv("POETRY_VIRTUALENVS_PATH", str(venvs))  # the developer's poetry setting, read from the host
    proj = fx.PROJECTS["python-poetry"]
    before = main_state(repo)

    res, rows = job(repo, tmp_path / "fix", proj.edit.fix, "broken")
    assert_fixed(res, rows)
    envrow = rows["job.environment"]
    assert envrow["python_env"]["venv"] == str(venv) and envrow["python_env"]["manager"] == "poetry", envrow
    assert_inside_validated_tree(probe_origins(rows, "python"), repo)

    res, rows = job(repo, tmp_path / "break", proj.edit.breaks, "master")
    assert_broken(res, rows)
    assert main_state(repo) == before

    # Control: where poetry would not find it, neither does the job, and it says what it looked for.
    monkeypatch.setenv("POETRY_VIRTUALENVS_PATH", str(tmp_path / "elsewhere"))
    res, rows = job(repo, tmp_path / "lost", proj.edit.fix, "broken")
    assert rows["job.environment"]["python_env"] is None
    lost = [r for r in res.known_risks if "uses poetry (poetry.lock)" in r]
    assert len(lost) == 1 and str(tmp_path / "elsewhere") in lost[0], res.known_risks
    assert res.needs_human_review is True


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
    assert {"HOME", "CARGO_NET_OFFLINE"} <= set(rows["job.environment"]["env"])

    res, rows = job(repo, tmp_path / "break", proj.edit.breaks, "master")
    assert_broken(res, rows)
    assert res.tests_attempted == ["cargo test => exit 101"]
    assert main_state(repo) == before  # target/ included: the job built in a checkout of its own
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


# A two-crate workspace whose build script writes a generated file into the workspace's target/ and whose
# code includes it from there: it builds where cargo builds by default, and only there (issue 24: with the
# target dir moved under the job's tmp, `setup = ["mkdir -p target"]` was needed).
WORKSPACE = {
    "Cargo.toml": '[workspace]\nmembers = ["units", "clock"]\nresolver = "2"\n',
    "units/Cargo.toml": '[package]\nname = "units"\nversion = "0.1.0"\nedition = "2021"\n',
    "units/build.rs": """use std::{env, fs, path::Path};

fn main() {
    // The workspace's target/, where cargo builds it by default: the generated table lives beside the build.
    let target = Path::new(&env::var("CARGO_MANIFEST_DIR").unwrap()).join("../target");
    fs::write(target.join("units.rs"), "pub const MILLIS_PER_SECOND: u64 = 1000;\\n")
        .expect("cannot write the workspace's target/units.rs");
    println!("cargo:rerun-if-changed=build.rs");
}
""",
    "units/src/lib.rs": 'include!(concat!(env!("CARGO_MANIFEST_DIR"), "/../target/units.rs"));\n',
    "clock/Cargo.toml": '[package]\nname = "clock"\nversion = "0.1.0"\nedition = "2021"\n\n'
                        '[dependencies]\nunits = { path = "../units" }\n',
    "clock/src/lib.rs": """pub fn millis(seconds: u64) -> u64 {
    seconds * units::MILLIS_PER_SECOND
}

#[cfg(test)]
mod tests {
    #[test]
    fn three_seconds_in_millis() {
        assert_eq!(super::millis(3), 3000);
    }
}
""",
}
WORKSPACE_BUG = ("seconds * units::MILLIS_PER_SECOND", "seconds + units::MILLIS_PER_SECOND")


@pytest.fixture(scope="module")
def rust_workspace(rust_project, tmp_path_factory):
    """master as written, `broken` with the bug. No .gitignore: nothing but the host keeps `target/` out of
    the job's tree and the review checkout."""
    _, env = rust_project
    repo = tmp_path_factory.mktemp("eco-rust-ws") / "ws"
    for rel, text in WORKSPACE.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    subprocess.run(["cargo", "generate-lockfile", "--offline"], cwd=repo, env={**os.environ, **env}, check=True,
                   capture_output=True)
    for argv in (["init", "-q", "-b", "master"], ["add", "-A"], ["commit", "-qm", "a two-crate workspace"],
                 ["checkout", "-q", "-b", "broken"]):
        subprocess.run([*fx.GIT, *argv], cwd=repo, check=True, capture_output=True)
    lib = repo / "clock/src/lib.rs"
    lib.write_text(lib.read_text().replace(*WORKSPACE_BUG))
    for argv in (["commit", "-qam", "a bug"], ["checkout", "-q", "master"]):
        subprocess.run([*fx.GIT, *argv], cwd=repo, check=True, capture_output=True)
    return repo, env


def test_rust_workspace_build_script_writing_into_target(rust_workspace, tmp_path, monkeypatch):
    repo, env = rust_workspace
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    # Control: the same checkout built with the target dir elsewhere (as validation did before) fails in the
    # build script, and builds where cargo puts it by default.
    clone = tmp_path / "control"
    subprocess.run(["git", "clone", "-q", str(repo), str(clone)], check=True)
    moved = subprocess.run(["cargo", "test", "--offline", "-q"], cwd=clone, capture_output=True, text=True,
                           env={**os.environ, "CARGO_TARGET_DIR": str(tmp_path / "elsewhere")})
    assert moved.returncode != 0 and "target/units.rs" in moved.stderr, moved.stderr[-2000:]
    before = main_state(repo)
    edit = fx.Edit("clock/src/lib.rs", *WORKSPACE_BUG)

    res, rows = job(repo, tmp_path / "fix", edit.fix, "broken")
    assert_fixed(res, rows)
    assert res.tests_attempted == ["cargo test => exit 0"]
    assert res.changed_files == ["clock/src/lib.rs"]
    assert "CARGO_TARGET_DIR" not in rows["job.environment"]["env"]  # cargo's default, in the job's checkout
    # Validation built in the job's own checkout; what a person reviews is the job's commit, nothing more.
    review = Path(res.worktree_path)
    assert not (review / "target").exists()
    assert _git(review, "status", "--porcelain", "--ignored") == ""

    res, rows = job(repo, tmp_path / "break", edit.breaks, "master")
    assert_broken(res, rows)
    assert res.tests_attempted == ["cargo test => exit 101"]
    assert failed_test_named(res, "three_seconds_in_millis"), res.validation
    assert not (Path(res.worktree_path) / "target").exists()
    assert main_state(repo) == before


# -- go: a vendored module (issue 24: validation has no network, so only vendor/ can supply its dependency) ----

# A module whose go.mod predates go 1.14, so go does not turn vendoring on by itself: its dependency is found
# in vendor/ only with -mod=vendor, which validation's autodetection adds when vendor/modules.txt is there.
GO_MODULE = {
    "go.mod": "module example.com/clock\n\ngo 1.13\n\nrequire example.com/units v1.0.0\n",
    "vendor/modules.txt": "# example.com/units v1.0.0\nexample.com/units\n",
    "vendor/example.com/units/units.go": "// Package units: time units.\npackage units\n\n"
                                         "// MillisPerSecond is a second in milliseconds.\n"
                                         "const MillisPerSecond = 1000\n",
    "clock.go": "package clock\n\nimport \"example.com/units\"\n\n"
                "// Millis converts seconds to milliseconds.\n"
                "func Millis(seconds uint64) uint64 {\n\treturn seconds * units.MillisPerSecond\n}\n",
    "clock_test.go": "package clock\n\nimport \"testing\"\n\n"
                     "func TestThreeSecondsInMillis(t *testing.T) {\n"
                     "\tif got := Millis(3); got != 3000 {\n\t\tt.Fatalf(\"Millis(3) = %d, want 3000\", got)\n\t}\n}\n",
}
GO_BUG = ("seconds * units.MillisPerSecond", "seconds + units.MillisPerSecond")


@pytest.fixture(scope="module")
def go_module(tmp_path_factory):
    env = fx.require(fx.go_env)
    repo = tmp_path_factory.mktemp("eco-go") / "clock"
    for rel, text in GO_MODULE.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    for argv in (["init", "-q", "-b", "master"], ["add", "-A"], ["commit", "-qm", "a vendored module"],
                 ["checkout", "-q", "-b", "broken"]):
        subprocess.run([*fx.GIT, *argv], cwd=repo, check=True, capture_output=True)
    (repo / "clock.go").write_text((repo / "clock.go").read_text().replace(*GO_BUG))
    for argv in (["commit", "-qam", "a bug"], ["checkout", "-q", "master"]):
        subprocess.run([*fx.GIT, *argv], cwd=repo, check=True, capture_output=True)
    return repo, env


def test_go_vendored_module_with_zero_config(go_module, tmp_path):
    repo, env = go_module
    # Control: without -mod=vendor and with no network (validation's), go cannot find the dependency.
    clone = tmp_path / "control"
    subprocess.run(["git", "clone", "-q", str(repo), str(clone)], check=True)
    plain = subprocess.run(["go", "test", "./..."], cwd=clone, capture_output=True, text=True,
                           env={**os.environ, **env, "GOPROXY": "off", "GOFLAGS": "",
                                "GOCACHE": str(tmp_path / "gocache"), "GOPATH": str(tmp_path / "gopath")})
    assert plain.returncode != 0 and "example.com/units" in plain.stderr, plain.stderr[-2000:]
    before = main_state(repo)
    edit = fx.Edit("clock.go", *GO_BUG)

    res, rows = job(repo, tmp_path / "fix", edit.fix, "broken")
    assert_fixed(res, rows)
    assert res.tests_attempted == ["go test -mod=vendor ./... => exit 0"], res.tests_attempted
    assert {"GOCACHE", "GOPROXY"} <= set(rows["job.environment"]["env"])

    res, rows = job(repo, tmp_path / "break", edit.breaks, "master")
    assert_broken(res, rows)
    assert res.tests_attempted == ["go test -mod=vendor ./... => exit 1"], res.tests_attempted
    assert failed_test_named(res, "TestThreeSecondsInMillis"), res.validation
    assert main_state(repo) == before


def test_go_vendored_module_run_by_a_configured_plain_go_test(go_module, tmp_path):
    """Issue 38's case: `go test -mod=vendor ./...` configured, plain go test output (not -json), was read as
    TAP and failed the honest fix. The runner is told from the command (`go test`), and its per-test lines
    asked for through the environment (GOFLAGS=-v reaches a go test a script runs): the fix completes with no
    risk, the break fails naming the test."""
    repo, _ = go_module
    edit = fx.Edit("clock.go", *GO_BUG)
    line = f'[repos."{repo}"]\nvalidate = "go test -mod=vendor ./..."\n'

    def configured(where: Path, script: str, branch: str):
        return sh_job(repo, where, script, branch, extra=line)

    res, rows = configured(tmp_path / "fix", edit.fix, "broken")
    assert_fixed(res, rows)
    assert res.baseline["steps"][0]["evidence"] == ["go"] and res.baseline["steps"][0]["runners"] == ["go test"]
    assert res.validation[-1]["compared"]["fixed"] == ["example.com/clock TestThreeSecondsInMillis"]
    res, rows = configured(tmp_path / "break", edit.breaks, "master")
    assert_broken(res, rows)
    assert res.validation[-1]["compared"]["broken"] == ["example.com/clock TestThreeSecondsInMillis"]


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
    risks, _ = judge(jenv, "node", out)
    assert len(risks) == 1 and stale in risks[0]
    py = f"PROCTOR-PROBE {json.dumps({'p': {'origin': str(tree / 'node_modules/p/__init__.py')}})}".encode()
    assert judge(jenv, "python", py)[0]


# -- the repo's Python environment, found as its manager finds it (no manager is run) -------------------------

def fake_venv(where: Path, base: Path | None = None) -> Path:
    """A venv's marks (bin/python, pyvenv.cfg naming the Python it was made from), not a working venv."""
    (where / "bin").mkdir(parents=True)
    (where / "bin" / "python").symlink_to(os.path.realpath(sys.executable))
    (where / "pyvenv.cfg").write_text(f"home = {base or Path(os.path.realpath(sys.executable)).parent}\n")
    return where


def project(root: Path, pyproject: str, *files: str) -> Path:
    root.mkdir(parents=True)
    (root / "pyproject.toml").write_text(pyproject)
    for f in files:
        (root / f).write_text("")
    return root


def test_the_managers_names_for_a_project_dir_are_the_tools_own():
    """Known answers from the tools themselves (poetry 2.5.1 `poetry env use`, hatch 1.18.2 `hatch env
    find`), for these exact paths: the hash is of the project dir's path, so only a fixed path can be checked."""
    assert poetry_env_name("My.Demo_proj", Path("/tmp/eco24/pp/My.Demo_proj")) == "my-demo-proj-oYsyJL5u"
    home = Path("/tmp/eco24/fakehome")
    assert hatch_env_path(home / ".local/share/hatch/env/virtual", "Hatch_Demo.x",
                          Path("/tmp/eco24/hp/Hatch_Demo.x"), home) == \
        home / ".local/share/hatch/env/virtual/hatch-demo-x/yCCWMTxl/hatch-demo-x"
    # Beside them, what differs: another dir, another name.
    assert poetry_env_name("My.Demo_proj", Path("/tmp/eco24/pp/other")) != "my-demo-proj-oYsyJL5u"


def test_python_env_per_manager(tmp_path):
    home = tmp_path / "home"
    # uv: the in-project .venv, and the switches that keep `uv run` on it
    uv = project(tmp_path / "uv", '[project]\nname = "a"\n', "uv.lock")
    fake_venv(uv / ".venv")
    found, why = python_env(uv, {}, home)
    assert found and found.manager == "uv" and found.venv == uv / ".venv" and why is None
    assert dict(found.env)["UV_PROJECT_ENVIRONMENT"] == str(uv / ".venv") and dict(found.env)["UV_NO_SYNC"] == "1"
    # ... or where UV_PROJECT_ENVIRONMENT says (relative to the project)
    fake_venv(uv / "envs" / "dev")
    found, _ = python_env(uv, {"UV_PROJECT_ENVIRONMENT": "envs/dev"}, home)
    assert found.venv == uv / "envs" / "dev"
    # poetry: in-project first; with in-project = false (poetry.toml), the cache venv envs.toml names
    po = project(tmp_path / "po", '[tool.poetry]\nname = "My_Pkg"\n', "poetry.lock")
    fake_venv(po / ".venv")
    assert python_env(po, {}, home)[0].venv == po / ".venv"
    (po / "poetry.toml").write_text("[virtualenvs]\nin-project = false\n")
    venvs = home / ".cache" / "pypoetry" / "virtualenvs"
    base = poetry_env_name("My_Pkg", po)
    fake_venv(venvs / f"{base}-py3.10")
    fake_venv(venvs / f"{base}-py3.11")
    found, why = python_env(po, {}, home)  # two, and nothing to say which: neither
    assert "envs.toml names none" in why, why
    assert found.manager is None and found.venv == po / ".venv"  # the plain .venv, the risk saying why
    shutil.rmtree(po / ".venv")
    assert python_env(po, {}, home)[0] is None
    (venvs / "envs.toml").write_text(f'[{base}]\nminor = "3.11"\npatch = "3.11.7"\n')
    assert python_env(po, {}, home)[0].venv == venvs / f"{base}-py3.11"
    # pdm: the interpreter `pdm use` recorded
    pd = project(tmp_path / "pd", '[project]\nname = "p"\n', "pdm.lock")
    elsewhere = fake_venv(tmp_path / "pdm-venv")
    (pd / ".pdm-python").write_text(f"{elsewhere}/bin/python\n")
    found, _ = python_env(pd, {}, home)
    assert found.venv == elsewhere and dict(found.env)["PDM_PYTHON"] == str(elsewhere / "bin" / "python")
    # hatch: the default environment's venv under hatch's data dir
    ha = project(tmp_path / "ha", '[project]\nname = "H"\n[tool.hatch.envs.default]\ndependencies = []\n')
    target = hatch_env_path(home / ".local/share/hatch/env/virtual", "H", ha, home)
    assert python_env(ha, {}, home)[0] is None
    fake_venv(target)
    assert python_env(ha, {}, home)[0].venv == target
    # No manager: a plain .venv; a hatchling build backend alone names none
    plain = project(tmp_path / "plain", '[build-system]\nbuild-backend = "hatchling.build"\n')
    assert python_env(plain, {}, home) == (None, None)
    fake_venv(plain / ".venv")
    found, why = python_env(plain, {}, home)
    assert found.manager is None and found.venv == plain / ".venv" and why is None


def test_a_venv_outside_the_checkout_is_shown_to_the_sandbox(tmp_path):
    """prepare() names a venv outside the main checkout (poetry's, hatch's) and the Python it was made from
    among the read-only roots: the sandbox hides the user's home and /tmp otherwise."""
    main = project(tmp_path / "main", '[tool.poetry]\nname = "m"\n', "poetry.lock", "m.py")
    tree = project(tmp_path / "tree", '[tool.poetry]\nname = "m"\n', "poetry.lock", "m.py")
    venvs = tmp_path / "venvs"
    python = tmp_path / "home" / ".pyenv" / "versions" / "3.11.7"  # a Python installed under the hidden home
    (python / "bin").mkdir(parents=True)
    venv = fake_venv(venvs / f"{poetry_env_name('m', main)}-py3.11", python / "bin")
    jenv = environment.prepare(tree, main, validate.detect(tree), tmp=tmp_path / "t",
                               env={"HOME": str(tmp_path / "jobhome"), "PATH": "/usr/bin"},
                               host={"HOME": str(tmp_path / "home"), "POETRY_VIRTUALENVS_PATH": str(venvs)})
    assert jenv.python_env is not None and jenv.python_env.venv == venv
    assert venv in jenv.readonly and python in jenv.readonly
    assert jenv.env["VIRTUAL_ENV"] == str(venv) and jenv.env["PATH"].startswith(f"{venv / 'bin'}:")
    assert jenv.risks == ()
    # The lockfile rule: the tree's poetry.lock differs from the one the venv was installed for.
    (tree / "poetry.lock").write_text("changed\n")
    jenv = environment.prepare(tree, main, validate.detect(tree), tmp=tmp_path / "t",
                               env={"HOME": str(tmp_path / "jobhome"), "PATH": "/usr/bin"},
                               host={"HOME": str(tmp_path / "home"), "POETRY_VIRTUALENVS_PATH": str(venvs)})
    assert len(jenv.risks) == 1 and "poetry.lock" in jenv.risks[0] and str(venv) in jenv.risks[0]


def test_cargo_builds_where_cargo_builds_by_default(tmp_path):
    tree, cargo_home = tmp_path / "tree", tmp_path / "cargo-home"
    (tree / ".cargo").mkdir(parents=True)
    cargo_home.mkdir()
    (tree / "Cargo.toml").write_text('[package]\nname = "x"\nversion = "0.1.0"\n')
    assert environment.cargo_target(tree, {}, cargo_home) is None  # cargo's own: the workspace's target/
    # A target dir of the user's (a shared one, which validation cannot write) gives way to the checkout's.
    assert environment.cargo_target(tree, {"CARGO_TARGET_DIR": "/var/tmp/shared"}, cargo_home) == tree / "target"
    (cargo_home / "config.toml").write_text('[build]\ntarget-dir = "/var/tmp/shared"\n')
    assert environment.cargo_target(tree, {}, cargo_home) == tree / "target"
    # The repo's own setting is cargo's to apply (it beats CARGO_HOME's) while it stays in the checkout.
    (tree / ".cargo" / "config.toml").write_text('[build]\ntarget-dir = "out/build"\n')
    assert environment.cargo_target(tree, {}, cargo_home) is None
    assert environment.cargo_target(tree, {"CARGO_TARGET_DIR": "/x"}, cargo_home) == tree / "out" / "build"
    for outside in ("/var/tmp/shared", "../escape", "."):
        (tree / ".cargo" / "config.toml").write_text(f'[build]\ntarget-dir = "{outside}"\n')
        assert environment.cargo_target(tree, {}, cargo_home) == tree / "target", outside
    jenv = environment.prepare(tree, tmp_path, validate.detect(tree), tmp=tmp_path / "t",
                               env={"HOME": str(tmp_path / "jobhome"), "CARGO_HOME": str(cargo_home)})
    assert jenv.env["CARGO_TARGET_DIR"] == str(tree / "target")
    (tree / ".cargo" / "config.toml").unlink()
    (cargo_home / "config.toml").unlink()
    jenv = environment.prepare(tree, tmp_path, validate.detect(tree), tmp=tmp_path / "t",
                               env={"HOME": str(tmp_path / "jobhome"), "CARGO_HOME": str(cargo_home)})
    assert "CARGO_TARGET_DIR" not in jenv.env
    # Setup before the agent runs in the agent's worktree, whose content is the job's diff: its build goes
    # to the job's tmp.
    shared, dirs = environment.setup_env(jenv, network=False)
    target = Path(shared["CARGO_TARGET_DIR"])
    assert target == tmp_path / "t" / "cargo-target" and target in dirs
