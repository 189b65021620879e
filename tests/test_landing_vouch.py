"""Landing hashes only what the host cannot vouch for (issue 25), and vouches for nothing an agent changed.

The host keeps the index its own checkout wrote (each file's stat right after git wrote it) and a stamp; at
landing a file is taken as the base's without reading it only when its device, inode, mode, size, mtime and
ctime are the recorded ones to the nanosecond and its recorded ctime is before the stamp (proctor.mechanisms.git.vouch).
Each hostile test does what it says first (its control: the size and mtime an agent can fake are the
recorded ones), then shows the change is in the job's tree all the same. The parity tests hold the tree and
the checkout built from the record against the ones built by hashing every file (`git add --all`, as before).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

from conftest import make_repo, sh
from proctor import RunAgentRequest, Status, run_agent
from proctor.mechanisms.config.load import load_config
from proctor.mechanisms.git import landing, vouch, worktree
from proctor.mechanisms.git.materialise import materialise
from proctor.mechanisms.git.scan import Scan
from proctor.mechanisms.git.scan import scan as scan_dir

PY_REPO = {"pyproject.toml": "[project]\nname = 'calc'\nversion = '0'\n",
           "calc.py": "def add(a, b):\n    return a - b\n",
           "test_calc.py": "import calc\n\ndef test_add():\n    assert calc.add(2, 2) == 4\n"}
FIXED = "def add(a, b):\n    return a + b\n"  # the same size as the base's calc.py


def _job(repo: Path, tmp_path: Path, script: str, **kw):
    cfg = tmp_path / "agent.toml"
    cfg.write_text('confine = "off"\n[agents.py]\ncommand = ["python3", "-c", ' + json.dumps(script) + ']\n'
                   'prompt = "stdin"\nnetwork = false\n')
    req = RunAgentRequest(agent="py", task="t", repo=str(repo), ticket="T", **kw)
    return run_agent(req, config=load_config(cfg))


# -- the hostile agents, through a whole job ------------------------------------------------------------------

SAME_SIZE_UTIME = f"""
import os
st = os.stat("calc.py")
open("calc.py", "w").write({FIXED!r})
os.utime("calc.py", ns=(st.st_atime_ns, st.st_mtime_ns))
now = os.stat("calc.py")
assert (now.st_size, now.st_mtime_ns, now.st_ino) == (st.st_size, st.st_mtime_ns, st.st_ino), "control"
"""

RENAME_OVER = f"""
import os
st = os.stat("calc.py")
open(".calc.tmp", "w").write({FIXED!r})
os.utime(".calc.tmp", ns=(st.st_atime_ns, st.st_mtime_ns))
os.rename(".calc.tmp", "calc.py")
now = os.stat("calc.py")
assert (now.st_size, now.st_mtime_ns) == (st.st_size, st.st_mtime_ns) and now.st_ino != st.st_ino, "control"
"""


@pytest.mark.parametrize("script", [SAME_SIZE_UTIME, RENAME_OVER], ids=["same-size-utime", "rename-over"])
def test_a_rewrite_that_keeps_size_and_mtime_is_in_the_tree(tmp_path, script):
    repo = make_repo(tmp_path, dict(PY_REPO))
    res = _job(repo, tmp_path, script)
    assert res.changed_files == ["calc.py"] and res.agent_changed_files == ["calc.py"], res
    assert res.status is Status.completed and res.tests_attempted[0].endswith("exit 0"), res  # the fix passes
    wt = Path(res.worktree_path)
    assert (wt / "calc.py").read_text() == FIXED
    assert sh("git", "show", f"{res.commit}:calc.py", cwd=wt) == FIXED
    assert sh("git", "status", "--porcelain", cwd=wt) == ""


def test_what_validation_rewrites_with_size_and_mtime_kept_is_undone_in_review(tmp_path):
    repo = make_repo(tmp_path, dict(PY_REPO))
    # Validation runs the agent's code: here it rewrites a file of the tree keeping its size and mtime,
    # replaces another by rename, and passes. The review checkout is the job's commit all the same.
    planting = ("python3 -c \"import os; st = os.stat('calc.py'); open('calc.py', 'w').write('def add(a, b):\\n"
                "    return 0 + 0\\n'); os.utime('calc.py', ns=(st.st_atime_ns, st.st_mtime_ns))\" && "
                "cp test_calc.py t.tmp && echo '# x' >> t.tmp && mv t.tmp test_calc.py && true")
    res = _job(repo, tmp_path, f"open('calc.py', 'w').write({FIXED!r})", validateCommand=planting)
    assert res.status is Status.completed and res.tests_attempted[0].endswith("exit 0"), res
    wt = Path(res.worktree_path)
    assert (wt / "calc.py").read_text() == FIXED
    assert (wt / "test_calc.py").read_text() == PY_REPO["test_calc.py"]
    assert sh("git", "status", "--porcelain", cwd=wt) == ""


# -- the rule itself, on the host's record of a real checkout ----------------------------------------------

def _worktree(tmp_path: Path, files: dict[str, str], job: str = "J") -> tuple[Path, worktree.Worktree]:
    repo = tmp_path / "repo" if (tmp_path / "repo").exists() else make_repo(tmp_path, files)
    r = worktree.open_repo(repo)
    wt = worktree.create(r, job, "T", worktree.default_base(r))
    assert isinstance(wt, worktree.Worktree) and wt.recorded is not None
    return repo, wt


def _land(wt: worktree.Worktree, tmp_path: Path, recorded: bool = True, **scan) -> landing.Landing:
    """What the host does once the agent exited: the directory aside, scanned, built, made the tree."""
    if not recorded:
        wt = dataclasses.replace(wt, recorded=None)
    work = wt.path.with_name(f".{wt.path.name}.work")
    os.rename(wt.path, work)
    wt.path.mkdir()
    found = scan_dir(work, **scan)
    assert isinstance(found, Scan)
    built = landing.build(work, wt.path / ".git", wt, Path(tempfile.mkdtemp(dir=tmp_path)), found, "m\n")
    assert isinstance(built, landing.Landing), built
    return built


def _work(wt: worktree.Worktree) -> Path:
    return wt.path.with_name(f".{wt.path.name}.work")


def _forge(rec: vouch.Recorded, path: str, st: os.stat_result, since: int) -> vouch.Recorded:
    """The record as if the checkout had written `path` with exactly `st`, in the stamp's own tick."""
    data = bytearray(rec.data)
    off = 12
    while True:
        flags = int.from_bytes(data[off + 60:off + 62], "big")
        n = flags & 0xFFF
        if data[off + 62:off + 62 + n] == path.encode():
            break
        off += (62 + n + 8) & ~7
    for i, v in enumerate((st.st_ctime_ns // 10**9, st.st_ctime_ns % 10**9, st.st_mtime_ns // 10**9,
                           st.st_mtime_ns % 10**9, st.st_dev & 0xFFFFFFFF, st.st_ino & 0xFFFFFFFF)):
        data[off + 4 * i:off + 4 * i + 4] = v.to_bytes(4, "big")
    data[-20:] = hashlib.sha1(bytes(data[:-20])).digest()
    return vouch.Recorded(bytes(data), since, rec.hash_len)


