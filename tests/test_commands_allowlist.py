"""The allowlist file, its argv patterns and globs, stdin gates, and the snapshot diff, judged directly."""

from __future__ import annotations

import os
import pickle
import signal
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proctor.services.commands import Allowlist, ProposalError, RequestCode, confined, controlplane, snapshot
from proctor.services.commands.controlplane import ControlPlane
from proctor.services.commands.globs import covers_folder, literal_root, matches
from proctor.services.commands.pattern import PathContext, match
from proctor.services.commands.request import CommandRequest, read_request
from test_commands_support import home, project  # noqa: F401  (fixtures)

ENTRY = """
version = 1
[[agents.a.commands]]
name = "e"
argv = {argv}
{more}
"""


def load(argv: str, more: str = "") -> Allowlist:
    return Allowlist.parse(ENTRY.format(argv=argv, more=more))


def pattern(argv: str):
    return load(argv).file.agents["a"].commands[0].argv


@pytest.mark.parametrize(
    ("argv", "ok", "bad"),
    [
        ('["git", ["status", "diff"]]', ["git", "diff"], ["git", "push"]),
        ('["ls", {type = "choice", values = ["-l", "-a"]}]', ["ls", "-a"], ["ls", "-la"]),
        ('["head", "-n", {type = "int", max = 50}]', ["head", "-n", "50"], ["head", "-n", "51"]),
        ('["head", "-n", {type = "int"}]', ["head", "-n", "0"], ["head", "-n", "-1"]),
        ('["seq", {type = "int", min = -5}]', ["seq", "-5"], ["seq", "1_000"]),
        ('["cat", {type = "path", globs = ["src/**"]}]', ["cat", "src/a/b.py"], ["cat", "docs/a"]),
        ('["cat", {type = "path"}]', ["cat", "a"], ["cat", "--output=/etc/passwd"]),
        ('["cat", {type = "path"}]', ["cat", "a"], ["cat", "../outside"]),
        ('["pytest", {type = "tail", max = 2, item = {type = "path"}}]', ["pytest"], ["pytest", "a", "b", "c"]),
        ('["pytest", {type = "tail", item = ["-q", "-x"]}]', ["pytest", "-q", "-x"], ["pytest", "-q", "-k"]),
        ('["make"]', ["make"], ["make", "install"]),
    ],
)
def test_patterns_match_whole_argv_left_to_right(argv, ok, bad) -> None:
    pat = pattern(argv)
    assert match(pat, ok, None) is None
    miss = match(pat, bad, None)
    assert miss is not None and miss.code == RequestCode.NOT_ALLOWLISTED and miss.reason


@pytest.mark.parametrize(
    ("argv", "more", "why"),
    [
        ('["git", "status"]', 'match = [["git", "push"]]', "does not match"),
        ('["git", "status"]', 'not_match = [["git", "status"]]', "matches"),
        ('[{type = "path"}, "x"]', "", "literal program"),
        ('["a", {type = "tail", item = "x"}, "b"]', "", "tail"),
        ('["a"]', 'writes = [".git/hooks/*"]', ".git"),
        ('["a"]', 'writes = ["../up"]', ".."),
        ('["a"]', 'confinement = {profile = "confined"}', "exec_paths"),
        ('["a"]', 'approved = true', "approved"),
        ('["a"]', 'cwd = "../elsewhere"', "cwd"),
        ('["a"]', 'env = {"BAD NAME" = "1"}', "environment"),
        ('["a"]', 'stdin_gates = [{type = "run_shell"}]', "stdin_gates"),
        ('["a", []]', "", "argv"),
    ],
)
def test_a_bad_allowlist_is_refused_at_load(argv, more, why) -> None:
    with pytest.raises(ProposalError) as info:
        load(argv, more)
    assert info.value.code == RequestCode.POLICY_INVALID and why in info.value.message


@pytest.mark.parametrize(
    ("gate", "ok", "bad"),
    [
        ('{type = "json"}', '{"a": 1}', "{a: 1}"),
        ('{type = "toml"}', "a = 1", "a = "),
        ('{type = "max_bytes", limit = 4}', "ééé"[:2], "ééé"),
        ('{type = "deny_regex", patterns = ["(?i)api[_-]?key"]}', "hello", "API_KEY=1"),
    ],
)
def test_stdin_gates_judge_the_content(gate, ok, bad) -> None:
    from proctor.services.commands.gates import first_failure
    from proctor.services.commands.request import StdinContent

    gates = load('["a"]', f"stdin_gates = [{gate}]").file.agents["a"].commands[0].stdin_gates
    assert first_failure(gates, StdinContent(path="x", content=ok), "x") is None
    assert "stdin gate 0" in first_failure(gates, StdinContent(path="x", content=bad), "x")
    globbed = load('["a"]', 'stdin_gates = [{type = "path_glob", globs = ["data/*.json"]}]')
    gates = globbed.file.agents["a"].commands[0].stdin_gates
    assert first_failure(gates, StdinContent(path="data/a.json", content=""), "data/a.json") is None
    assert first_failure(gates, StdinContent(path="src/a.py", content=""), "src/a.py") is not None


