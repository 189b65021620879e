"""A job's gate service: every tool call the agent's CLI asks for is decided by proctor's gate before it runs.

Owns the per-job Unix socket the CLI's hook (`proctor/mechanisms/gatekeeper/hook_client.py`) asks on, turning each CLI's hook JSON
into the gate's `ToolCall` (a dialect per CLI), one ledger row per call (`gate.call`: job, CLI, tool, call id,
input digest, verdict, code, latency), the answer in the CLI's own form with the reason the model sees
(`[proctor CODE] ...`), the "armed" mark (the CLI's session-start hook ran: its hooks are loaded), and the
files that install the hook for one job only (outside the worktree, read-only to the agent). It is the job's
single ledger writer for calls: hooks run concurrently, their decisions are made one at a time.

It never runs a tool and never trusts the CLI to honour an answer: the host reconciles the CLI's own output
stream against the calls decided here (`unmatched`), and OS confinement stays the backstop.
"""

from __future__ import annotations

import hashlib
import json
import os
import py_compile
import shutil
import socketserver
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from proctor.mechanisms.gatekeeper.codex import CodexDialect
from proctor.mechanisms.gatekeeper.gemini import GeminiDialect
from proctor.mechanisms.ledger.store import Ledger
from proctor.mechanisms.policy.gate import CallVerdict, Decision, Gate, GateCode
from proctor.mechanisms.policy.task import AgentTask, Effect, Permissions, ToolSpec
from proctor.mechanisms.policy.trusted import Policy

HOOK_CLIENT = Path(__file__).resolve().parent / "hook_client.py"
# What the CLI runs: the client compiled once per job (GateService.start), beside its source. Run as a .py it
# was compiled again by every tool call (~0.9 ms of a ~8 ms call, issue 25); the interpreter runs a .pyc
# given as the script without looking for a source, so the compiled one is what each call loads.
HOOK_CLIENT_PYC = "hook_client.pyc"
HOOK_TIMEOUT_S = 60  # the CLI's own timeout for the hook; the client gives up (deny) well before it
# The largest request: the hook client's 4 MiB of hook input, escaped again as a JSON string (quotes and
# backslashes doubled), with room to spare. 8 MiB before; lowered so that the whole budget below, with the
# allocator's overhead, stays under 10 MiB (8 MiB measured +10.5 MiB under the flood, tests/test_gate_flood.py).
MAX_REQUEST = 5 * 1024 * 1024
# The socket's bounds: every byte and thread behind it is the host's, outside the job's cgroup. Unbounded,
# 64 connections sending 8 MiB each and never closing grew the host to ~790 MiB (issue 21, item 6). A CLI's
# hook asks one call at a time (a few at once for parallel tool calls), each connection lives milliseconds,
# and the client sends its whole request at once then half-closes: more than these is a flood.
MAX_CONNECTIONS = 8
REQUEST_DEADLINE_S = 5.0  # from accept to the request's end (a slow-loris sender is cut off); answers are small
CHUNK = 64 * 1024
MAX_BUFFERED = MAX_REQUEST + CHUNK  # all open requests' bytes together: the largest request, alone, fits

