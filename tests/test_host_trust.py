"""Host-side trust: nothing a confined agent writes runs on the host, changes the main repo, or makes the
verdict lie (issue 9). Real git, real processes, confined agents.

Every attack has a control: the same script run in a plain clone, then the naive host's step run there
(a plain `git status`, `git add`, the runner), shows the attack works against a host that trusts the
agent's directory. The marker a planted program would write must stay absent after proctor's job and
after a reviewer's plain `git status` in the job's worktree; the main repo must be unchanged.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import make_repo, sh
from proctor import RunAgentRequest, Status, run_agent
from proctor.mechanisms.config.load import load_config
from proctor.mechanisms.confine import detect
from proctor.contract import Code

CAPS = detect()
CONFINED = CAPS.bwrap is not None or CAPS.landlock
if not CONFINED and os.environ.get("CI") == "true":
    pytest.fail("CI must have bwrap or Landlock for the host-trust tests", pytrace=False)
needs_confinement = pytest.mark.skipif(not CONFINED, reason="this kernel gives neither bubblewrap nor Landlock")
GIT_ID = "git -c user.email=a@b -c user.name=a"



def agent(tmp_path: Path, script: str, confine: str = "required") -> object:
    p = tmp_path / f"agent-{confine}.toml"
    p.write_text(f'confine = "{confine}"\n[agents.sh]\ncommand = ["/bin/sh", "-c", {json.dumps(script)}]\n'
                 'prompt = "stdin"\nnetwork = false\n')
    return load_config(p)


def job(repo: Path, tmp_path: Path, script: str, confine: str = "required", **kw):
    req = RunAgentRequest(agent="sh", task="t", repo=str(repo), ticket="T", **kw)
    return run_agent(req, config=agent(tmp_path, script, confine))


# PY_REPO's test fails on the base: the task is to fix it (SWE-bench's FAIL_TO_PASS). Without naming it, a
# job that leaves it failing is pre-existing, not the job's failure (README "What the verdict rests on").
MUST = {"mustPass": ["test_calc.py::test_add"]}


def main_state(repo: Path) -> tuple:
    """Refs, every object file's bytes and the checkout's status: what must not change through a job."""
    objects = {}
    for p in sorted((repo / ".git" / "objects").rglob("*")):
        if p.is_file():
            objects[str(p.relative_to(repo))] = p.read_bytes()
    return (sh("git", "for-each-ref", cwd=repo), objects, sh("git", "status", "--porcelain", cwd=repo),
            sh("git", "worktree", "list", "--porcelain", cwd=repo))


def assert_main_unchanged(repo: Path, before: tuple) -> None:
    assert main_state(repo) == before, "the main repo changed"
    subprocess.run(["git", "fsck", "--full", "--strict", "--no-dangling"], cwd=repo, check=True, capture_output=True)


def control(repo: Path, tmp_path: Path, script: str) -> Path:
    """The same script in a plain clone, unconfined: the state a naive host would then inspect."""
    clone = tmp_path / "control"
    sh("git", "clone", "-q", "--no-hardlinks", str(repo), str(clone))
    # The script's scratch files in the test's own dir, not the /tmp every worker shares.
    subprocess.run(["/bin/sh", "-c", script], cwd=clone, check=True, capture_output=True,
                   env={**os.environ, "TMPDIR": str(tmp_path)})
    return clone


def reviewer_status(worktree: str) -> None:
    """A person's plain `git status` in the job's worktree, with their own git config."""
    subprocess.run(["git", "status"], cwd=worktree, capture_output=True, timeout=30)


def branch_holds_exactly(res) -> None:
    wt = Path(res.worktree_path)
    listed = sh("git", "diff", "--name-only", "--no-renames", f"{res.commit}~1", res.branch, cwd=wt).split("\n")
    assert sorted(p for p in listed if p) == sorted(res.changed_files)
    assert sh("git", "rev-parse", res.branch, cwd=wt).strip() == res.commit


# -- 1. host-side git runs nothing the agent planted -----------------------------------------------------

@needs_confinement
def test_worktree_config_filter_never_runs_on_the_host_or_the_reviewer(tmp_path):
    repo = make_repo(tmp_path, {"README.md": "hello\n"})
    sh("git", "sparse-checkout", "init", cwd=repo)  # leaves extensions.worktreeConfig behind, as in review
    sh("git", "sparse-checkout", "disable", cwd=repo)
    marker = tmp_path / "filter-ran"
    script = f"""set -e