def test_the_documented_example_loads() -> None:
    from proctor.services.commands import allowlist

    example = allowlist.__doc__.split("\n\n", 2)[2]
    loaded = Allowlist.parse("\n".join(line[4:] for line in example.splitlines()))
    entry = loaded.file.agents["codex"].commands[0]
    assert entry.name == "pytest-file" and loaded.file.protected == ["docs/brief.md"]


def test_duplicate_entry_names_and_bad_toml_are_refused() -> None:
    twice = ENTRY.format(argv='["a"]', more="") + '[[agents.a.commands]]\nname = "e"\nargv = ["b"]\n'
    with pytest.raises(ProposalError, match="more than once"):
        Allowlist.parse(twice)
    with pytest.raises(ProposalError, match="not valid TOML"):
        Allowlist.parse("version = ")


def test_path_placeholders_follow_symlinks_and_spare_the_control_plane(tmp_path: Path) -> None:
    proj = tmp_path / "p"
    (proj / "src").mkdir(parents=True)
    (proj / "src" / "out").symlink_to(tmp_path)
    plane = ControlPlane(proj, (proj / ".git", tmp_path / "home"), ())
    ctx = PathContext(plane, proj)
    pat = pattern('["cat", {type = "path"}]')
    assert match(pat, ["cat", "src/x"], ctx) is None
    assert match(pat, ["cat", "src/out/x"], ctx).code == RequestCode.ARG_PATH_OUTSIDE_PROJECT
    assert match(pat, ["cat", str(tmp_path / "x")], ctx).code == RequestCode.ARG_PATH_OUTSIDE_PROJECT
    assert match(pat, ["cat", "vendor/.git/config"], ctx).code == RequestCode.ARG_PATH_PROTECTED
    assert match(pattern('["cat", {type = "path", exists = true}]'), ["cat", "src/none"], ctx) is not None


def test_globs_keep_star_inside_a_segment() -> None:
    assert matches("build/**", "build/a/b.o") and not matches("build/**", "build")
    assert matches("**/*.pyc", "x.pyc") and matches("**/*.pyc", "a/b/x.pyc")
    assert not matches("out/*", "out/a/b") and matches("out/*", "out/a")
    assert matches("src/[ab].py", "src/a.py") and not matches("src/[!ab].py", "src/a.py")
    assert literal_root("out/*.txt") == "out" and literal_root("**/x") == "." and literal_root("a/b") == "a/b"
    assert covers_folder("build/**", "build/sub") and not covers_folder("build/*", "build")
    assert not covers_folder("src/**", "srcx")


segment = st.text(alphabet="abcxyz._-", min_size=1, max_size=6).filter(lambda s: s not in (".", ".."))


@given(st.lists(segment, min_size=1, max_size=5))
def test_glob_star_never_crosses_a_slash(parts: list[str]) -> None:
    path = "/".join(parts)
    assert matches("**", path)
    assert matches("*", path) == (len(parts) == 1)
    assert matches(parts[0] + "/**", path) == (len(parts) > 1)


def test_request_model_is_closed_and_reads_in_order() -> None:
    req = CommandRequest(agent="a", argv=["ls"], cwd=".", purpose="look")
    assert read_request(req).request == req
    with pytest.raises(ValueError):
        CommandRequest(agent="a", argv=["ls"], cwd=".", purpose="look", approved=True)  # type: ignore[call-arg]
    with pytest.raises(ProposalError) as info:
        read_request(["not", "a", "mapping"])  # type: ignore[arg-type]
    assert info.value.code == RequestCode.REQUEST_SHAPE


def test_the_diff_uses_a_hash_only_where_metadata_cannot_tell(tmp_path: Path) -> None:
    root = tmp_path / "t"
    root.mkdir()
    (root / "f").write_text("aaaa")
    before = snapshot.take(root)
    assert "f" in before.digests  # written within the racy window: metadata cannot vouch for it
    # Same metadata, different content (what a write inside one timestamp tick looks like): caught by hash.
    forged = snapshot.Snapshot(root, before.entries, {"f": "0" * 128})
    assert snapshot.diff(before, forged).modified == ("f",)
    after = snapshot.take(root, reference=before)
    assert after.digests == before.digests and not snapshot.diff(before, after).paths