# Claude Code 2.1.197's built-in tools and what each does; how each row was determined is in the README's
# gate table (research/gating.md "Coverage", its -p tool list, the binary's strings, the docs). A tool that
# can run a command is `shell` whatever its name: `Skill` ran a skill's embedded `!`git ...`` itself with no
# Bash row (issue 22, item 4); LSP starts language-server programs; EnterWorktree/ExitWorktree run git
# itself.
CLAUDE_TOOLS: dict[str, tuple[Effect, bool]] = {
    "Bash": (Effect.shell, False), "BashOutput": (Effect.shell, False), "KillShell": (Effect.shell, False),
    "TaskOutput": (Effect.shell, False), "TaskStop": (Effect.shell, False), "Monitor": (Effect.shell, False),
    "PowerShell": (Effect.shell, False), "Skill": (Effect.shell, False), "LSP": (Effect.shell, False),
    "EnterWorktree": (Effect.shell, False), "ExitWorktree": (Effect.shell, False),
    "Write": (Effect.write, False), "Edit": (Effect.write, False), "MultiEdit": (Effect.write, False),
    "NotebookEdit": (Effect.write, False),
    "Read": (Effect.read, False), "Glob": (Effect.read, False), "Grep": (Effect.read, False),
    "LS": (Effect.read, False), "NotebookRead": (Effect.read, False),
    "WebFetch": (Effect.network, True), "WebSearch": (Effect.network, True),
    "RemoteTrigger": (Effect.network, True),
    # A sub-agent's own calls pass the same hook (research/gating.md "Coverage"); the rest only plan,
    # ask, schedule a prompt or keep a list inside the session.
    "Task": (Effect.none, False), "Agent": (Effect.none, False), "TodoWrite": (Effect.none, False),
    "ExitPlanMode": (Effect.none, False), "EnterPlanMode": (Effect.none, False),
    "AskUserQuestion": (Effect.none, False), "ToolSearch": (Effect.none, False),
    **{n: (Effect.none, False) for n in ("TaskCreate", "TaskUpdate", "TaskList", "TaskGet", "CronCreate",
                                          "CronDelete", "CronList")},
}
# Tool names no table lists that run a program of the user's (an MCP server, a gemini discovered tool or
# extension): `shell`, whatever effect a declaration gives them (`measured`).
COMMAND_PREFIXES = ("mcp__", "mcp_", "discovered_tool_")
# The CLIs' MCP resource tools reach those same programs: `shell` when declared, and (no table row) never in
# a default task, as before.
COMMAND_TOOLS = frozenset({"ListMcpResourcesTool", "ReadMcpResourceTool", "read_mcp_resource"})
# How strong an effect is, for `measured`: a declaration may not make a tool weaker than what it does.
_STRENGTH = {Effect.none: 0, Effect.read: 1, Effect.write: 2, Effect.delete: 3, Effect.network: 4,
             Effect.send: 4, Effect.pay: 5, Effect.shell: 6}


def measured(task: AgentTask, tools: dict[str, tuple[Effect, bool]]) -> AgentTask:
    """The task with each declared tool's effect at least what the CLI's tool measurably does (its table
    row; `shell` for a user's program behind COMMAND_PREFIXES): declaring `Skill` as effect `none` does not
    let it run commands without the `shell` permission."""
    specs = []
    for t in task.tools:
        runs = t.name in COMMAND_TOOLS or t.name.startswith(COMMAND_PREFIXES)
        effect, online = tools.get(t.name, (Effect.shell if runs else t.effect, False))
        if _STRENGTH[effect] > _STRENGTH[t.effect] or (online and not t.online):
            t = t.model_copy(update={"effect": max(effect, t.effect, key=_STRENGTH.__getitem__),
                                     "online": t.online or online})
        specs.append(t)
    return task.model_copy(update={"tools": tuple(specs)})


# Where each file tool names its path in tool_input; a read tool without one acts on the workspace.
CLAUDE_PATH_KEYS = ("file_path", "notebook_path", "path")


def default_task(goal: str, worktree: Path, network: bool, tools: dict[str, tuple[Effect, bool]]) -> AgentTask:
    """The declaration of a job that brought none: the CLI's own tools, files and shell inside the worktree,
    the network only when the adapter has egress. Ceilings from the trusted policy apply as for any task."""
    specs = tuple(ToolSpec(name=n, effect=e, online=o) for n, (e, o) in tools.items() if network or not o)
    return AgentTask(goal=goal[:2000] or "run-agent job", tools=specs,
                     permissions=Permissions(workspace=str(worktree), read_files=True, write_files=True,
                                             shell=True, network=network))


def with_workspace(task: AgentTask, worktree: Path) -> AgentTask:
    """A declared task bound to this job: its workspace is the job's worktree, whatever it named (a person
    writes the declaration before the worktree exists)."""
    perms = task.permissions.model_copy(update={"workspace": str(worktree)})
    return task.model_copy(update={"permissions": perms})


@dataclass(frozen=True)
class Answer:
    stdout: str = ""
    stderr: str = ""
    exit: int = 0


def _reason(d: Decision) -> str:
    return f"[proctor {d.code.value}] {d.reason}"


