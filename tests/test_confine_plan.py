"""Unit tests of the confine layer's decisions: which confiner a policy gets, the argv it builds, and the
gaps it reports. No agent runs here; the hostile suite (test_confine_hostile.py) runs the real processes."""

from __future__ import annotations

import os
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from proctor.mechanisms.confine import Capabilities, ConfineRequest, Unavailable, choose, detect
from proctor.mechanisms.confine import helper as helper_mod
from proctor.mechanisms.confine import landlock
from proctor.contract import Code

NONE = Capabilities(None, None, "bwrap not installed", 0, "ENOSYS", None, "no Landlock", False, None, 0)
BOTH = replace(NONE, bwrap="/usr/bin/bwrap", bwrap_version="0.8.0", landlock_abi=7,
               helper=Path("/h/landlock-exec"))


@pytest.fixture
def req(tmp_path: Path) -> ConfineRequest:
    wt, common, tmp = tmp_path / "wt", tmp_path / "main" / ".git", tmp_path / "tmp"
    for d in (wt, common / "objects", common / "worktrees" / "wt", tmp):
        d.mkdir(parents=True)
    (wt / ".git").write_text(f"gitdir: {common}/worktrees/wt\n")
    return ConfineRequest(worktree=wt, git_paths=(common / "worktrees" / "wt", common / "objects"),
                          readonly=(common.parent, common, wt / ".git"), tmpdir=tmp)


def test_off_runs_argv_unchanged_and_says_so(req: ConfineRequest) -> None:
    plan = choose("off", BOTH).wrap(["agent", "--x"], req)
    assert plan.argv == ["agent", "--x"] and plan.confinement == "none"
    assert plan.gaps == ["no confinement: confinement is off by request"]


def test_required_fails_closed_auto_degrades_visibly(req: ConfineRequest) -> None:
    refused = choose("required", NONE)
    assert isinstance(refused, Unavailable) and refused.code == Code.CONFINEMENT_UNAVAILABLE
    assert "bwrap not installed" in refused.reason and "ENOSYS" in refused.reason
    plan = choose("auto", NONE).wrap(["agent"], req)
    assert plan.confinement == "none" and plan.gaps[0].startswith("no confinement")


@pytest.mark.parametrize(("caps", "name"), [
    (BOTH, "bwrap+landlock"),
    (replace(BOTH, helper=None, helper_reason="no C compiler"), "bwrap"),
    (replace(BOTH, bwrap=None), "landlock"),
])
def test_strongest_available(caps: Capabilities, name: str) -> None:
    assert choose("auto", caps).name == name
    assert choose("required", caps).name == name


def test_unknown_mode_is_a_bug() -> None:
    with pytest.raises(ValueError):
        choose("sometimes", BOTH)  # type: ignore[arg-type]


def test_bwrap_profile_closes_the_measured_escapes(req: ConfineRequest) -> None:
    argv = choose("auto", replace(BOTH, helper=None)).wrap(["agent"], req).argv
    assert {"--unshare-all", "--unshare-user", "--die-with-parent", "--new-session"} <= set(argv)
    assert argv[argv.index("--cap-drop") + 1] == "ALL" and "--share-net" not in argv
    assert argv.index("--ro-bind", argv.index("--proc")) == argv.index("/proc/sys") - 1
    pointer = argv.index(str(req.worktree / ".git"))
    assert argv.index(str(req.worktree)) < pointer and argv[pointer - 1] == "--ro-bind-try"
    assert argv[-2:] == ["--", "agent"]
    shared = choose("auto", replace(BOTH, helper=None)).wrap(["agent"], replace(req, network=True)).argv
    assert "--share-net" in shared


def _rules(argv: list[str]) -> dict[str, int]:
    end = argv.index("--")
    return {r.split(":", 1)[1]: int(r.split(":", 1)[0]) for r in argv[5:end]}


def test_landlock_rules_never_grant_device_nodes(req: ConfineRequest) -> None:
    argv = landlock.helper_args(Path("/h"), req, 7)
    assert argv[1:5] == [str((1 << 16) - 1), "3", "3", "0"]
    rules = _rules(argv)
    assert rules["/"] == landlock.READ_ONLY and "/tmp" not in rules
    secret = req.worktree.parent / "secret"
    secret.mkdir()
    hidden = _rules(landlock.helper_args(Path("/h"), replace(req, hidden=(secret,)), 7))
    assert hidden["/"] == landlock.READ_DIR and "/usr" in hidden  # listing anywhere, reading around it
    assert not any(Path(p).is_relative_to(secret) for p in hidden)
    for path, mask in rules.items():
        assert not mask & (landlock.MAKE_CHAR | landlock.MAKE_BLOCK), path
        if not os.path.isdir(path):
            assert not mask & ~landlock.FILE_RIGHTS, path
    assert "/tmp" in _rules(landlock.helper_args(Path("/h"), req, 7, (Path("/tmp"),)))