git config extensions.worktreeConfig true
git config --worktree filter.x.clean 'test -e .armed && touch {marker}; cat'
git config --worktree core.fsmonitor 'test -e .armed && touch {marker}; false'
echo '* filter=x' > .gitattributes; echo changed > README.md; touch .armed"""
    clone = control(repo, tmp_path, script)
    sh("git", "status", "--porcelain", cwd=clone)
    assert marker.exists(), "control: plain git ran the planted filter"
    marker.unlink()

    before = main_state(repo)
    res = job(repo, tmp_path, script, validateCommand="true")
    assert res.status is Status.completed and "README.md" in res.changed_files, res
    assert not marker.exists(), "host-side git ran the agent's filter"
    reviewer_status(res.worktree_path)
    assert not marker.exists(), "a reviewer's git status ran the agent's filter"
    branch_holds_exactly(res)
    assert_main_unchanged(repo, before)


def _repo_with_submodule(tmp_path: Path) -> Path:
    sub = make_repo(tmp_path / "subsrc", {"lib.txt": "lib\n"})
    repo = make_repo(tmp_path, {"README.md": "hello\n"})
    sh("git", "-c", "protocol.file.allow=always", "submodule", "add", "-q", str(sub), "sm", cwd=repo)
    sh("git", "commit", "-qm", "submodule", cwd=repo)
    return repo


@needs_confinement
def test_planted_repo_at_a_submodule_path_is_never_entered(tmp_path):
    repo = _repo_with_submodule(tmp_path)
    marker = tmp_path / "submodule-filter-ran"
    script = f"""set -e
printf '[submodule "sm"]\\n\\tpath = sm\\n\\turl = ./x\\n\\tignore = none\\n' > .gitmodules
rm -rf sm && git init -q sm && cd sm
git config filter.x.clean 'test -e ../.armed && touch {marker}; cat'
git config core.fsmonitor 'test -e ../.armed && touch {marker}; false'
echo '* filter=x' > .gitattributes && echo one > f && git add -A && {GIT_ID} commit -qm s && echo two > f
cd .. && git add sm && touch .armed"""
    clone = control(repo, tmp_path, script)
    sh("git", "-c", "diff.ignoreSubmodules=dirty", "status", "--porcelain", cwd=clone)
    assert marker.exists(), "control: .gitmodules ignore=none beat the -c override and git entered the repo"
    marker.unlink()

    before = main_state(repo)
    base_link = sh("git", "rev-parse", "HEAD:sm", cwd=repo)
    res = job(repo, tmp_path, script, validateCommand="true")
    assert not marker.exists(), "host-side git entered the planted repo"
    assert any("nested git repositories: sm" in r for r in res.known_risks), res.known_risks
    wt = Path(res.worktree_path)
    assert sh("git", "rev-parse", f"{res.branch}:sm", cwd=wt) == base_link, "the submodule pointer moved"
    reviewer_status(res.worktree_path)
    assert not marker.exists(), "a reviewer's git status entered the planted repo"
    assert ".gitmodules" in res.changed_files and res.needs_human_review
    branch_holds_exactly(res)
    assert_main_unchanged(repo, before)


# -- 2. the worktree is safe to review ----------------------------------------------------------------------

@needs_confinement
@pytest.mark.parametrize("trick", ["gitlink", "pointer"])
def test_review_checkout_holds_nothing_the_agent_planted(tmp_path, trick):
    repo = make_repo(tmp_path, {"README.md": "hello\n"})
    marker = tmp_path / f"review-{trick}"
    if trick == "gitlink":
        # A nested repo with an fsmonitor, recorded as a gitlink in the agent's own index.
        script = f"""set -e
