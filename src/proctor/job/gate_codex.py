"""Codex CLI 0.171's hook dialect for a job's gate service (proctor.job.gatekeeper).

Installed for one job by the adapter's `gate_args` alone (builtin.toml, [agents.codex]): `-c hooks.PreToolUse=...`
and `-c hooks.SessionStart=...` (a config layer of this invocation only; ~/.codex is never written, and
CODEX_HOME stays where its auth is), `--dangerously-bypass-hook-trust` (without it codex silently skips every
hook that has no persisted trust: measured, research/gating.md), `--enable hooks` (a user's config cannot turn
them off), and the tools no hook sees switched off: `--disable unified_exec_tty` (`write_stdin` into a tty
session ran with no hook call; without a tty, stdin is closed and `write_stdin` only polls output),
`--disable view_image` (an unhooked file read) and `web_search="disabled"` (the provider-hosted search).

Each hook is `/bin/sh <gate dir>/codex-hook.sh EVENT || <deny>`: codex runs it with bash, and fails open on
every hook failure but exit 2 (a crash, a timeout, garbage, a missing interpreter all ran the tool:
measured), so the script turns any status of the hook client but 0 and 2 into exit 2 with the reason on
stderr, and the command line does the same when the script itself cannot run.

What the hook sees (measured on 0.171 against a scripted model): `tool_name` `Bash` for every shell tool
(`exec_command`, `shell`, `shell_command`, and code mode's nested `tools.exec_command`), `tool_input`
`{command: <the command>}`; `apply_patch` with `{command: <the patch>}` (a function call or code mode's
nested `tools.apply_patch`); `mcp__<server>__<tool>` with the MCP arguments, and `read_mcp_resource` (the
MCP resource tools: a task declares them, as it does MCP tools); `webrun` for `web__run`. Code
mode's `exec` (JavaScript in a V8 isolate: no file system, no network) is not hooked itself: each nested
call is. `tool_use_id` is the model's call id, or `exec-<uuid>` for a nested call.

Answers: a granted call is exit 0 with no output (0.171 treats `allow` without `updatedInput` as a failed
hook, which runs the tool anyway), a refused one `permissionDecision: "deny"` with `[proctor CODE] ...`,
which the model sees as `Command blocked by PreToolUse hook: [proctor CODE] .... Command: ...`.

Reconciliation: codex's `--json` items (`command_execution`, `file_change`, `mcp_tool_call`) carry ids of
their own (`item_3`), never the hook's `tool_use_id`, and a refused call shows no item at all. So each item
is matched to a call the gate granted, by what it did (the command, the patched files' names, the MCP tool),
falling back to the oldest granted call of the same kind; an item no granted call is left for keeps its own
id, and the gate service reports it (`bypassed`): a tool that ran without a gate row, or ran although refused.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from proctor.policy.gate import CallVerdict, Decision
from proctor.policy.task import Effect

if TYPE_CHECKING:
    from proctor.job.gatekeeper import Answer
# proctor.job.gatekeeper registers this dialect (DIALECTS), so its names are imported where they are used.

# The tool names codex 0.171's PreToolUse hook sends (module docstring), and what each does. MCP tools
# (`mcp__server__tool`) are the user's own servers: a task declares the ones it needs.
CODEX_TOOLS: dict[str, tuple[Effect, bool]] = {
    "Bash": (Effect.shell, False),
    "apply_patch": (Effect.write, False),
    "webrun": (Effect.network, True),
}
HOOK_SCRIPT = "codex-hook.sh"
# Characters that would break out of the hook command in gate_args (a TOML literal string holding a
# double-quoted shell word): a gate dir holding one is refused, never quoted around.
_UNSAFE_DIR = re.compile(r"[\"'$`\\\x00-\x1f\x7f]")
_PATCH_PATH = re.compile(r"^\*\*\* (?:Add File|Update File|Delete File|Move to): (.+?)\s*$", re.M)
# How an item shows a command: the shell codex ran it with (`/bin/bash -lc <word>`), then the command.
_SHELL_PREFIX = re.compile(r"^\s*(?:\S*/)?(?:bash|zsh|sh|dash)\s+-l?c\s+")
_QUOTING = re.compile(r"[\s'\"\\]+")
ITEM_KINDS = {"command_execution": "exec", "file_change": "patch", "mcp_tool_call": "mcp"}


def patch_paths(text: str) -> list[str]:
    """Every file an apply_patch text adds, updates, deletes or moves to, as written in it."""
    return [m.group(1) for m in _PATCH_PATH.finditer(text)] if "*** Begin Patch" in text else []


def command_key(command: str) -> str:
    """A command as codex's hook and its `--json` item both show it: the shell prefix, quoting and
    whitespace dropped (the item re-quotes the command; the two never differ in anything else)."""
    return _QUOTING.sub("", _SHELL_PREFIX.sub("", command, count=1))


def files_key(paths: Iterable[str]) -> str:
    return "|".join(sorted(PurePosixPath(p).name for p in paths))


@dataclass
class _Granted:
    call_id: str
    kinds: frozenset[str]
    keys: dict[str, str]  # kind -> what an item of that kind must show to be this call


class CodexDialect:
    """Codex's PreToolUse/SessionStart hooks (`-c hooks...`, `--dangerously-bypass-hook-trust`). One
    instance per job: it remembers the calls the gate granted, to match codex's `--json` items to them."""

    name = "codex"
    tools = CODEX_TOOLS
    stream_marks = (b'"item.',)  # the lines of its stream `tool_uses` reads (GateService.watch)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._asked: dict[str, _Granted] = {}  # call id -> the call, until the gate decides it
        self._granted: list[_Granted] = []  # granted, not yet matched to an item, oldest first
        self._items: dict[str, str] = {}  # item id -> the call id it was matched to (or its own id)
        self._fresh = 0

    def call(self, payload: dict[str, Any], worktree: Path) -> dict[str, Any]:
        tool = str(payload.get("tool_name", ""))
        raw = payload.get("tool_input")
        args = raw if isinstance(raw, dict) else {"input": raw}
        cwd = payload.get("cwd") if isinstance(payload.get("cwd"), str) and str(payload.get("cwd")).startswith("/") \
            else str(worktree)
        text = args.get("command") if isinstance(args.get("command"), str) else ""
        if tool == "apply_patch" and not text:
            text = next((v for v in args.values() if isinstance(v, str)), "")
        # A patch names its files relative to the session's cwd; a shell command may carry one too
        # (`apply_patch <<'EOF'`, which codex intercepts and applies itself).
        written = patch_paths(text) if tool in ("apply_patch", "Bash") else []
        paths = [p if p.startswith("/") else f"{cwd.rstrip('/')}/{p}" for p in written]
        call_id = str(payload.get("tool_use_id") or "")
        with self._lock:
            if not call_id:
                self._fresh += 1
                call_id = f"codex-call-{self._fresh}"
            keys: dict[str, str] = {}
            if tool == "Bash":
                keys["exec"] = command_key(text)
            if tool == "apply_patch" or written:
                keys["patch"] = files_key(written)
            if tool.startswith("mcp__"):
                keys["mcp"] = tool
            if keys and call_id not in self._asked:
                self._asked[call_id] = _Granted(call_id, frozenset(keys), keys)
        return {"tool": tool, "arguments": args, "paths": paths, "call_id": call_id}

    def answer(self, d: Decision) -> Answer:
        from proctor.job.gatekeeper import Answer

        with self._lock:
            asked = self._asked.pop(d.call_id, None)
            if asked is not None and d.verdict is CallVerdict.run:
                self._granted.append(asked)
        if d.verdict is CallVerdict.run:
            return Answer()
        out = {"hookSpecificOutput": {"hookEventName": "PreToolUse", "permissionDecision": "deny",
                                      "permissionDecisionReason": f"[proctor {d.code.value}] {d.reason}"}}
        return Answer(json.dumps(out))

    def files(self, hook: list[str], dir: Path) -> dict[str, str]:
        """The hook script gate_args run (`{gate_dir}/codex-hook.sh EVENT`), and the hook config they pass
        with `-c`, for the record (`result.gate.settings`)."""
        from proctor.job.gatekeeper import HOOK_TIMEOUT_S, _sh, settings_path

        if _UNSAFE_DIR.search(str(dir)):
            raise OSError(f"the gate dir {str(dir)!r} has a character codex's hook command cannot carry")
        client = " ".join(_sh(a) for a in hook)
        script = (
            "# proctor's gate hook for one codex job (written by its gate service; read-only to the agent).\n"
            "# Codex runs the tool on any hook failure but exit 2: every other status becomes a deny.\n"
            f'{client} "$1"\n'
            "s=$?\n"
            '[ "$s" = 0 ] || [ "$s" = 2 ] || {\n'
            '  echo "[proctor GATE_UNAVAILABLE] the hook client exited $s" >&2; s=2; }\n'
            'exit "$s"\n')
        record = {"installed_by": "the adapter's gate_args: -c hooks.<event>=[...] per event",
                  "events": ["SessionStart", "PreToolUse"], "script": str(dir / HOOK_SCRIPT),
                  "command": f'/bin/sh "{dir / HOOK_SCRIPT}" <event> || <exit 2>', "timeout_s": HOOK_TIMEOUT_S}
        return {HOOK_SCRIPT: script, settings_path(dir, self.name).name: json.dumps(record, indent=1)}

    def env(self, dir: Path) -> dict[str, str]:
        """None: gate_args name the hook; CODEX_HOME (and so the user's auth) stays as it is."""
        return {}

    def tool_uses(self, stdout: str) -> list[tuple[str, str]]:
        """(call id, tool name) of every tool item in codex's `--json` stream: the id of the granted call it
        matches, or the item's own id when none does."""
        found = []
        for line in stdout.splitlines():
            if '"item.' not in line:
                continue
            try:
                ev = json.loads(line)
            except (ValueError, RecursionError):
                continue
            item = ev.get("item") if isinstance(ev, dict) and str(ev.get("type", "")).startswith("item.") else None
            kind = ITEM_KINDS.get(str(item.get("type"))) if isinstance(item, dict) else None
            if kind is None or not isinstance(item, dict):
                continue
            key, name = self._item_key(kind, item)
            with self._lock:
                item_id = str(item.get("id", "")) or f"{kind}-item-{len(self._items) + 1}"
                if item_id not in self._items:
                    self._items[item_id] = self._match(kind, key) or item_id
                found.append((self._items[item_id], name))
        return found

    @staticmethod
    def _item_key(kind: str, item: dict[str, Any]) -> tuple[str, str]:
        if kind == "exec":
            return command_key(str(item.get("command", ""))), "Bash"
        if kind == "patch":
            changes = item.get("changes") if isinstance(item.get("changes"), list) else []
            paths = [str(c.get("path", "")) for c in changes if isinstance(c, dict)]
            paths += [str(c["move_path"]) for c in changes if isinstance(c, dict) and c.get("move_path")]
            return files_key(paths), "apply_patch"
        tool = f"mcp__{item.get('server', '')}__{item.get('tool', '')}"
        return tool, tool

    def _match(self, kind: str, key: str) -> str | None:
        """The granted call this item is (under the lock): the oldest with the same key, else the oldest of
        the same kind (a command shown differently is still the call that was granted); popped."""
        same = [g for g in self._granted if kind in g.kinds]
        hit = next((g for g in same if g.keys.get(kind) == key), same[0] if same else None)
        if hit is None:
            return None
        self._granted.remove(hit)
        return hit.call_id