def test_a_change_within_the_records_tick_is_hashed(tmp_path):
    # A coarse clock: the checkout wrote calc.py in the same tick as the stamp, and the agent's same-size
    # rewrite (mtime put back) landed in that tick too, so every stat field, ctime included, is the
    # recorded one. Only the rule that an entry written in the stamp's tick is never vouched for finds it.
    _repo, wt = _worktree(tmp_path, dict(PY_REPO))
    target = wt.path / "calc.py"
    before = os.lstat(target)
    target.write_text(FIXED)
    os.utime(target, ns=(before.st_atime_ns, before.st_mtime_ns))
    now = os.lstat(target)
    assert (now.st_size, now.st_mtime_ns, now.st_ino) == (before.st_size, before.st_mtime_ns, before.st_ino)
    found = scan_dir(wt.path)
    same_tick = _forge(wt.recorded, "calc.py", now, since=now.st_ctime_ns)
    compared = vouch.compare(same_tick, found.seen)
    assert [p for p, _, _ in compared.changed] == ["calc.py"]
    # control: had the stamp been a tick later, the record would vouch for the rewritten file
    later = vouch.compare(_forge(wt.recorded, "calc.py", now, since=now.st_ctime_ns + 1), found.seen)
    assert later.changed == []

    built = _land(dataclasses.replace(wt, recorded=same_tick), tmp_path)
    assert built.changed == ["calc.py"]
    assert (_work(wt) / "calc.py").read_text() == FIXED