def test_the_snapshot_watches_git_persistence_paths(project: Path) -> None:
    watch = snapshot.git_watch_paths([project / ".git"])
    before = snapshot.take(project, watch)
    # git's own churn is left out: loose objects, packs, logs, the index
    assert ".git/objects/info" in before.entries and ".git/refs/heads/master" in before.entries
    assert not any(k.startswith((".git/objects/pack", ".git/logs")) or k == ".git/index" for k in before.entries)
    assert not any(k.startswith(".git/objects/") and len(k.split("/")[2]) == 2 for k in before.entries)
    (project / ".git" / "hooks" / "pre-commit").write_text("#!/bin/sh\necho pwned\n")
    with open(project / ".git" / "config", "a") as fh:
        fh.write("[core]\n\tfsmonitor = evil\n")
    (project / "vendor" / ".git").mkdir(parents=True)
    (project / "vendor" / ".git" / "config").write_text("[core]\n")
    (project / ".git" / "refs" / "heads" / "master").write_text("0" * 40 + "\n")
    (project / ".git" / "objects" / "info" / "alternates").write_text("/tmp/evil\n")
    (project / ".git" / "modules" / "sub" / "hooks").mkdir(parents=True)
    (project / ".git" / "modules" / "sub" / "hooks" / "post-checkout").write_text("#!/bin/sh\n")
    (project / ".git" / "packed-refs").write_text("# pack-refs\n")
    changes = snapshot.diff(before, snapshot.take(project, watch, reference=before))
    assert {".git/hooks/pre-commit", ".git/config", "vendor", "vendor/.git", "vendor/.git/config",
            ".git/refs/heads/master", ".git/objects/info/alternates", ".git/modules/sub/hooks/post-checkout",
            ".git/packed-refs"} <= set(changes.paths)
    assert "vendor" in changes.folders


def test_git_churn_is_not_a_change_but_a_new_top_level_git_dir_is_walked(tmp_path: Path, project: Path) -> None:
    import subprocess

    watch = snapshot.git_watch_paths([project / ".git"])
    before = snapshot.take(project, watch)
    (project / "src" / "app.py").write_text("print('changed')\n")
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@x", "commit", "-qam", "c"], cwd=project,
                   check=True)  # new loose objects, logs, index; and refs/heads/master, which is not churn
    changes = snapshot.diff(before, snapshot.take(project, watch, reference=before))
    assert {p for p in changes.paths if p.startswith(".git/")} <= {".git/refs/heads/master", ".git/ORIG_HEAD",
                                                                   ".git/COMMIT_EDITMSG"}
    assert ".git/refs/heads/master" in changes.paths
    # Not watched (not this project's git dir): the top-level `.git` folder is walked like any other.
    plain = tmp_path / "plain"
    (plain / ".git" / "hooks").mkdir(parents=True)
    before = snapshot.take(plain)
    (plain / ".git" / "hooks" / "post-checkout").write_text("#!/bin/sh\n")
    assert snapshot.diff(before, snapshot.take(plain, reference=before)).paths == [".git/hooks/post-checkout"]


def test_a_write_root_linked_out_of_the_project_is_refused(tmp_path: Path) -> None:
    proj, home = tmp_path / "proj", tmp_path / "home"
    for d in (proj / "out", home, tmp_path / "victim"):
        d.mkdir(parents=True)
    (proj / "build").symlink_to(tmp_path / "victim")  # planted by the agent before asking
    (proj / "gen").symlink_to(proj / "out")  # a link that stays inside: fine
    plane = controlplane.build(proj, home=home, ledger_files=[], policy_source=None, briefs=[])

    def entry(writes: str):
        return Allowlist.parse(ENTRY.format(argv='["/usr/bin/make"]', more=f"writes = {writes}\n"
                                            'confinement = {profile = "confined", exec_paths = ["/usr"]}')
                               ).file.agents["a"].commands[0]

    with pytest.raises(ProposalError) as info:
        confined.check(entry('["build/**"]'), Path("/usr/bin/make"), plane, confine=True)
    assert info.value.code == RequestCode.WRITE_ROOT_PROTECTED and "outside the project" in info.value.message
    try:  # control: past the root checks (it may still find no confiner on this machine)
        grant = confined.check(entry('["gen/**"]'), Path("/usr/bin/make"), plane, confine=True)
        assert grant is not None and grant.roots == (proj / "out",)
    except ProposalError as exc:
        assert exc.code == RequestCode.CONFINEMENT_UNAVAILABLE, exc.message


