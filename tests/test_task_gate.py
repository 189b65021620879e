"""Declared tasks, the trusted policy and the gate: every GateCode, each refusal beside a control that passes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import proctor
from proctor.mechanisms.policy.gate import CallVerdict, Decision, Gate, GateCode, decide
from proctor.mechanisms.policy.plan import plan
from proctor.mechanisms.policy.stop import StopSwitch
from proctor.mechanisms.policy.task import AgentTask, Effect, ToolCall
from proctor.mechanisms.policy.trusted import Ceilings, Policy, PolicyError, check_workspace

NO_STOP = lambda: None  # noqa: E731


@pytest.fixture(autouse=True)
def home(fresh_home: Path) -> Path:
    fresh_home.mkdir()
    return fresh_home


@pytest.fixture
def ws(tmp_path) -> Path:
    w = tmp_path / "ws"
    (w / "src").mkdir(parents=True)
    (w / "src" / "a.py").write_text("x = 1\n")
    return w


def task_dict(ws: Path, **over) -> dict:
    d = {
        "goal": "fix the bug",
        "tools": [
            {"name": "read", "effect": "read"},
            {"name": "write", "effect": "write"},
            {"name": "rm", "effect": "delete"},
            {"name": "sh", "effect": "shell"},
            {"name": "fetch", "effect": "read", "online": True},
            {"name": "think", "effect": "none"},
            {"name": "mail", "effect": "send"},
        ],
        "permissions": {"workspace": str(ws), "read_files": True, "write_files": True, "shell": True,
                        "network": True},
    }
    d.update(over)
    return d


def gate(ws: Path, policy: Policy | None = None, dry_run: bool = True, **over) -> Gate:
    return Gate(AgentTask.model_validate(task_dict(ws, **over)), policy=policy or Policy(), dry_run=dry_run,
                stop=NO_STOP)


def call(tool: str, *paths: str, call_id: str = "") -> ToolCall:
    return ToolCall(tool=tool, paths=paths, call_id=call_id)


# --- task shape -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["top", "tool", "permissions", "limits"])
def test_unknown_field_refused_everywhere_control_accepted(ws, where):
    good = task_dict(ws, limits={"max_steps": 3})
    AgentTask.model_validate(good)  # control
    bad = task_dict(ws, limits={"max_steps": 3})
    target = {"top": bad, "tool": bad["tools"][0], "permissions": bad["permissions"], "limits": bad["limits"]}[where]
    target["approved"] = True
    with pytest.raises(ValueError, match="approved"):
        AgentTask.model_validate(bad)


def test_unknown_field_in_call_refused_control_accepted():
    ToolCall.model_validate({"tool": "read", "paths": ["a"], "call_id": "1", "arguments": {"approved": True}})
    with pytest.raises(ValueError, match="approved"):
        ToolCall.model_validate({"tool": "read", "paths": ["a"], "approved": True})


def test_duplicate_tool_names_refused(ws):
    tools = [{"name": "read", "effect": "read"}, {"name": "read2", "effect": "read"}]
    AgentTask.model_validate(task_dict(ws, tools=tools))
    tools[1]["name"] = "read"
    with pytest.raises(ValueError, match="declared twice"):
        AgentTask.model_validate(task_dict(ws, tools=tools))


def test_unknown_effect_refused(ws):
    with pytest.raises(ValueError):
        AgentTask.model_validate(task_dict(ws, tools=[{"name": "x", "effect": "launch"}]))


# --- ceilings and the trusted policy ----------------------------------------------------------------------

def test_ceilings_cap_lower_and_fill(ws):
    ceilings = Ceilings(max_steps=25, max_tool_calls=50, wall_clock_s=900)
    t = AgentTask.model_validate(task_dict(ws, limits={"max_steps": 100, "max_tool_calls": 5}))
    capped = ceilings.cap(t)
    assert (capped.max_steps, capped.max_tool_calls, capped.wall_clock_s) == (25, 5, 900)
    assert ceilings.lowered(t) == ["max_steps 100 -> 25"]


def test_ceiling_checks_carry_limit_and_observed():
    c = Ceilings(max_steps=3, max_tool_calls=2, wall_clock_s=1.5)
    assert c.check_steps(3) is None and c.check_tool_calls(2) is None and c.check_wall_clock(1.5) is None
    assert c.check_steps(4) == "exceeded max_steps of 3 (steps=4)"
    assert c.check_tool_calls(3) == "exceeded max_tool_calls of 2 (tool_calls=3)"
    assert c.check_wall_clock(2.0) == "exceeded wall_clock_s of 1.5 (elapsed_s=2.000)"


def test_policy_defaults_when_absent(home):
    p = Policy.load()
    assert p.ceilings == Ceilings(25, 50, 900.0) and p.source is None


def test_policy_file_read(home):
    (home / "policy.toml").write_text(
        '[ceilings]\nmax_steps = 5\n[forbid]\neffects = ["pay"]\npaths = [".git"]\n')
    p = Policy.load()
    assert p.ceilings.max_steps == 5 and p.ceilings.max_tool_calls == 50
    assert p.forbidden_effects == {Effect.pay} and p.forbidden_paths == (".git",)


@pytest.mark.parametrize("text,match", [
    ("[ceilings]\nmax_steps = 5\nbogus = 1\n", "bogus"),
    ("[ceilings\n", "not valid TOML"),
    ("[ceilings]\nmax_steps = 0\n", "max_steps"),
    ('[forbid]\neffects = ["launch"]\n', "effects"),
])
def test_policy_file_unusable(home, text, match):
    (home / "policy.toml").write_text(text)
    with pytest.raises(PolicyError, match=match):
        Policy.load()


# --- the workspace rule -----------------------------------------------------------------------------------

def test_workspace_rule(tmp_path, ws, home, monkeypatch):
    user_home = tmp_path / "users" / "me"
    user_home.mkdir(parents=True)
    monkeypatch.setenv("HOME", str(user_home))
    (home / "inside").mkdir()
    (tmp_path / "afile").write_text("")
    code = Path(proctor.__file__).parent
    assert check_workspace(str(ws)) is None  # control
    assert check_workspace(str(user_home / "project")) is not None  # missing
    (user_home / "project").mkdir()
    assert check_workspace(str(user_home / "project")) is None  # inside home is fine
    bad = {
        "relative": "ws",
        "missing": str(tmp_path / "nope"),
        "a file": str(tmp_path / "afile"),
        "root": "/",
        "home": str(user_home),
        "holds home": str(user_home.parent),
        "state dir": str(home),
        "inside state": str(home / "inside"),
        "holds state": str(home.parent),
        "code": str(code),
        "inside code": str(code / "cli"),
        "holds code": str(code.parent),
    }
    for label, path in bad.items():
        assert check_workspace(path) is not None, label


def test_workspace_via_symlink_to_state_dir_refused(tmp_path, home):
    link = tmp_path / "sneaky"
    link.symlink_to(home)
    assert "state dir" in (check_workspace(str(link)) or "")


# --- the gate, code by code -------------------------------------------------------------------------------

def test_ok_run(ws):
    d = gate(ws).decide(call("read", "src/a.py", call_id="c1"))
    assert (d.verdict, d.code, d.call_id, d.effect) == (CallVerdict.run, GateCode.OK, "c1", Effect.read)


@pytest.mark.parametrize("tool,paths", [("sh", ()), ("rm", ("src/a.py",)), ("mail", ()), ("fetch", ("x",))])
def test_outward_is_dry_run_unless_live(ws, tool, paths):
    assert gate(ws).decide(call(tool, *paths)).verdict is CallVerdict.dry_run
    assert gate(ws, dry_run=False).decide(call(tool, *paths)).verdict is CallVerdict.run


def test_stopped_refused_control_released(ws, home):
    switch = StopSwitch(home)
    g = Gate(AgentTask.model_validate(task_dict(ws)), policy=Policy())  # default stop: $PROCTOR_HOME's switch
    switch.engage("maintenance")
    d = g.decide(call("read", "src/a.py"))
    assert d.code is GateCode.STOPPED and "maintenance" in d.reason
    switch.release()
    assert g.decide(call("read", "src/a.py")).code is GateCode.OK


def test_task_invalid_refused_control(ws):
    good = task_dict(ws)
    assert decide(good, {"tool": "read", "paths": ["src/a.py"]}).code is GateCode.OK
    bad = task_dict(ws, approval="granted")
    d = decide(bad, {"tool": "read", "paths": ["src/a.py"]})
    assert d.verdict is CallVerdict.refused and d.code is GateCode.TASK_INVALID and "approval" in d.reason


def test_call_invalid_refused_control(ws):
    g = gate(ws)
    assert g.decide({"tool": "read", "paths": ["src/a.py"], "call_id": "1"}).code is GateCode.OK
    d = g.decide({"tool": "read", "paths": ["src/a.py"], "call_id": "2", "approved": True})
    assert d.code is GateCode.CALL_INVALID
    assert g.decide({"tool": "read", "paths": ["src/\x00a.py"]}).code is GateCode.CALL_INVALID


def test_reused_call_id_refused_and_does_not_overwrite(ws):
    g = gate(ws)
    assert g.decide(call("read", "src/a.py", call_id="x")).code is GateCode.OK
    assert g.decide(call("read", "src/a.py", call_id="x")).code is GateCode.CALL_INVALID
    assert g.decide(call("read", "src/a.py", call_id="y")).code is GateCode.OK
    assert g.verdict_for("x") is CallVerdict.run


def test_workspace_refused_control(ws, home):
    assert gate(ws).decide(call("read", "src/a.py")).code is GateCode.OK
    d = gate(ws, permissions={"workspace": str(home), "read_files": True}).decide(call("read", "a"))
    assert d.code is GateCode.WORKSPACE


def test_tool_undeclared_refused_control(ws):
    g = gate(ws)
    assert g.decide(call("think")).code is GateCode.OK
    assert g.decide(call("launch_missiles")).code is GateCode.TOOL_UNDECLARED


@pytest.mark.parametrize("tool,flag", [("read", "read_files"), ("write", "write_files"), ("rm", "write_files"),
                                       ("sh", "shell"), ("mail", "network"), ("fetch", "network")])
def test_permission_refused_control(ws, tool, flag):
    paths = ("src/a.py",) if tool in ("read", "write", "rm", "fetch") else ()
    perms = {"workspace": str(ws), "read_files": True, "write_files": True, "shell": True, "network": True}
    assert gate(ws, permissions=perms).decide(call(tool, *paths)).code is GateCode.OK
    perms[flag] = False
    d = gate(ws, permissions=perms).decide(call(tool, *paths))
    assert d.code is GateCode.PERMISSION and flag in d.reason


def test_paths_required_refused_control(ws):
    g = gate(ws)
    assert g.decide(call("write")).code is GateCode.PATHS_REQUIRED
    assert g.decide(call("write", "src/new.py")).code is GateCode.OK
    assert g.decide(call("think")).code is GateCode.OK  # not a file tool


@pytest.mark.parametrize("inside,outside", [
    ("src/../src/a.py", "../outside.txt"),
    ("src/a.py", "/etc/passwd"),
    ("./src/a.py", "src/../../ws-other/x"),
])
def test_outside_workspace_refused_control(ws, inside, outside):
    g = gate(ws)
    assert g.decide(call("read", inside)).code is GateCode.OK
    assert g.decide(call("read", outside)).code is GateCode.OUTSIDE_WORKSPACE
    assert g.decide(call("read", inside, outside)).code is GateCode.OUTSIDE_WORKSPACE


def test_absolute_path_inside_accepted(ws):
    assert gate(ws).decide(call("read", str(ws / "src" / "a.py"))).code is GateCode.OK


def test_symlink_inside_pointing_out_is_outside(ws, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("s")
    (ws / "innocent.txt").symlink_to(secret)
    (ws / "ok.txt").symlink_to(ws / "src" / "a.py")  # control: points inside
    (ws / "escape").symlink_to(tmp_path)
    g = gate(ws)
    assert g.decide(call("read", "ok.txt")).code is GateCode.OK
    assert g.decide(call("read", "innocent.txt")).code is GateCode.OUTSIDE_WORKSPACE
    assert g.decide(call("read", "escape/secret.txt")).code is GateCode.OUTSIDE_WORKSPACE
    assert g.decide(call("write", "escape/new.txt")).code is GateCode.OUTSIDE_WORKSPACE
    assert g.decide(call("read", str(ws / "innocent.txt"))).code is GateCode.OUTSIDE_WORKSPACE


def test_dotdot_through_symlink_resolves_physically(ws, tmp_path):
    # escape -> tmp_path/deep/er, so escape/.. is tmp_path/deep: outside, though lexically it is the workspace.
    (tmp_path / "deep" / "er").mkdir(parents=True)
    (ws / "escape").symlink_to(tmp_path / "deep" / "er")
    g = gate(ws)
    assert g.decide(call("read", "src/../src/a.py")).code is GateCode.OK
    assert g.decide(call("read", "escape/../x")).code is GateCode.OUTSIDE_WORKSPACE


def test_symlink_loop_refused_not_raised(ws):
    (ws / "loop1").symlink_to(ws / "loop2")
    (ws / "loop2").symlink_to(ws / "loop1")
    (ws / "self").symlink_to(ws / "self")
    g = gate(ws)
    assert g.decide(call("read", "src/a.py")).code is GateCode.OK
    for p in ("loop1/x", "self//", "self"):
        assert g.decide(call("read", p)).code is GateCode.OUTSIDE_WORKSPACE, p


def test_granted_decision_carries_resolved_paths(ws):
    (ws / "alias").symlink_to(ws / "src")
    d = gate(ws).decide(call("read", "alias/a.py", "./src//a.py"))
    real = os.path.realpath(ws)
    assert d.paths == (f"{real}/src/a.py", f"{real}/src/a.py")


def test_tool_limit_counts_granted_calls_only(ws):
    g = gate(ws, limits={"max_tool_calls": 2})
    assert g.decide(call("launch")).code is GateCode.TOOL_UNDECLARED  # refusals do not count
    assert g.decide(call("think")).code is GateCode.OK
    assert g.decide(call("read", "src/a.py")).code is GateCode.OK
    d = g.decide(call("think"))
    assert d.code is GateCode.TOOL_LIMIT and "max_tool_calls of 2 (tool_calls=3)" in d.reason
    assert g.granted_calls == 2


def test_tool_limit_caller_cannot_raise_ceiling(ws):
    policy = Policy(ceilings=Ceilings(max_tool_calls=1))
    g = gate(ws, policy=policy, limits={"max_tool_calls": 100})
    assert g.limits.max_tool_calls == 1
    assert g.decide(call("think")).code is GateCode.OK
    assert g.decide(call("think")).code is GateCode.TOOL_LIMIT


def test_fresh_gate_per_decide(ws):
    t = task_dict(ws, limits={"max_tool_calls": 1})
    for _ in range(3):
        assert decide(t, {"tool": "think"}, stop=NO_STOP).code is GateCode.OK


def test_policy_blocked_effect_control(ws):
    policy = Policy(forbidden_effects=frozenset({Effect.send}))
    g = gate(ws, policy=policy)
    assert g.decide(call("sh")).code is GateCode.OK
    d = g.decide(call("mail"))
    assert d.code is GateCode.POLICY_BLOCKED and "send" in d.reason


def test_an_effect_held_for_a_person_is_refused_until_a_grant_covers_the_call(ws):
    policy = Policy(approval_effects=frozenset({Effect.write}))
    held = gate(ws, policy=policy)
    assert held.decide(call("read", "a.py")).code is GateCode.OK  # control: an effect not held
    d = held.decide(call("write", "a.py", call_id="c1"))
    assert d.code is GateCode.APPROVAL_REQUIRED and "proctor approve JOB c1" in d.reason
    granted = Gate(AgentTask.model_validate(task_dict(ws)), policy=policy, dry_run=False, stop=NO_STOP,
                   approved=lambda c: "grant #7" if c.paths == ("a.py",) else None)
    ok = granted.decide(call("write", "a.py"))
    assert ok.verdict is CallVerdict.run and "grant #7" in ok.reason
    assert granted.decide(call("write", "b.py")).code is GateCode.APPROVAL_REQUIRED  # the grant is for a.py


@pytest.mark.parametrize("pattern,blocked,allowed", [
    (".git", ".git/config", "src/git.py"),
    ("secrets/*", "secrets/key.pem", "src/secrets.py"),
    ("*.pem", "src/deep/k.pem", "src/k.pem.txt"),
])
def test_policy_blocked_path_control(ws, pattern, blocked, allowed):
    g = gate(ws, policy=Policy(forbidden_paths=(pattern,)))
    assert g.decide(call("write", allowed)).code is GateCode.OK
    assert g.decide(call("write", blocked)).code is GateCode.POLICY_BLOCKED


def test_policy_blocked_absolute_pattern(ws):
    g = gate(ws, policy=Policy(forbidden_paths=(str(ws / "src") + "/",)))
    assert g.decide(call("write", "other.py")).code is GateCode.OK
    assert g.decide(call("write", "src/a.py")).code is GateCode.POLICY_BLOCKED


def test_unusable_policy_file_refuses(ws, home):
    t = task_dict(ws)
    assert decide(t, {"tool": "think"}).code is GateCode.OK
    (home / "policy.toml").write_text("[ceilings]\nmax_steps = 'many'\n")
    d = decide(t, {"tool": "think"})
    assert d.code is GateCode.POLICY_BLOCKED and "policy" in d.reason


def test_order_of_checks(ws, home):
    policy = Policy(ceilings=Ceilings(max_tool_calls=0), forbidden_effects=frozenset(Effect))
    perms_none = {"workspace": str(ws)}
    # Each row breaks its own rule and every later one; the earliest code must win.
    assert gate(ws, policy).decide(call("read", "../x")).code is GateCode.OUTSIDE_WORKSPACE
    assert gate(ws, policy).decide(call("read")).code is GateCode.PATHS_REQUIRED
    assert gate(ws, policy, permissions=perms_none).decide(call("read")).code is GateCode.PERMISSION
    assert gate(ws, policy, permissions=perms_none).decide(call("nope")).code is GateCode.TOOL_UNDECLARED
    assert gate(ws, policy).decide(call("think")).code is GateCode.TOOL_LIMIT
    assert gate(ws, Policy(forbidden_effects=frozenset(Effect))).decide(call("think")).code is GateCode.POLICY_BLOCKED
    StopSwitch(home).engage("x")
    assert decide(task_dict(ws, approved=True), {"tool": "nope", "bogus": 1}).code is GateCode.STOPPED


def test_every_gate_code_is_reached_by_this_file():
    import re

    text = Path(__file__).read_text()
    assert {c.value for c in GateCode} <= set(re.findall(r"GateCode\.([A-Z_]+)", text))


def test_on_decision_sees_every_decision_first(ws):
    seen: list[Decision] = []
    g = Gate(AgentTask.model_validate(task_dict(ws)), policy=Policy(), stop=NO_STOP, on_decision=seen.append)
    g.decide(call("think", call_id="a"))
    g.decide(call("nope", call_id="b"))
    g.decide({"tool": "x", "bogus": True})
    assert [d.code for d in seen] == [GateCode.OK, GateCode.TOOL_UNDECLARED, GateCode.CALL_INVALID]


def test_on_decision_failure_means_not_granted(ws):
    def boom(_d: Decision) -> None:
        raise OSError("disk full")

    g = Gate(AgentTask.model_validate(task_dict(ws)), policy=Policy(), stop=NO_STOP, on_decision=boom)
    with pytest.raises(OSError):
        g.decide(call("think", call_id="a"))
    assert g.verdict_for("a") is None and g.granted_calls == 0


# --- check-task's plan ------------------------------------------------------------------------------------

def test_plan_reports_standing_of_each_tool(ws):
    t = AgentTask.model_validate(task_dict(ws, limits={"max_steps": 99},
                                           permissions={"workspace": str(ws), "read_files": True}))
    p = plan(t, Policy(forbidden_effects=frozenset({Effect.send})))
    assert p.verdict == "ready" and p.limits["max_steps"] == 25 and p.limits_lowered == ["max_steps 99 -> 25"]
    tools = {x.name: x for x in p.tools}
    assert tools["read"].permitted and not tools["read"].outward and tools["read"].paths_required
    assert not tools["fetch"].permitted and tools["fetch"].needs_network and tools["fetch"].outward
    assert not tools["sh"].permitted and tools["sh"].outward
    assert tools["mail"].policy_blocked and tools["think"].permitted


# --- fuzzing: decide never raises -------------------------------------------------------------------------

json_leaf = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), st.text(max_size=8))
json_any = st.recursive(
    json_leaf, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids, max_size=3),
    max_leaves=8,
)
path_text = st.lists(st.sampled_from(["..", ".", "src", "a.py", "", "/", "link", "loop", "alias", "ws", "nope",
                                      "x\x00y", "~", "//"]), max_size=7).map("/".join)
effects = st.sampled_from([e.value for e in Effect] + ["launch", 3, None])


def raw_tasks(ws: Path):
    tool = st.fixed_dictionaries({"name": st.sampled_from(["read", "write", "sh", "", "x"]), "effect": effects},
                                 optional={"online": json_leaf, "approved": json_leaf})
    flags = ("read_files", "write_files", "shell", "network", "x")
    perms = st.fixed_dictionaries({"workspace": st.sampled_from([str(ws), "/", "rel", "", str(ws / "src")])},
                                  optional={k: json_leaf for k in flags})
    limit_keys = ("max_steps", "max_tool_calls", "wall_clock_s", "y")
    limits = st.fixed_dictionaries({}, optional={k: json_leaf for k in limit_keys})
    return st.one_of(
        st.fixed_dictionaries({"goal": st.text(max_size=5), "permissions": perms},
                              optional={"tools": st.lists(tool, max_size=4), "limits": limits, "context": json_leaf,
                                        "bogus": json_any}),
        json_any,
    )


raw_calls = st.one_of(
    st.fixed_dictionaries({"tool": st.sampled_from(["read", "write", "sh", "x", ""])},
                          optional={"paths": st.lists(path_text, max_size=3), "call_id": st.text(max_size=3),
                                    "arguments": json_any, "extra": json_any}),
    json_any,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_tasks_and_calls_never_raise(ws, data):
    if not (ws / "link").exists():
        (ws / "link").symlink_to("/etc")
        (ws / "loop").symlink_to(ws / "loop")
    policy = Policy(forbidden_paths=(".git", "src/*"))
    d = decide(data.draw(raw_tasks(ws)), data.draw(raw_calls), stop=NO_STOP, policy=policy)
    assert isinstance(d, Decision) and (d.verdict is CallVerdict.refused) == (d.code is not GateCode.OK)


def kernel_real(full: str) -> str | None:
    """An oracle independent of the gate: the kernel resolves the deepest existing ancestor (O_PATH and
    /proc/self/fd), the missing rest is appended lexically; None when the kernel cannot resolve it (a loop)."""
    rest: list[str] = []
    p = full
    while True:
        try:
            fd = os.open(p, os.O_PATH)
        except (FileNotFoundError, NotADirectoryError):
            p, tail = os.path.split(p.rstrip("/") or "/")
            rest.insert(0, tail)
            continue
        except OSError:
            return None
        try:
            return os.path.normpath(os.path.join(os.readlink(f"/proc/self/fd/{fd}"), *rest))
        finally:
            os.close(fd)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(paths=st.lists(path_text.filter(lambda p: p and "\x00" not in p), min_size=1, max_size=3))
def test_fuzzed_granted_paths_are_inside(ws, paths):
    if not (ws / "link").exists():
        (ws / "link").symlink_to("/etc")
        (ws / "loop").symlink_to(ws / "loop")
        (ws / "alias").symlink_to(ws / "src")
    d = gate(ws).decide(ToolCall(tool="read", paths=tuple(paths)))
    real_ws = os.path.realpath(ws)
    for p in paths:
        real = kernel_real(os.path.join(ws, p))
        if d.verdict is not CallVerdict.refused:
            assert real is None or real == real_ws or real.startswith(real_ws + "/"), p
            assert all(q == real_ws or q.startswith(real_ws + "/") for q in d.paths)