git init -q inner && cd inner && git config core.fsmonitor 'touch {marker}; false'
echo x > f && git add f && {GIT_ID} commit -qm i && cd .. && git add inner && echo e > README.md"""
    else:
        # The worktree's `.git` replaced by a pointer to a git dir whose config runs a program.
        script = f"""set -e
cp -r .git evil.git && git --git-dir=evil.git config core.fsmonitor 'touch {marker}; false'
rm -rf .git && echo "gitdir: $PWD/evil.git" > .git && echo e > README.md"""
    clone = control(repo, tmp_path, script)
    sh("git", "status", "--porcelain", cwd=clone)
    assert marker.exists(), f"control: plain git status ran the planted {trick}"
    marker.unlink()

    res = job(repo, tmp_path, script, validateCommand="true")
    assert res.status is Status.completed and "README.md" in res.changed_files, res
    wt = Path(res.worktree_path)
    assert (wt / ".git").is_dir() and not (wt / "evil.git").exists() and not (wt / "inner").exists()
    reviewer_status(res.worktree_path)
    assert not marker.exists(), "a reviewer's git status ran agent code"
    assert sh("git", "status", "--porcelain", cwd=wt) == ""


# -- 3. the main repo's object store and refs ---------------------------------------------------------------

def _rewrite_blob_script(repo: Path, path: str, packed: bool) -> str:
    """Replace, in place, the bytes behind master's `path` with another blob's (under the old name)."""
    blob = sh("git", "rev-parse", f"master:{path}", cwd=repo).strip()
    if packed:
        pack = next((repo / ".git/objects/pack").glob("*.pack"))
        return (f"chmod u+w {pack} 2>/dev/null; printf 'PACK-CORRUPTED' | dd of={pack} bs=1 seek=40 conv=notrunc "
                f"2>/dev/null; rm -f {repo}/.git/objects/pack/*.idx; echo x > touched.txt; true")
    obj = repo / ".git/objects" / blob[:2] / blob[2:]
    evil = "import calc\\n\\ndef test_add():\\n    assert True\\n"
    return (f"printf '{evil}' > \"${{TMPDIR:-/tmp}}/evil.txt\"; new=$(git hash-object -w \"${{TMPDIR:-/tmp}}/evil.txt\"); "
            f"src=.git/objects/$(echo $new | cut -c1-2)/$(echo $new | cut -c3-); "
            f"chmod u+w {obj} 2>/dev/null; cp $src {obj}; rm -f {repo}/.git/objects/??/* 2>/dev/null; "
            "echo x > touched.txt; true")


PY_REPO = {"pyproject.toml": "[project]\nname = 'calc'\nversion = '0'\n",
           "calc.py": "def add(a, b):\n    return a - b\n",
           "test_calc.py": "import calc\n\ndef test_add():\n    assert calc.add(2, 2) == 4\n"}


@needs_confinement
@pytest.mark.parametrize("packed", [False, True], ids=["loose", "packed"])
def test_agent_cannot_rewrite_or_delete_the_main_repos_objects(tmp_path, packed):
    repo = make_repo(tmp_path, dict(PY_REPO))
    if packed:
        sh("git", "gc", "-q", "--aggressive", cwd=repo)
    script = _rewrite_blob_script(repo, "test_calc.py", packed)
    before = main_state(repo)
    res = job(repo, tmp_path, script, **MUST)
    assert_main_unchanged(repo, before)
    # The base's failing test still fails: nothing the agent did reached what validation checked out.
    assert res.status is Status.failed and res.code is Code.VALIDATION_FAILED, res

    # control: unconfined, the same script does corrupt the main store (fsck sees it)
    res = job(repo, tmp_path, script, confine="off")
    fsck = subprocess.run(["git", "fsck", "--full", "--strict"], cwd=repo, capture_output=True)
    assert fsck.returncode != 0 or main_state(repo)[1] != before[1], "control: unconfined the store was unchanged"


@needs_confinement
def test_a_forged_object_in_the_agents_own_store_never_reaches_validation(tmp_path):
    repo = make_repo(tmp_path, dict(PY_REPO))
    blob = sh("git", "rev-parse", "master:test_calc.py", cwd=repo).strip()
    # The agent stores a passing test under the name of the base's failing one, in its own store (first in
    # its lookup order), and leaves the file itself as it was.
    script = (f"printf 'def test_add():\\n    assert True\\n' > \"${{TMPDIR:-/tmp}}/p.txt\"; new=$(git hash-object -w \"${{TMPDIR:-/tmp}}/p.txt\"); "
              f"mkdir -p .git/objects/{blob[:2]}; "
              f"cp .git/objects/$(echo $new | cut -c1-2)/$(echo $new | cut -c3-) .git/objects/{blob[:2]}/{blob[2:]}; "
              "echo note > notes.txt")
    clone = control(repo, tmp_path, script)
    (clone / "test_calc.py").unlink()
    sh("git", "checkout", "--", "test_calc.py", cwd=clone)
    assert "assert True" in (clone / "test_calc.py").read_text(), "control: a checkout from the agent's store is forged"

    res = job(repo, tmp_path, script, **MUST)
    assert res.status is Status.failed and res.code is Code.VALIDATION_FAILED, res
    assert "assert calc.add" in (Path(res.worktree_path) / "test_calc.py").read_text()


# -- 4. the verdict -----------------------------------------------------------------------------------------

@needs_confinement
def test_branch_and_head_tricks_cannot_hide_a_file_from_changed_files(tmp_path):
    repo = make_repo(tmp_path, {"README.md": "hello\n"})
    script = f"""set -e