def test_a_ctime_rewind_is_not_possible_and_mtime_alone_proves_nothing(tmp_path):
    _repo, wt = _worktree(tmp_path, dict(PY_REPO))
    target = wt.path / "calc.py"
    before = os.lstat(target)
    os.utime(target, ns=(before.st_atime_ns, before.st_mtime_ns))  # put the same mtime back: ctime moves
    after = os.lstat(target)
    assert after.st_mtime_ns == before.st_mtime_ns and after.st_ctime_ns > before.st_ctime_ns
    assert after.st_ctime_ns >= wt.recorded.since
    compared = vouch.compare(wt.recorded, scan_dir(wt.path).seen)
    assert [p for p, _, _ in compared.changed] == ["calc.py"]  # hashed (and found unchanged: not in the diff)


def test_a_clean_checkout_is_vouched_for_but_its_racy_entries(tmp_path):
    _repo, wt = _worktree(tmp_path, {f"d{i % 7}/f{i}.txt": f"{i}\n" for i in range(300)})
    compared = vouch.compare(wt.recorded, scan_dir(wt.path).seen)
    racy = {p for p, _, _ in compared.changed}
    recorded_ctime = {p: os.lstat(wt.path / p).st_ctime_ns for p in compared.modes}
    assert racy == {p for p, c in recorded_ctime.items() if c >= wt.recorded.since}
    assert compared.gone == []
    assert compared.tree == sh("git", "rev-parse", f"{wt.base_sha}^{{tree}}", cwd=wt.repo.path).strip()


def test_an_unreadable_record_vouches_for_nothing(tmp_path):
    _repo, wt = _worktree(tmp_path, dict(PY_REPO))
    seen = scan_dir(wt.path).seen
    data = wt.recorded.data
    for bad in (data[:40], b"DIRC" + (4).to_bytes(4, "big") + data[8:], data[:-30]):
        assert vouch.compare(vouch.Recorded(bad, wt.recorded.since), seen) is None


# -- parity with hashing every file -------------------------------------------------------------------------

BASE = {
    ".gitignore": "*.log\nbuild/\n/ignored-dir/\n!keep.log\n",
    "README.md": "hello\n",
    "src/a.py": "a = 1\n",
    "src/b.py": "b = 2\n",
    "src/deep/c.py": "c = 3\n",
    "build/tracked.txt": "tracked under an ignored dir\n",
    "gone.txt": "to delete\n",
    "becomes-dir": "a file now\n",
    "dir-becomes-file/x.txt": "x\n",
    "tool.sh": "#!/bin/sh\n",
    "link-target.txt": "t\n",
    "dir-to-link/x.txt": "x\n",
    "sp ace/ünï.txt": "u\n",
}

AGENT = """set -e
echo changed >> README.md
printf 'b = 3\\n' > src/b.py
rm gone.txt
rm becomes-dir && mkdir becomes-dir && echo in > becomes-dir/inner.txt
rm -r dir-becomes-file && echo now-a-file > dir-becomes-file
chmod +x tool.sh src/a.py
ln -s link-target.txt a-link
mkdir -p new/sub && echo n > new/sub/n.txt && echo l > new/x.log && echo k > new/keep.log
mkdir -p ignored-dir/deep && echo i > ignored-dir/deep/i.txt
echo new > build/new.txt && echo t2 >> build/tracked.txt
mkdir -p sub/nested && (cd sub/nested && git init -q . && echo z > z.txt)
mkdir -p src/deep/more && echo m > src/deep/more/m.py && echo y > src/deep/y.log
printf '*\\n' > src/deep/more/.gitignore
echo big > huge.bin && truncate -s 2M huge.bin
mkfifo src/pipe
ln src/a.py src/a-hardlink.py
rm base-link && echo now-a-file > base-link
rm -r dir-to-link && ln -s src dir-to-link
echo tmp > x.tmp && echo '*.tmp' >> .gitignore
echo c > ':colon.txt' && echo n > "$(printf 'new\\nline.txt')" && echo s >> 'sp ace/ünï.txt'
echo planted > submod/file && mkdir -p submod/d && echo p > submod/d/p
"""


