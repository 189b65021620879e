"""A job's gate service: every tool call the agent's CLI asks for is decided by proctor's gate before it runs.

Owns the per-job Unix socket the CLI's hook (`proctor/mechanisms/gatekeeper/hook_client.py`) asks on, turning each CLI's hook JSON
into the gate's `ToolCall` (a dialect per CLI), one ledger row per call (`gate.call`: job, CLI, tool, call id,
input digest, verdict, code, latency), the answer in the CLI's own form with the reason the model sees
(`[proctor CODE] ...`), the "armed" mark (the CLI's session-start hook ran: its hooks are loaded), and the
files that install the hook for one job only (outside the worktree, read-only to the agent). It is the job's
single ledger writer for calls: hooks run concurrently, their decisions are made one at a time.

It never runs a tool and never trusts the CLI to honour an answer: the host reconciles the CLI's own output
stream against the calls decided here (`unmatched`), and OS confinement stays the backstop.

The pieces it composes are its siblings: the dialects (claude, codex, gemini, opencode) below it, each
speaking the `dialect` seam; `hook` (the installed client), `intake` (the socket's bounds and server), `task` (the task
decided against), `grant` (how a call is named for a person's grant) and `stream` (the CLI's output lines).
"""

from __future__ import annotations

import json
import os
import socketserver
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from proctor.mechanisms.gatekeeper.claude import ClaudeDialect
from proctor.mechanisms.gatekeeper.codex import CodexDialect
from proctor.mechanisms.gatekeeper.dialect import Answer, Dialect
from proctor.mechanisms.gatekeeper.gemini import GeminiDialect
from proctor.mechanisms.gatekeeper.grant import grant_claim, held_call, input_digest
from proctor.mechanisms.gatekeeper.hook import client_command, install_client
from proctor.mechanisms.gatekeeper.intake import MAX_REQUEST, TURNED_AWAY, GateServer, Intake, send_answer
from proctor.mechanisms.gatekeeper.opencode import OpencodeDialect
from proctor.mechanisms.gatekeeper.stream import StreamLines
from proctor.mechanisms.gatekeeper.task import measured
from proctor.mechanisms.gatekeeper.task import row as table_row
from proctor.mechanisms.ledger.store import Ledger
from proctor.mechanisms.policy.gate import CallVerdict, Decision, Gate, GateCode
from proctor.mechanisms.policy.task import AgentTask
from proctor.mechanisms.policy.trusted import Policy

# Keep in step with adapters.spec.GATE_DIALECTS.
DIALECTS: dict[str, Callable[[], Dialect]] = {"claude": ClaudeDialect, "codex": CodexDialect,
                                              "gemini": GeminiDialect, "opencode": OpencodeDialect}


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
        self.announced: set[str] = set()  # the tools the CLI said it has at start (a dialect's `announced`)
        self.gate = Gate(measured(task, dialect.tools), policy=policy, dry_run=False, stop=stop,
                         on_decision=self._row, approved=self._grant)
        self.summary = Summary()
        self.intake = Intake(self.summary.turned_away)
        self.seen: dict[str, str] = {}  # call id -> verdict
        self.decisions: list[Decided] = []  # every call decided here, in order (reconcile)
        self.forged: list[str] = []  # decisions the CLI's own stream never showed: "tool (call id)"
        self._forged_ids: list[str] = []
        self._unread: list[str] = []  # records of the CLI's that `account` could not read whole
        self.failures: list[str] = []
        self._lines = StreamLines()
        self._watched = False  # reconciled only against a stream the host watched (`watch`)
        self._reconciled = False
        self._call: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._server: GateServer | None = None
        self._thread: threading.Thread | None = None
        self._latency = 0.0
        self._digest = ""

    @property
    def socket_path(self) -> Path:
        return self.dir / "gate.sock"

    def hook_command(self) -> list[str]:
        """The hook as the CLI runs it, with the paths it has inside the sandbox."""
        return client_command(self.dir, self.dir / "gate.sock", self.dialect.name)

    def start(self) -> GateService:
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        install_client(self.dir)
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

        self._server = GateServer(str(self.socket_path), Handler, self.intake)
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
            send_answer(sock, raw if isinstance(raw, Answer) else self.handle(raw))
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

    @property
    def unlisted(self) -> list[str]:
        """The tools the CLI announced that its table lacks (a newer CLI's), each decided as UNKNOWN: `shell`
        and online. A user's program behind COMMAND_PREFIXES is `shell` by name and is not listed."""
        return sorted(n for n in self.announced if table_row(n, self.dialect.tools) is None)

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

    def account(self, uses: list[tuple[str, str]], unread: list[str]) -> None:
        """Tool calls the CLI shows outside its stream (a dialect's `journal`: claude's workflow sub-agents'
        transcripts), taken as if streamed, before `stop` reconciles; `unread`, the records too large to
        read whole, fail closed as a line too long does (`bypassed`)."""
        with self._lock:
            self.streamed.update(uses)
            self._unread += unread

    @property
    def bypassed(self) -> list[str]:
        """Tool calls the CLI's own output showed that the gate never decided (a hook that did not run), and
        a line of that output too long to read whole (its calls cannot be reconciled: fail closed)."""
        found = [f"{name} ({cid})" for cid, name in self.streamed.items() if cid not in self.seen]
        if self._lines.over:
            found.append(f"a line of the CLI's output over {self._lines.limit} bytes (not reconciled)")
        found += [f"a sub-agent record too large or odd to read ({n}; not reconciled)" for n in self._unread[:5]]
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
        announced = getattr(self.dialect, "announced", None)
        if announced is not None and text:
            self.announced.update(announced(text))
        if uses and not self.summary.armed:
            return "bypass: a tool call before the gate's hook was armed"
        return None

    def reconcile(self) -> list[str]:
        """After the CLI exited: the decisions its own stream never showed, as `tool (call id)`, taken out of
        the counts (decided, refused, by code, held) into `forged`, with a `gate.forged` row.

        Any process in the job can ask the gate socket: the hook runs as the same user in the same sandbox
        as the agent's tools, so no secret of the hook's is out of their reach (docs, "Who speaks to the
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