b=$(git symbolic-ref --short HEAD)
echo s > secret.txt && git add secret.txt && {GIT_ID} commit -qm s
git checkout -q -b "$b-sibling" && git update-ref "refs/heads/$b" HEAD~1 && echo w > worktree-only.txt"""
    res = job(repo, tmp_path, script, validateCommand="true")
    assert res.status is Status.completed
    assert sorted(res.changed_files) == ["secret.txt", "worktree-only.txt"], res.changed_files
    branch_holds_exactly(res)


@needs_confinement
def test_same_size_rewrite_within_the_second_is_listed(tmp_path):
    repo = make_repo(tmp_path, dict(PY_REPO))
    # Rewrite in place, same size, and put the checkout's mtime back: only content can tell.
    script = ("m=$(stat -c %y calc.py); printf 'def add(a, b):\\n    return a + b\\n' > calc.py; "
              "touch -d \"$m\" calc.py")
    clone = control(repo, tmp_path, "true")
    time.sleep(1.1)  # past the checkout's second, so the refreshed index holds trusted (non-racy) stat data
    sh("git", "update-index", "--refresh", cwd=clone)
    index_copy = tmp_path / "index-copy"
    index_copy.write_bytes((clone / ".git/index").read_bytes())
    subprocess.run(["/bin/sh", "-c", script], cwd=clone, check=True)
    naive = subprocess.run(["git", "-c", "core.trustctime=false", "status", "--porcelain"], cwd=clone,
                           env={**os.environ, "GIT_INDEX_FILE": str(index_copy)}, capture_output=True, text=True)
    assert "calc.py" not in naive.stdout, "control: stat data hides the rewrite from a copied index"

    res = job(repo, tmp_path, script)
    assert res.changed_files == ["calc.py"] and res.agent_changed_files == ["calc.py"], res
    assert res.status is Status.completed and not res.needs_human_review, res


@needs_confinement
def test_ignored_shadow_of_the_test_runner_never_reaches_validation(tmp_path):
    repo = make_repo(tmp_path, dict(PY_REPO))
    script = ("mkdir pytest && printf 'import sys; sys.exit(0)\\n' > pytest/__main__.py && "
              "touch pytest/__init__.py && printf '*\\n' > pytest/.gitignore && echo '# fixed' >> README.md")
    clone = control(repo, tmp_path, script)
    shadowed = subprocess.run([sys.executable, "-m", "pytest", "-q"], cwd=clone, capture_output=True)
    assert shadowed.returncode == 0, "control: the hidden package replaces the runner in the agent's directory"

    res = job(repo, tmp_path, script, **MUST)
    assert res.changed_files == ["README.md"], res.changed_files
    assert res.status is Status.failed and res.code is Code.VALIDATION_FAILED, res


@needs_confinement
@pytest.mark.parametrize("name,content", [
    ("GNUmakefile", "test:\n\ttrue\n"),
    (".pytest.ini", "[pytest]\naddopts = --collect-only\n"),
    ("test_calc.py", "import calc\n\ndef test_add():\n    assert calc.add(2, 2) in (0, 4)\n"),
    ("pytest.py", "import sys\nsys.exit(0)\n"),
])
def test_changed_test_definitions_are_a_risk_and_the_base_tests_still_run(tmp_path, name, content):
    files = {**PY_REPO, "Makefile": f"test:\n\t{sys.executable} -m pytest -q\n"}
    repo = make_repo(tmp_path, files)
    script = f"printf %s {shlex.quote(content)} > {name}"
    res = job(repo, tmp_path, script, validateCommand="make test", **MUST)
    assert name in res.changed_files
    assert any("define the tests" in r and name in r for r in res.known_risks), res.known_risks
    # The base's test files against the agent's code: the unfixed bug fails there; or the first run
    # already failed: the runner's own evidence (`--collect-only` ran no test it collected), or the base's
    # recipe (a GNUmakefile is the recipe: the first run already used the base's, without it).
    if res.code is Code.VALIDATION_FAILED:
        assert any("the evidence says failed" in t or "exit 0" not in t for t in res.tests_attempted), \
            res.tests_attempted
    else:
        assert any("(with the base's test files)" in t and "exit 0" not in t for t in res.tests_attempted), \
            res.tests_attempted
        assert any("validation failed (with the base's test files)" in r for r in res.known_risks), res.known_risks
    assert res.needs_human_review


@needs_confinement
def test_an_honest_fix_with_a_new_test_passes_the_base_tests_too(tmp_path):
    repo = make_repo(tmp_path, dict(PY_REPO))
    script = ("printf 'def add(a, b):\\n    return a + b\\n' > calc.py && "
              "printf 'import calc\\n\\ndef test_more():\\n    assert calc.add(1, 1) == 2\\n' > test_more.py")
    res = job(repo, tmp_path, script)
    assert res.status is Status.completed and sorted(res.changed_files) == ["calc.py", "test_more.py"]
    assert res.tests_attempted == ["python -m pytest => exit 0", "python -m pytest => exit 0 (with the base's test files)"]
    assert res.known_risks == ["the agent changed files that define the tests: test_more.py"]


# -- 5. special files ---------------------------------------------------------------------------------------

@needs_confinement
@pytest.mark.parametrize("where", ["fifo", ".gitattributes", ".gitignore", "sub/.git/HEAD", ".git/HEAD"])
def test_a_fifo_never_hangs_the_host(tmp_path, where):
    repo = make_repo(tmp_path, {"README.md": "hello\n"})
    script = (f"mkdir -p $(dirname {where}); rm -rf {where}; mkfifo {where}; "
              "echo e > README.md; true")
    if where == ".gitattributes":
        clone = control(repo, tmp_path, script)
        hung = subprocess.run(["timeout", "3", "git", "add", "-A"], cwd=clone, capture_output=True)
        assert hung.returncode == 124, "control: git hangs on a FIFO .gitattributes"
    before = main_state(repo)
    # Never hangs: the job returns at all (a hung host never would), in a thread so that a hang is this
    # test's failure, named, within a bound generous for a loaded machine, rather than pytest-timeout's.
    # How long the job takes is not asserted (issue 24).
    done: list = []
    runner = threading.Thread(target=lambda: done.append(job(repo, tmp_path, script, validateCommand="true")),
                              daemon=True)
    runner.start()
    runner.join(240)
    assert done, f"the host hung on a FIFO at {where}"
    res = done[0]
    if where == ".git/HEAD":
        # The agent's own git dir is never read: nothing to report, nothing hangs.
        assert res.status is Status.completed and res.changed_files == ["README.md"], res
    elif where == "sub/.git/HEAD":
        # A nested repo is never entered: left out, and said so.
        assert res.status is Status.completed and res.changed_files == ["README.md"], res
        assert any("nested git repositories: sub" in r for r in res.known_risks) and res.needs_human_review
    else:
        assert res.status is Status.failed and res.code is Code.TAMPERED, res
        assert res.needs_human_review and "README.md" in res.changed_files
    assert_main_unchanged(repo, before)
    subprocess.run(["git", "worktree", "list"], cwd=repo, check=True, timeout=10, capture_output=True)


# -- beyond the twelve: the version probe ----------------------------------------------------------------

@needs_confinement
def test_version_probe_runs_confined_what_a_job_rewrote_in_its_state_dir(tmp_path, monkeypatch):
    repo = make_repo(tmp_path, {"README.md": "hello\n"})
    state = Path(os.environ["HOME"]) / ".fakecli"
    (state / "bin").mkdir(parents=True)
    exe = state / "bin" / "fakecli"
    marker = Path(os.environ["HOME"]).parent / "probe-ran-unconfined"  # outside every root of the job
    evil = f"#!/bin/sh\necho pwned > {marker}\necho 6.6.6\n"
    exe.write_text(f"#!/bin/sh\n[ \"$1\" = --version ] && {{ echo 1.0.0; exit 0; }}\n"
                   f"printf %s {shlex.quote(evil)} > {exe}\necho e > README.md\n")
    exe.chmod(0o755)
    original = exe.read_text()
    monkeypatch.setenv("PATH", f"{exe.parent}{os.pathsep}{os.environ['PATH']}")
    cfg = tmp_path / "fakecli.toml"
    cfg.write_text('confine = "required"\n[agents.fakecli]\ncommand = ["fakecli"]\nprompt = "stdin"\n'
                   'network = false\nstate_dirs = ["~/.fakecli"]\nversion_args = ["--version"]\n')
    req = RunAgentRequest(agent="fakecli", task="t", repo=str(repo), ticket="T", validateCommand="true")
    first = run_agent(req, config=load_config(cfg))
    # A job's state dir is its own copy (proctor.services.job.sandbox_home): the CLI in the user's is read-only to it.
    assert first.agent_version == "1.0.0" and exe.read_text() == original, first
    # Rewritten all the same (by something else than a job): the next probe runs it, confined.
    exe.write_text(evil)
    second = run_agent(req, config=load_config(cfg))
    assert not marker.exists(), "the host ran the rewritten CLI unconfined"
    assert second.agent_version == "6.6.6", "the probe ran (confined) and was not served from a stale cache"
    # control: the same file run as the old probe did (plain, on the host) writes the marker
    subprocess.run([str(exe), "--version"], check=True, capture_output=True)
    assert marker.exists()


@needs_confinement
def test_what_validation_plants_never_reaches_the_review_checkout(tmp_path):
    repo = make_repo(tmp_path, {"README.md": "hello\n", ".gitignore": "*.log\n"})
    marker = tmp_path / "validation-planted"
    # Validation runs the agent's code: here it plants an fsmonitor in the scratch .git, a nested repo, an
    # ignored file, a changed tracked file and a setuid bit, then passes.
    planting = (f"git config core.fsmonitor 'touch {marker}; false' && git init -q nested && "
                "echo junk > build.log && echo tampered >> README.md && chmod 4755 fixed.txt && true")
    res = job(repo, tmp_path, "echo fixed > fixed.txt", validateCommand=planting)
    assert res.status is Status.completed and res.tests_attempted[0].endswith("exit 0"), res
    wt = Path(res.worktree_path)
    assert sorted(os.listdir(wt)) == [".git", ".gitignore", "README.md", "fixed.txt"]
    assert (wt / "README.md").read_text() == "hello\n" and (wt / "fixed.txt").stat().st_mode & 0o7777 == 0o644
    reviewer_status(res.worktree_path)
    assert not marker.exists(), "a reviewer's git status ran what validation planted"
    assert sh("git", "status", "--porcelain", cwd=wt) == ""
    branch_holds_exactly(res)


# -- 6. the agent's network is its adapter's declared hosts only ------------------------------------------

NET_AGENT = r'''
import os, socket, sys
model, nats = int(sys.argv[1]), int(sys.argv[2])
out = []
proxy = os.environ.get("HTTPS_PROXY", "")
def via_proxy(port):
    if not proxy:
        return "no proxy"
    host, pport = proxy.rsplit("/", 1)[-1].rsplit(":", 1)
    try:
        s = socket.create_connection((host, int(pport)), timeout=5)
        s.sendall(f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
        head = s.recv(4096).split(b"\r\n", 1)[0].decode()
        if " 200" in head:
            s.sendall(b"ping\n")
            head += " " + s.recv(100).decode().strip()
        return head
    except OSError as exc:
        return f"error {exc.errno}"
def direct(port):
    try:
        socket.create_connection(("127.0.0.1", port), timeout=3).sendall(b"x")
        return "connected"
    except OSError as exc:
        return f"error {exc.errno}"
out.append(f"model-proxy: {via_proxy(model)}")
out.append(f"nats-proxy: {via_proxy(nats)}")
out.append(f"nats-direct: {direct(nats)}")
open("net.txt", "w").write("\n".join(out) + "\n")
'''


def _tcp_server(reply: bytes):
    import socket as _s
    import threading

    srv = _s.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    hits = []

    def serve():
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            hits.append(1)
            try:
                c.settimeout(3)
                c.recv(100)
                c.sendall(reply)
            except OSError:
                pass
            c.close()

    threading.Thread(target=serve, daemon=True).start()
    return srv, hits


@needs_confinement
def test_network_is_the_declared_hosts_through_the_proxy_and_each_connect_is_a_row(tmp_path):
    from proctor.mechanisms.ledger.store import Ledger

    model, model_hits = _tcp_server(b"pong from the model\n")
    nats, nats_hits = _tcp_server(b"INFO {}\n")
    mport, nport = model.getsockname()[1], nats.getsockname()[1]
    repo = make_repo(tmp_path, {"README.md": "hello\n", "netagent.py": NET_AGENT})

    def cfg(confine: str) -> object:
        p = tmp_path / f"net-{confine}.toml"
        p.write_text(f'confine = "{confine}"\n[agents.net]\ncommand = ["{sys.executable}", "netagent.py", '
                     f'"{mport}", "{nport}"]\nprompt = "stdin"\nnetwork = true\negress = ["127.0.0.1:{mport}"]\n')
        return load_config(p)

    req = RunAgentRequest(agent="net", task="t", repo=str(repo), ticket="T", validateCommand="true")
    control = run_agent(req, config=cfg("off"))
    assert "nats-direct: connected" in (Path(control.worktree_path) / "net.txt").read_text(), control

    res = run_agent(req, config=cfg("required"))
    net = (Path(res.worktree_path) / "net.txt").read_text()
    assert "model-proxy: HTTP/1.1 200" in net and "pong from the model" in net, net
    assert "nats-proxy: HTTP/1.1 403" in net and "nats-direct: error" in net, net
    assert res.confinement_details["network"] == "proxy"
    rows = [r.payload for r in Ledger.default().rows(kind="egress.decision", job_id=res.job_id)]
    assert [(r["port"], r["allowed"]) for r in rows] == [(mport, True), (nport, False)], rows
    model.close()
    nats.close()