def _tree_listing(git_dir: Path, tree: str) -> list[str]:
    return sh("git", "--git-dir", str(git_dir), "ls-tree", "-r", "--full-tree", tree).splitlines()


def _dir_state(root: Path) -> dict[str, tuple]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        if rel == ".":
            dirnames[:] = [d for d in dirnames if d != ".git"]
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            key = os.path.normpath(os.path.join(rel, name))
            if stat.S_ISLNK(st.st_mode):
                out[key] = ("link", os.readlink(p))
            elif stat.S_ISDIR(st.st_mode):
                out[key] = ("dir", stat.S_IMODE(st.st_mode))
            else:
                out[key] = ("file", stat.S_IMODE(st.st_mode), st.st_nlink, Path(p).read_bytes())
    return out


def test_the_tree_and_the_checkout_are_those_of_hashing_every_file(tmp_path):
    repo = make_repo(tmp_path, dict(BASE))
    # a symlink and a submodule's gitlink in the base
    os.symlink("link-target.txt", repo / "base-link")
    head = sh("git", "rev-parse", "HEAD", cwd=repo).strip()
    sh("git", "add", "base-link", cwd=repo)
    sh("git", "update-index", "--add", "--cacheinfo", f"160000,{head},submod", cwd=repo)
    sh("git", "commit", "-qm", "link and gitlink", cwd=repo)
    r = worktree.open_repo(repo)
    base = worktree.default_base(r)
    got = {}
    for job, recorded in (("fast", True), ("slow", False)):
        wt = worktree.create(r, job, "T", base)
        subprocess.run(["/bin/sh", "-c", AGENT], cwd=wt.path, check=True, capture_output=True)
        built = _land(wt, tmp_path, recorded=recorded, max_file_bytes=1024 * 1024)
        assert (built.known is not None) is recorded
        got[job] = (_tree_listing(built.git_dir, built.tree), sorted(built.changed), _dir_state(_work(wt)))
    assert got["fast"][0] == got["slow"][0]
    assert got["fast"][1] == got["slow"][1]
    assert got["fast"][2] == got["slow"][2]
    listing = "\n".join(got["fast"][0])
    assert "new/keep.log" in listing and "build/new.txt" not in listing and "ignored-dir" not in listing
    assert "src/pipe" not in listing and "sub/nested" not in listing and "huge.bin" not in listing
    assert "100755" in next(line for line in listing.splitlines() if line.endswith("\tsrc/a.py"))
    assert "120000" in next(line for line in listing.splitlines() if line.endswith("\tdir-to-link"))
    assert "x.tmp" not in listing and ":colon.txt" in listing and "submod/" not in listing
    assert "160000" in next(line for line in listing.splitlines() if line.endswith("\tsubmod"))
    # the work directory is exactly the tree: nothing ignored, nested or special stays; no file has two links
    state = got["fast"][2]
    assert "build/new.txt" not in state and "sub" not in state and "src/pipe" not in state
    assert state["src/a-hardlink.py"][2] == 1 and state["src/a.py"][2] == 1