@pytest.mark.parametrize(("abi", "net", "scoped"), [(1, "0", "0"), (4, "3", "0"), (6, "3", "3")])
def test_landlock_asks_only_what_the_abi_knows(req: ConfineRequest, abi: int, net: str, scoped: str) -> None:
    argv = landlock.helper_args(Path("/h"), req, abi)
    assert argv[1:4] == [str(landlock.handled_fs(abi)), net, scoped]
    assert landlock.helper_args(Path("/h"), replace(req, network=True), abi)[2] == "0"


def test_landlock_only_reports_what_it_cannot_protect(req: ConfineRequest) -> None:
    gaps = choose("auto", replace(BOTH, bwrap=None)).wrap(["agent"], req).gaps
    assert any(g.startswith(f"{req.worktree / '.git'} is writable") for g in gaps)
    assert any(g.startswith("UDP is not blocked") for g in gaps)
    both = choose("auto", BOTH).wrap(["agent"], req).gaps
    assert not any("UDP" in g or "is writable: Landlock" in g for g in both)
    online = choose("auto", replace(BOTH, bwrap=None)).wrap(["agent"], replace(req, network=True)).gaps
    assert not any("UDP" in g or "unix sockets" in g for g in online)


def test_landlock_alone_as_root_adds_an_empty_netns(req: ConfineRequest) -> None:
    confiner = choose("auto", replace(BOTH, bwrap=None, helper_netns=True))
    plan = confiner.wrap(["agent"], req)
    assert plan.argv[4] == "1" and plan.details["network"] == "netns+landlock-tcp"
    assert not any("UDP" in g for g in plan.gaps)
    assert confiner.wrap(["agent"], replace(req, network=True)).argv[4] == "0"
    both = choose("auto", replace(BOTH, helper_netns=True)).wrap(["agent"], req).argv
    assert both[both.index("--") + 5] == "0"  # under bwrap its own network namespace already covers it


def test_details_name_every_layer(req: ConfineRequest) -> None:
    d = choose("auto", BOTH).wrap(["agent"], req).details
    assert d == {"files": "bwrap+landlock", "network": "netns+landlock-tcp", "cleanup": "pidns",
                 "landlock_abi": 7, "bwrap_version": "0.8.0", "uid": "0 in a user namespace, no capabilities"}


def test_missing_writable_root_is_refused_not_skipped(req: ConfineRequest) -> None:
    plan = choose("auto", BOTH).wrap(["agent"], replace(req, state_dirs=(req.tmpdir / "absent",)))
    assert isinstance(plan, Unavailable) and "absent" in plan.reason


def test_detect_is_cached() -> None:
    assert detect() is detect()


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler to build the helper")
def test_helper_cache_is_built_once_and_must_be_trusted(tmp_path: Path) -> None:
    first = helper_mod.build(tmp_path)
    assert first.path is not None and first.reason.startswith("built")
    assert helper_mod.build(tmp_path) == helper_mod.Helper(first.path, "cached")
    os.chmod(first.path, 0o777)  # anyone could have swapped it
    assert helper_mod.build(tmp_path).path is None


def test_this_machine_gets_what_detect_found() -> None:
    caps = detect()
    expected = "+".join(n for n, on in (("bwrap", caps.bwrap is not None), ("landlock", caps.landlock)) if on)
    got = choose("required", caps)
    assert isinstance(got, Unavailable) if not expected else got.name == expected


def test_exec_roots_expose_a_venv_under_the_private_tmp_and_never_tmp_itself(tmp_path):
    from proctor.mechanisms.confine.plan import exec_roots

    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    py = venv / "bin" / "python"
    py.write_text("#!/bin/sh\n")
    py.chmod(0o755)
    script = tmp_path / "tool"
    script.write_text(f"#!{py}\n")
    script.chmod(0o755)
    assert str(tmp_path).startswith("/tmp/")
    assert exec_roots([str(py)]) == (venv,)
    assert exec_roots(["/usr/bin/env", "-C", "/x", str(py), "arg"]) == (venv,)
    assert set(exec_roots([str(script)])) == {tmp_path, venv}  # a #! script: its folder and its interpreter's root
    assert exec_roots(["/bin/sh", "-c", "true"]) == ()  # control: nothing under a private tmpfs
    loose = Path("/tmp") / f"proctor-probe-{os.getpid()}"
    loose.write_text("#!/bin/sh\n")
    loose.chmod(0o755)
    try:
        assert exec_roots([str(loose)]) == ()  # its folder would be /tmp itself: never granted
    finally:
        loose.unlink()