class ClaudeDialect:
    """Claude Code's PreToolUse/SessionStart hooks (`--settings`, `--setting-sources ''`, `dontAsk`)."""

    name = "claude"
    tools = CLAUDE_TOOLS

    def call(self, payload: dict[str, Any], worktree: Path) -> dict[str, Any]:
        tool = str(payload.get("tool_name", ""))
        args = payload.get("tool_input") if isinstance(payload.get("tool_input"), dict) else {}
        paths = [str(args[k]) for k in CLAUDE_PATH_KEYS if isinstance(args.get(k), str) and args.get(k)]
        effect = self.tools.get(tool, (None, False))[0]
        if not paths and effect in (Effect.read, Effect.write):
            paths = [str(worktree)]  # Glob/Grep/LS with no path act on the cwd: the worktree
        return {"tool": tool, "arguments": args, "paths": paths, "call_id": str(payload.get("tool_use_id", ""))}

    def answer(self, d: Decision) -> Answer:
        allow = d.verdict is CallVerdict.run
        out = {"hookSpecificOutput": {"hookEventName": "PreToolUse",
                                      "permissionDecision": "allow" if allow else "deny",
                                      "permissionDecisionReason": _reason(d)}}
        return Answer(json.dumps(out))

    def files(self, hook: list[str], dir: Path) -> dict[str, str]:
        """The files that install the hook for one job, relative to the gate dir (`{gate_dir}` in gate_args)."""
        def entry(event: str) -> dict[str, Any]:
            command = " ".join(_sh(a) for a in [*hook, event])
            return {"matcher": "*", "hooks": [{"type": "command", "command": command, "timeout": HOOK_TIMEOUT_S}]}

        settings = {"hooks": {"PreToolUse": [entry("PreToolUse")], "SessionStart": [entry("SessionStart")]}}
        return {settings_path(dir, self.name).name: json.dumps(settings, indent=1)}

    def env(self, dir: Path) -> dict[str, str]:
        """Variables the agent's CLI needs to find its hook (none for claude: its args name the file)."""
        return {}

    def tool_uses(self, stdout: str) -> list[tuple[str, str]]:
        """(tool_use id, tool name) of every tool call in claude's stream-json output."""
        found = []
        # Split on newlines only: str.splitlines also splits on U+2028, which a CLI's JSON carries raw
        # (Node's JSON.stringify), so a tool call holding one was never read (issue 22).
        for line in stdout.split("\n"):
            if '"tool_use"' not in line:
                continue
            try:
                ev = json.loads(line)
            except (ValueError, RecursionError):
                continue
            msg = ev.get("message") if isinstance(ev, dict) and ev.get("type") == "assistant" else None
            for part in (msg or {}).get("content") or [] if isinstance(msg, dict) else []:
                if isinstance(part, dict) and part.get("type") == "tool_use":
                    found.append((str(part.get("id", "")), str(part.get("name", ""))))
        return found


class Dialect(Protocol):
    """One CLI's hook protocol: its tools and their effects, its hook JSON as the gate's call, the gate's
    decision as its answer, the files (and variables) that install the hook for one job, and the tool calls
    its own output stream shows (for the armed check and reconciliation)."""

    name: str
    tools: dict[str, tuple[Effect, bool]]

    def call(self, payload: dict[str, Any], worktree: Path) -> dict[str, Any]: ...
    def answer(self, d: Decision) -> Answer: ...
    def files(self, hook: list[str], dir: Path) -> dict[str, str]: ...
    def env(self, dir: Path) -> dict[str, str]: ...
    def tool_uses(self, stdout: str) -> list[tuple[str, str]]: ...


# Keep in step with adapters.spec.GATE_DIALECTS.
DIALECTS: dict[str, Callable[[], Dialect]] = {"claude": ClaudeDialect, "codex": CodexDialect,
                                              "gemini": GeminiDialect}


def _sh(arg: str) -> str:
    return "'" + arg.replace("'", "'\\''") + "'"


@dataclass
class Summary:
    decided: int = 0
    refused: int = 0
    by_code: dict[str, int] = field(default_factory=dict)
    armed: bool = False
    turned_away: dict[str, int] = field(default_factory=dict)  # connections refused unread, by bound (Intake)
    forged: int = 0  # decisions the CLI's own stream never showed (GateService.reconcile): not in the counts above

    def as_dict(self, cli: str, settings: Path) -> dict[str, Any]:
        return {"gated": True, "cli": cli, "armed": self.armed, "calls": self.decided, "refused": self.refused,
                "by_code": dict(sorted(self.by_code.items())), "settings": str(settings),
                "turned_away": dict(sorted(self.turned_away.items())), "forged": self.forged}