def _as_nobody(fn):
    """Run `fn` in a forked child as uid 65534 (where permissions bite even when the tests run as root)."""
    if os.geteuid() != 0:
        return fn()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            try:
                out = ("ok", fn())
            except BaseException as exc:  # sent back to the test
                out = ("raised", f"{type(exc).__name__}: {exc}")
            with os.fdopen(w, "wb") as fh:
                fh.write(pickle.dumps(out))
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as fh:
        data = fh.read()
    os.waitpid(pid, 0)
    kind, value = pickle.loads(data)
    if kind == "raised":
        raise AssertionError(f"as uid 65534: {value}")
    return value


def test_a_listable_but_unsearchable_folder_reads_as_changed_not_an_error() -> None:
    base = Path(tempfile.mkdtemp(dir="/tmp"))  # not under pytest's 0700 tmp: uid 65534 must reach it
    try:
        base.chmod(0o755)
        (base / "d").mkdir(mode=0o755)
        (base / "d" / "f").write_text("x")
        (base / "d" / "f").chmod(0o644)

        def after(lock: bool) -> list[str]:
            before = _as_nobody(lambda: snapshot.take(base))
            (base / "d" / ("g" if lock else "h")).write_text("undeclared")
            if lock:
                (base / "d").chmod(0o444)  # readable listing, no search permission
            return snapshot.diff(before, _as_nobody(lambda: snapshot.take(base, reference=before))).paths

        assert after(False) == ["d/h"]  # control: readable, just the new file
        paths = after(True)
        assert {"d/f", "d/g"} <= set(paths), paths
    finally:
        os.chmod(base / "d", 0o755)
        import shutil

        shutil.rmtree(base, ignore_errors=True)


def test_a_failing_parent_walk_does_not_deadlock_on_the_worker(tmp_path: Path, monkeypatch) -> None:
    root = tmp_path / "t"
    for i in range(8):
        (root / f"d{i}").mkdir(parents=True)
    monkeypatch.setattr(snapshot, "PARALLEL_MIN_DIRS", 4)
    monkeypatch.setattr(snapshot, "_can_fork", lambda: True)
    parent, real_walk = os.getpid(), snapshot._walk

    def walk(stack, entries, digests, racy_from, ref, skip=None):
        if os.getpid() == parent:
            raise OSError("injected: the parent's half failed")
        for i in range(200_000):  # a result far bigger than a pipe's buffer
            entries[f"x/{i}"] = (snapshot.FILE, 0o100644, i, i, i, i, None)

    def hung(*_):
        raise TimeoutError("take() hung waiting on its worker")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(20)
    try:
        monkeypatch.setattr(snapshot, "_walk", walk)
        with pytest.raises(OSError, match="injected"):
            snapshot.take(root)
        monkeypatch.setattr(snapshot, "_walk", real_walk)  # control: the same split walk, nothing failing
        assert set(snapshot.take(root).entries) == {f"d{i}" for i in range(8)}
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads every folder")
def test_an_unreadable_folder_reads_as_changed(tmp_path: Path) -> None:
    root = tmp_path / "t"
    (root / "d").mkdir(parents=True)
    before = snapshot.take(root)
    (root / "d").chmod(0)
    try:
        assert "d" in snapshot.diff(before, snapshot.take(root, reference=before)).paths
    finally:
        (root / "d").chmod(0o755)


def test_the_forked_walk_sees_exactly_what_one_process_sees(tmp_path: Path, monkeypatch) -> None:
    root = tmp_path / "t"
    for i in range(12):
        for j in range(3):
            d = root / f"d{i}" / f"s{j}"
            d.mkdir(parents=True)
            (d / "f.txt").write_text(f"{i}{j}")
    (root / "d0" / "link").symlink_to("s0")
    monkeypatch.setattr(snapshot, "PARALLEL_MIN_DIRS", 10 ** 9)
    alone = snapshot.take(root)
    monkeypatch.setattr(snapshot, "PARALLEL_MIN_DIRS", 4)
    monkeypatch.setattr(snapshot, "_can_fork", lambda: True)
    split = snapshot.take(root)
    assert split.entries == alone.entries and split.digests == alone.digests and len(alone.entries) == 12 * 7 + 1
    after = snapshot.take(root, reference=split)
    assert not snapshot.diff(split, after).paths


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
near_requests = st.fixed_dictionaries(
    {"kind": st.sampled_from(["command-request", "other"]), "agent": json_values | st.just("codex")},
    optional={"argv": json_values | st.lists(st.text(max_size=5), max_size=3), "cwd": json_values,
              "purpose": json_values, "expected_writes": json_values, "stdin_from_content": json_values,
              "extra": json_values},
)


@given(near_requests | json_values)
def test_any_json_is_admitted_or_refused_with_a_code(raw) -> None:
    try:
        admitted = read_request(raw)
    except ProposalError as exc:
        assert exc.code in RequestCode and exc.message
        return
    assert admitted.request.argv and admitted.request.purpose.strip()