# --- network = the host's egress proxy ---------------------------------------------------------------------

def _proxied(req: ConfineRequest, *egress: str) -> ConfineRequest:
    return replace(req, network=True, egress_socket=req.tmpdir.parent / "egress.sock",
                   egress=egress or ("api.openai.com:443",))


def test_proxy_under_bwrap_binds_the_socket_and_shares_no_network(req: ConfineRequest) -> None:
    plan = choose("auto", BOTH).wrap(["agent"], _proxied(req))
    argv = plan.argv
    assert "--share-net" not in argv and "--unshare-all" in argv
    i = argv.index(str(req.tmpdir.parent / "egress.sock"))
    assert argv[i - 1] == "--bind" and argv[i + 1] == "/run/proctor-egress.sock"
    helper = argv.index("--") + 1  # bwrap's own argv ends at its "--"; the helper's starts there
    # TCP bind and connect stay handled: only the relay's port is granted (by the helper, once bound)
    assert argv[helper] == "/h/landlock-exec" and argv[helper + 2] == "3"
    assert argv[helper + 5] == "relay=3128:/run/proctor-egress.sock"
    assert plan.env["HTTPS_PROXY"] == plan.env["all_proxy"] == "http://127.0.0.1:3128"
    assert plan.env["NO_PROXY"] == ""
    assert plan.details["network"] == "proxy" and plan.details["egress"] == ["api.openai.com:443"]
    assert any(g.startswith("the declared egress hosts (api.openai.com:443)") for g in plan.gaps)
    assert not any("whole network" in g or "network is open" in g for g in plan.gaps)


def test_proxy_landlock_alone_uses_a_netns_as_root_else_says_the_network_is_open(req: ConfineRequest) -> None:
    root = choose("auto", replace(BOTH, bwrap=None, helper_netns=True)).wrap(["agent"], _proxied(req))
    assert root.argv[4] == "1" and root.argv[5] == f"relay=3128:{req.tmpdir.parent / 'egress.sock'}"
    assert root.details["network"] == "proxy" and root.details["network_layers"] == "netns+landlock-tcp"
    assert not any("network is open" in g for g in root.gaps)
    user = choose("auto", replace(BOTH, bwrap=None, helper_netns=False)).wrap(["agent"], _proxied(req))
    assert user.argv[4] == "0" and user.argv[5].startswith("relay=0:")  # host loopback: any free port
    assert "HTTPS_PROXY" not in user.env  # the helper sets it once it knows the port
    assert [g for g in user.gaps if g.startswith("the network is open")], user.gaps


def test_proxy_under_bwrap_alone_relays_with_the_system_python(req: ConfineRequest, monkeypatch) -> None:
    from proctor.mechanisms.confine import plan as plan_mod

    monkeypatch.setattr(plan_mod, "system_python", lambda: "/usr/bin/python3")
    plan = choose("auto", replace(BOTH, helper=None)).wrap(["agent"], _proxied(req))
    start = plan.argv.index("--") + 1
    assert plan.argv[start:start + 4] == ["/usr/bin/python3", "-I", "-S", "-c"]
    assert plan.argv[start + 5:start + 8] == ["3128", "/run/proctor-egress.sock", "--"]
    assert "--share-net" not in plan.argv and plan.details["network"] == "proxy"
    assert plan.env["HTTPS_PROXY"] == "http://127.0.0.1:3128"
    monkeypatch.setattr(plan_mod, "system_python", lambda: None)
    none = choose("auto", replace(BOTH, helper=None)).wrap(["agent"], _proxied(req))
    assert "--share-net" not in none.argv and none.details["network"] == "netns"
    assert any(g.startswith("no egress relay") for g in none.gaps)


def test_network_gaps_are_honest_about_what_is_reachable(req: ConfineRequest) -> None:
    nothing = choose("auto", BOTH).wrap(["agent"], replace(_proxied(req), egress=()))
    assert any("declares no egress hosts" in g for g in nothing.gaps)
    legacy = choose("auto", BOTH).wrap(["agent"], replace(req, network=True))
    assert legacy.details["network"] == "open" and "--share-net" in legacy.argv
    assert any(g.startswith("the whole network is reachable") for g in legacy.gaps)
    off = choose("auto", BOTH).wrap(["agent"], replace(_proxied(req), network=False))
    assert off.details["network"] == "netns+landlock-tcp" and "HTTPS_PROXY" not in off.env
    assert not any("relay=" in a for a in off.argv) and str(req.tmpdir.parent / "egress.sock") not in off.argv