# Why a connection was turned away, as the hook client (and so the model) hears it and the result counts it.
TURNED_AWAY = {
    "connections": f"more than {MAX_CONNECTIONS} connections to the gate at once",
    "size": f"a request over {MAX_REQUEST // (1024 * 1024)} MiB, or over what the gate buffers for all "
            f"open requests ({MAX_BUFFERED // (1024 * 1024)} MiB)",
    "slow": f"a request not sent whole within {REQUEST_DEADLINE_S:g}s",
}


class Intake:
    """What the gate socket's callers can make the host hold: connections at once, the bytes of their open
    requests together, the time one request may take. A caller past a bound gets a denied call and is
    counted in `turned_away`; nothing past the bound is read or kept."""

    def __init__(self, counts: dict[str, int], connections: int = MAX_CONNECTIONS,
                 buffered: int = MAX_BUFFERED) -> None:
        self._slots = threading.BoundedSemaphore(connections)
        self._lock = threading.Lock()
        self._free = buffered
        self.counts = counts

    def enter(self) -> bool:
        return self._slots.acquire(blocking=False)

    def leave(self) -> None:
        self._slots.release()

    def reserve(self, n: int) -> bool:
        with self._lock:
            if n > self._free:
                return False
            self._free -= n
            return True

    def release(self, n: int) -> None:
        with self._lock:
            self._free += n

    def turn_away(self, reason: str) -> Answer:
        with self._lock:
            self.counts[reason] = self.counts.get(reason, 0) + 1
        return Answer(stderr=f"[proctor GATE_UNAVAILABLE] the gate turned this call away: {TURNED_AWAY[reason]}",
                      exit=2)

    def read(self, sock: Any) -> tuple[bytes | Answer, int]:
        """The request, read in chunks each reserved before it is received (so the bytes held never pass
        the budget), until the sender half-closes; or the turning-away answer. Also the bytes reserved, for
        the caller to release once the request has been handled (its parsing holds copies of it)."""
        deadline = time.monotonic() + REQUEST_DEADLINE_S
        chunks: list[bytes] = []  # joined once at the end: a growing bytearray measured 3-4x the bytes under a flood
        held = 0
        while True:
            left = deadline - time.monotonic()
            want = min(CHUNK, MAX_REQUEST + 1 - held)
            if left <= 0:
                return self.turn_away("slow"), held
            if not self.reserve(want):
                return self.turn_away("size"), held
            try:
                sock.settimeout(left)
                chunk = sock.recv(want)
            except TimeoutError:
                self.release(want)
                return self.turn_away("slow"), held
            except OSError:
                chunk = b""
            self.release(want - len(chunk))
            held += len(chunk)
            if not chunk:
                return b"".join(chunks), held
            if held > MAX_REQUEST:
                return self.turn_away("size"), held
            chunks.append(chunk)