def test_review_keeps_what_validation_left_alone_and_rewrites_the_rest(tmp_path):
    make_repo(tmp_path, {f"d{i % 5}/f{i}.txt": f"file {i}\n" for i in range(60)} | {"x.sh": "#!/bin/sh\n"})
    _r, wt = _worktree(tmp_path, {})
    (wt.path / "d0" / "f0.txt").write_text("agent\n")
    built = _land(wt, tmp_path)
    work = _work(wt)
    known = built.known
    kept_before = {p: os.lstat(work / p).st_ino for p in known.modes}
    # Each file held open by a path fd: a file the pass removes cannot hand its inode number to the one it
    # writes in its place (ext4 reuses a freed number at once), which would read here as kept.
    held = [os.open(work / p, os.O_PATH | os.O_NOFOLLOW) for p in known.modes]
    # What validation (agent code) does meanwhile:
    f1 = work / "d1" / "f1.txt"
    st = os.lstat(f1)
    f1.write_text("FILE 1\n")  # same size, mtime put back
    os.utime(f1, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.link(work / "d2" / "f2.txt", tmp_path / "outside-link")  # a link out, written through later
    with open(tmp_path / "outside-link", "a") as fh:
        fh.write("through the link\n")
    os.chmod(work / "x.sh", 0o4755)
    (work / "d3" / "junk.txt").write_text("junk\n")
    os.mkdir(work / "d4" / "newdir")
    os.unlink(work / "d0" / "f5.txt")
    os.symlink("/etc/passwd", work / "d0" / "f10.txt.tmp")
    os.replace(work / "d0" / "f10.txt.tmp", work / "d0" / "f10.txt")
    (work / ".git").mkdir(exist_ok=True)
    assert materialise(work, built.git_dir, built.tree, built.index, known=known) is None
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    sh("git", "--git-dir", str(built.git_dir), "--work-tree", str(fresh), "read-tree", "--reset", "-u", built.commit)
    assert _dir_state(work) == _dir_state(fresh)
    rewritten = {p for p in known.modes if os.lstat(work / p).st_ino != kept_before[p]}
    for fd in held:
        os.close(fd)
    assert rewritten == {"d1/f1.txt", "d2/f2.txt", "x.sh", "d0/f5.txt", "d0/f10.txt"}
    # and the record is current: a second pass with nothing changed keeps everything
    again = {p: os.lstat(work / p).st_ino for p in known.modes}
    assert materialise(work, built.git_dir, built.tree, built.index, known=known) is None
    assert {p: os.lstat(work / p).st_ino for p in known.modes} == again


def test_another_tree_and_back(tmp_path):
    make_repo(tmp_path, {"a.txt": "a\n", "t/test_x.py": "x = 1\n", "keep.txt": "k\n"})
    _r, wt = _worktree(tmp_path, {})
    (wt.path / "t" / "test_x.py").write_text("x = 2\n")
    (wt.path / "new.txt").write_text("n\n")
    built = _land(wt, tmp_path)
    work = _work(wt)
    assert materialise(work, built.git_dir, built.base_sha, built.index, known=built.known) is None
    assert (work / "t" / "test_x.py").read_text() == "x = 1\n" and not (work / "new.txt").exists()
    assert materialise(work, built.git_dir, built.tree, built.index, known=built.known) is None
    assert (work / "t" / "test_x.py").read_text() == "x = 2\n" and (work / "new.txt").read_text() == "n\n"
    env = {**os.environ, "GIT_INDEX_FILE": str(built.index)}
    tree = subprocess.run(["git", "--git-dir", str(built.git_dir), "write-tree"], env=env, check=True,
                          capture_output=True, text=True).stdout.strip()
    assert tree == built.tree


def test_a_pass_that_failed_half_way_leaves_the_next_to_read_everything(tmp_path):
    make_repo(tmp_path, {"a.txt": "a\n", "b.txt": "b\n"})
    _r, wt = _worktree(tmp_path, {})
    built = _land(wt, tmp_path)
    work = _work(wt)
    failed = materialise(work, built.git_dir, "0" * 40, built.index, known=built.known)
    assert failed is not None and built.known.lost
    st = os.lstat(work / "a.txt")
    (work / "a.txt").write_text("A\n")  # same size, mtime put back
    os.utime(work / "a.txt", ns=(st.st_atime_ns, st.st_mtime_ns))
    assert materialise(work, built.git_dir, built.tree, built.index, known=built.known) is None
    assert (work / "a.txt").read_text() == "a\n"