class _Server(socketserver.ThreadingUnixStreamServer):
    """A thread per connection while a slot is free; past that, a connection is answered (a deny) and
    closed from the accepting thread: no thread, no read."""

    daemon_threads = True

    def __init__(self, path: str, handler: type[socketserver.BaseRequestHandler], intake: Intake) -> None:
        self.intake = intake
        super().__init__(path, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.intake.enter():
            _send(request, self.intake.turn_away("connections"), wait=False)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.intake.leave()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.intake.leave()


def _send(sock: Any, answer: Answer, *, wait: bool = True) -> None:
    """The answer as the hook client reads it. `wait=False`: only what the socket takes at once (a flood's
    connection that never reads must not hold the accepting thread)."""
    data = json.dumps({"stdout": answer.stdout, "stderr": answer.stderr, "exit": answer.exit}).encode()
    try:
        if wait:
            sock.settimeout(REQUEST_DEADLINE_S)
            sock.sendall(data)
        else:
            sock.setblocking(False)
            sock.send(data)
    except OSError:
        pass  # the caller is gone or never reads: it hears nothing, which its hook client takes as a deny


class GateService:
    """`GateService(dialect, task, policy, ledger, job_id, dir, stop=, worktree=).start()`; `.stop()` after the
    agent. `dir` is a host-owned directory (never the agent's) holding the socket, the hook client and the
    CLI's settings; the sandbox sees it at the same path, read-only."""

    def __init__(self, dialect: Dialect, task: AgentTask, policy: Policy, ledger: Ledger, job_id: str,
                 dir: Path, *, stop: Callable[[], str | None], worktree: Path, ticket: str = "",
                 repo: str = "") -> None:
        self.dialect, self.ledger, self.job_id, self.dir = dialect, ledger, job_id, dir
        self.worktree = worktree
        self.ticket, self.repo = ticket, repo  # a person's grant is for a ticket of a repo (`proctor approve`)
        self.held: list[dict[str, str]] = []  # calls the policy holds for a person: the job ends on the first
        self.streamed: dict[str, str] = {}  # tool_use id -> tool name, as the CLI's own output showed them
        self.gate = Gate(measured(task, dialect.tools), policy=policy, dry_run=False, stop=stop,
                         on_decision=self._row, approved=self._grant)
        self.summary = Summary()
        self.intake = Intake(self.summary.turned_away)
        self.seen: dict[str, str] = {}  # call id -> verdict
        self.decisions: list[Decided] = []  # every call decided here, in order (reconcile)
        self.forged: list[str] = []  # decisions the CLI's own stream never showed: "tool (call id)"
        self._forged_ids: list[str] = []
        self.failures: list[str] = []
        self._lines = StreamLines()
        self._watched = False  # reconciled only against a stream the host watched (`watch`)
        self._reconciled = False
        self._call: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._latency = 0.0
        self._digest = ""

    @property
    def socket_path(self) -> Path:
        return self.dir / "gate.sock"

    def hook_command(self) -> list[str]:
        """The hook as the CLI runs it, with the paths it has inside the sandbox."""
        return [os.path.realpath(sys.executable), "-I", "-S", str(self.dir / HOOK_CLIENT_PYC),
                str(self.dir / "gate.sock"), self.dialect.name]

    def start(self) -> GateService:
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        shutil.copyfile(HOOK_CLIENT, self.dir / "hook_client.py")  # the source, for a person reading the gate dir
        compile_client(self.dir / "hook_client.py", self.dir / HOOK_CLIENT_PYC)
        bind = getattr(self.dialect, "bind", None)  # optional: a dialect compiling the declaration into its files
        if bind is not None:
            bind(self.gate.task, self.gate.policy)
        for rel, text in self.dialect.files(self.hook_command(), self.dir).items():
            target = self.dir / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
        service = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                service.serve(self.request)

        self._server = _Server(str(self.socket_path), Handler, self.intake)
        os.chmod(self.socket_path, 0o666)  # the agent may run as another uid inside its user namespace
        self._thread = threading.Thread(target=self._server.serve_forever, name=f"gate-{self.job_id}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Closes the socket; then, when the host watched the CLI's stream, reconciles the decisions with it."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._watched:
            self.reconcile()

    def serve(self, sock: Any) -> None:
        """One connection: its request read within the intake's bounds, decided, answered."""
        raw, held = self.intake.read(sock)
        try:
            _send(sock, raw if isinstance(raw, Answer) else self.handle(raw))
        finally:
            self.intake.release(held)

    @property
    def flood(self) -> str | None:
        """The risk a job's result carries when its agent's side misused the gate socket, else None: flooded
        it (connections turned away), or asked it for calls the CLI never made (`forged`, after `stop`)."""
        risks = []
        counts = dict(self.summary.turned_away)
        if counts:
            why = "; ".join(f"{n} for {TURNED_AWAY[r]}" for r, n in sorted(counts.items()))
            risks.append(f"the gate socket was flooded: {sum(counts.values())} connection(s) turned away ({why})")
        if self.forged:
            more = f" (+{len(self.forged) - 5} more)" if len(self.forged) > 5 else ""
            risks.append(f"{len(self.forged)} call(s) were asked of the gate that the CLI's own stream never "
                         f"showed (forged by a process in the job; not counted as decisions): "
                         f"{', '.join(self.forged[:5])}{more}")
        return "; ".join(risks) or None

    def handle(self, raw: bytes) -> Answer:
        t0 = time.monotonic()
        try:
            if len(raw) > MAX_REQUEST:
                raise ValueError("request too large")
            req = json.loads(raw)
            event = str(req.get("event", ""))
            payload = json.loads(req.get("payload") or "{}")
            if not isinstance(payload, dict):
                raise ValueError("the hook's input is not a JSON object")
        except (ValueError, RecursionError, AttributeError) as exc:
            return Answer(stderr=f"[proctor GATE_UNAVAILABLE] unreadable hook input: {exc}"[:500], exit=2)
        if event == "SessionStart":
            with self._lock:
                self.summary.armed = True
            self._write("gate.armed", {"jobId": self.job_id, "cli": self.dialect.name})
            return Answer()
        if event != "PreToolUse":
            return Answer(stderr=f"[proctor GATE_UNAVAILABLE] unknown hook event {event[:60]!r}", exit=2)
        call = self.dialect.call(payload, self.worktree)
        digest = input_digest(call.get("arguments"), self.worktree, tool=str(call.get("tool", "")))
        with self._lock:  # one decision at a time: the gate counts calls, the ledger chains rows
            self._latency = t0
            self._digest = digest
            self._call = call
            try:
                decision = self.gate.decide(call)
            except Exception as exc:  # noqa: BLE001 - a gate or ledger failure denies the call
                self.failures.append(str(exc)[:300])
                return Answer(stderr=f"[proctor GATE_UNAVAILABLE] the call could not be decided: {exc}"[:500],
                              exit=2)
            self.summary.decided += 1
            if decision.verdict is CallVerdict.refused:
                self.summary.refused += 1
            self.summary.by_code[decision.code.value] = self.summary.by_code.get(decision.code.value, 0) + 1
            if decision.call_id:
                self.seen[decision.call_id] = decision.verdict.value
            self.decisions.append(Decided(decision.call_id, decision.tool, decision.verdict.value,
                                          decision.code.value))
            if decision.code is GateCode.APPROVAL_REQUIRED:
                self.held.append({"call_id": decision.call_id, "tool": decision.tool, "input_sha256": digest,
                                  "reason": decision.reason})
        return self.dialect.answer(decision)

    def _row(self, d: Decision) -> None:
        # Before the decision takes effect: a call whose row cannot be written is not allowed (the gate's
        # caller sees the exception and denies).
        self._write("gate.call", {"jobId": self.job_id, "cli": self.dialect.name, "ticket": self.ticket,
                                  "repo": self.repo, "tool": d.tool[:200],
                                  "call_id": d.call_id[:200], "input_sha256": self._digest,
                                  "verdict": d.verdict.value, "code": d.code.value, "reason": d.reason[:500],
                                  "latency_ms": round((time.monotonic() - self._latency) * 1000, 2),
                                  **({"held": held_call(self._call, self.worktree)}
                                     if d.code is GateCode.APPROVAL_REQUIRED else {})})

    def _grant(self, call: Any) -> str | None:
        """The unused one-time grant a person gave this ticket for exactly this call (tool and canonical input,
        `input_digest`), used up here: a `gate.grant_used` row claiming it. None: the call stays held.

        The claim is the ledger's compare-and-set (`claim_once`): of two jobs of a ticket asking at once, in
        two processes, one gets the grant and the other tries the next one or stays held."""
        used = {r.payload.get("grant") for r in self.ledger.rows(kind="gate.grant_used")}  # rows before claims
        for row in self.ledger.rows(kind="gate.grant"):
            p = row.payload
            if (row.id in used or p.get("ticket") != self.ticket or p.get("repo") != self.repo
                    or p.get("tool") != call.tool or p.get("input_sha256") != self._digest):
                continue
            claimed = self.ledger.claim_once("gate.grant_used", grant_claim(row.id),
                                             {"jobId": self.job_id, "grant": row.id, "call_id": call.call_id},
                                             job_id=self.job_id)
            if claimed is not None:
                return f"grant #{row.id} by {p.get('by') or 'a person'}"
        return None

    def _write(self, kind: str, payload: dict[str, Any]) -> None:
        self.ledger.append(kind, payload, job_id=self.job_id)

    @property
    def bypassed(self) -> list[str]:
        """Tool calls the CLI's own output showed that the gate never decided (a hook that did not run), and
        a line of that output too long to read whole (its calls cannot be reconciled: fail closed)."""
        found = [f"{name} ({cid})" for cid, name in self.streamed.items() if cid not in self.seen]
        if self._lines.over:
            found.append(f"a line of the CLI's output over {self._lines.limit} bytes (not reconciled)")
        return found

    def watch(self) -> Callable[[str, bytes], str | None]:
        """Reads the CLI's output stream as it comes, in whole lines of any length up to MAX_STREAM_LINE:
        keeps every tool call it shows (for `bypassed` and `reconcile`), and ends the run at the first one
        made while the CLI's hooks never said they were loaded (the session-start hook runs before the
        model is first asked), or at a line too long to read whole. A dialect's `stream_marks` (optional)
        name the lines its `tool_uses` reads; claude's are those with `"tool_use"`."""
        self._watched = True

        def watch(stream: str, chunk: bytes) -> str | None:
            if stream != "stdout":
                return None
            lines = self._lines.feed(chunk)
            if self._lines.over:
                return (f"bypass: a line of the CLI's output passed {self._lines.limit} bytes; its tool calls "
                        "cannot be reconciled with the gate's decisions")
            return self._take(lines)

        return watch

    def _take(self, lines: list[bytes]) -> str | None:
        marks: tuple[bytes, ...] = getattr(self.dialect, "stream_marks", (b'"tool_use"',))
        text = b"\n".join(ln for ln in lines if any(m in ln for m in marks)).decode("utf-8", "replace")
        uses = self.dialect.tool_uses(text) if text else []
        self.streamed.update(uses)
        if uses and not self.summary.armed:
            return "bypass: a tool call before the gate's hook was armed"
        return None

    def reconcile(self) -> list[str]:
        """After the CLI exited: the decisions its own stream never showed, as `tool (call id)`, taken out of
        the counts (decided, refused, by code, held) into `forged`, with a `gate.forged` row.

        Any process in the job can ask the gate socket: the hook runs as the same user in the same sandbox
        as the agent's tools, so no secret of the hook's is out of their reach (README, "Who speaks to the
        gate"). A row the CLI's stream does not account for is therefore not a decision but a risk. Each
        streamed call confirms one decision of its id; a dialect's `confirms(tool, verdict)` (optional)
        names the decisions its stream can show at all (codex shows no refused call)."""
        with self._lock:
            if self._reconciled:
                return self.forged
            self._reconciled = True
            self._take([self._lines.rest()])  # a last line with no newline is a line too
            shown = Counter(self.streamed.keys())
            confirms = getattr(self.dialect, "confirms", None)
            for d in self.decisions:
                if confirms is not None and not confirms(d.tool, d.verdict):
                    continue
                if shown[d.call_id] > 0:
                    shown[d.call_id] -= 1
                else:
                    self._discount(d)
        if self.forged:
            try:
                self._write("gate.forged", {"jobId": self.job_id, "cli": self.dialect.name,
                                            "count": len(self.forged), "calls": self.forged[:100],
                                            "call_ids": self._forged_ids[:1000]})
            except Exception as exc:  # noqa: BLE001 - the result still carries the risk
                self.failures.append(f"the gate.forged row could not be written: {exc}"[:300])
        return self.forged

    def _discount(self, d: Decided) -> None:
        s = self.summary
        s.decided -= 1
        s.forged += 1
        if d.verdict == CallVerdict.refused.value:
            s.refused -= 1
        s.by_code[d.code] = s.by_code.get(d.code, 1) - 1
        if not s.by_code[d.code]:
            del s.by_code[d.code]
        held = next((h for h in self.held if h["call_id"] == d.call_id), None)
        if held is not None:
            self.held.remove(held)
        self.forged.append(f"{d.tool[:100]} ({d.call_id[:100]})")
        self._forged_ids.append(d.call_id[:200])  # as the gate.call row keeps it: `proctor approve` refuses it


@dataclass(frozen=True)
class Decided:
    call_id: str
    tool: str
    verdict: str
    code: str


# The longest line of a CLI's output stream read whole (held in the host while it comes). A CLI's own
# lines are far shorter (its tool results are cut well below this); a longer one fails closed (BYPASS):
# keeping only its last 1,000,000 bytes let a tool call on such a line escape reconciliation (issue 22).
MAX_STREAM_LINE = 32 * 1024 * 1024


class StreamLines:
    """A byte stream cut into whole lines of any length up to `limit`. Past the limit `over` is set for good
    and the line's bytes are dropped (never held): the caller fails closed."""

    def __init__(self, limit: int = MAX_STREAM_LINE) -> None:
        self.limit = limit
        self.over = False
        self._parts: list[bytes] = []  # the line in progress, joined once whole (no quadratic copying)
        self._held = 0

    def feed(self, chunk: bytes) -> list[bytes]:
        pieces = chunk.split(b"\n")
        tail = pieces.pop()
        lines = []
        if pieces:
            first = pieces[0]
            if not self._keep(first):
                lines.append(b"".join(self._parts))
            self._parts, self._held = [], 0
            lines.extend(pieces[1:])
        self._keep(tail)
        if any(len(ln) > self.limit for ln in lines):
            self.over = True
        return [ln for ln in lines if len(ln) <= self.limit]

    def _keep(self, piece: bytes) -> bool:
        """Adds to the line in progress; True when that line is now over the limit (and so dropped)."""
        if self._held + len(piece) > self.limit:
            self.over = True
            self._parts, self._held = [], self.limit + 1  # dropped, and stays over until its newline
            return True
        if piece:
            self._parts.append(piece)
            self._held += len(piece)
        return False

    def rest(self) -> bytes:
        """The last line, when the stream ended without a newline (emptied)."""
        text = b"".join(self._parts) if self._held <= self.limit else b""
        self._parts, self._held = [], 0
        return text


def canonical_input(tool: str, arguments: Any, worktree: Path) -> str:
    """A call as a person's grant names it: JSON of the tool, its input with every occurrence of the job's
    worktree path cut out of its strings, and where each was cut (`worktree_at`: [JSON path, offsets]).
    The same call in the next job of a ticket (another worktree) reads the same; no input can read like
    another, since the cuts are structure no string can spell. The worktree was once written as the text
    `<worktree>`, so an input holding that text itself matched: an approved `cat <path> calc.py` let
    `cat <worktree> calc.py` run (issue 22, item 6)."""
    cuts: list[list[Any]] = []
    shape = _cut(arguments, str(worktree), [], cuts) if str(worktree) not in ("", "/", ".") else arguments
    return json.dumps({"tool": tool, "input": shape, "worktree_at": cuts}, sort_keys=True, default=str,
                      separators=(",", ":"))


def _cut(value: Any, worktree: str, where: list[Any], cuts: list[list[Any]]) -> Any:
    if isinstance(value, str):
        pieces = value.split(worktree)
        if len(pieces) > 1:
            ends = [sum(len(p) for p in pieces[:i + 1]) for i in range(len(pieces) - 1)]
            cuts.append([where, ends])
        return "".join(pieces)
    if isinstance(value, list):
        return [_cut(v, worktree, [*where, i], cuts) for i, v in enumerate(value)]
    if isinstance(value, dict):  # keys kept as they are: a key naming the worktree matches only itself
        return {k: _cut(value[k], worktree, [*where, k], cuts) for k in sorted(value, key=str)}
    return value


def input_digest(arguments: Any, worktree: Path, *, tool: str) -> str:
    """sha256 of `canonical_input`: what a held call, its grant and `proctor approve --digest` name."""
    return hashlib.sha256(canonical_input(tool, arguments, worktree).encode()).hexdigest()


def grant_claim(grant_row: int) -> str:
    """The key a grant is used up under (`Ledger.claim_once` of `gate.grant_used`)."""
    return f"gate.grant#{grant_row}"


# The held call's input kept in its `gate.call` row, for the person asked to approve it (`proctor approve`
# shows it, escaped and cut shorter). Longer inputs are kept cut, and say so.
HELD_INPUT_MAX = 64 * 1024


def held_call(call: dict[str, Any], worktree: Path) -> dict[str, Any]:
    """What a held call would do, as its ledger row keeps it: tool, paths, input (cut), the worktree."""
    text = json.dumps(call.get("arguments"), sort_keys=True, ensure_ascii=False, default=str)
    paths = [str(p)[:4096] for p in (call.get("paths") or [])][:50]
    return {"tool": str(call.get("tool", ""))[:200], "paths": paths, "input": text[:HELD_INPUT_MAX],
            "input_chars": len(text), "worktree": str(worktree)}


def compile_client(source: Path, target: Path) -> None:
    """The hook client compiled by this interpreter (the one `hook_command` names, so its bytecode version),
    unchecked against its source: the hook runs it as its script, which never consults a source anyway. A
    failure is an OSError, as for the other files `start` writes."""
    try:
        py_compile.compile(str(source), cfile=str(target), doraise=True, optimize=0,
                           invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    except py_compile.PyCompileError as exc:
        raise OSError(f"the hook client did not compile: {exc.msg}") from exc


def settings_path(dir: Path, cli: str) -> Path:
    return dir / f"{cli}-settings.json"
