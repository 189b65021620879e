"""Codex CLI 0.171's hook dialect for a job's gate service (proctor.mechanisms.gatekeeper.service).

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
`{command: <the command>}`, with the call's `workdir` as the payload's `cwd` (taken into the call's input);
`apply_patch` with `{command: <the patch>}` (a function call or code mode's
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
import os
import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from proctor.mechanisms.gatekeeper.dialect import Answer, settings_path
from proctor.mechanisms.gatekeeper.hook import HOOK_TIMEOUT_S, shell_word
from proctor.mechanisms.policy.gate import CallVerdict, Decision
from proctor.mechanisms.policy.task import Effect

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
# How an item shows a command: the shell codex ran it with (`/bin/bash -lc <word>`), then the command.
_SHELL_PREFIX = re.compile(r"^\s*(?:\S*/)?(?:bash|zsh|sh|dash)\s+-l?c\s+")
_QUOTING = re.compile(r"[\s'\"\\]+")
ITEM_KINDS = {"command_execution": "exec", "file_change": "patch", "mcp_tool_call": "mcp"}

# --- codex's patch grammar, as codex-rs/apply-patch/src/parser.rs parses it (lenient mode, the only one it
# uses) --------------------------------------------------------------------------------------------------
# The gate must see every file a patch touches exactly as codex will: a regex anchored at the line start
# missed a header codex trims (`  *** Add File: ../x`), and that hunk wrote outside the worktree (issue 22,
# item 1). So this is a line-for-line port: same trims, same prefixes, same hunk ends; what codex would
# reject is a PatchError here too, and a call the gate cannot parse is refused, never guessed at.
BEGIN, END = "*** Begin Patch", "*** End Patch"
ADD, DELETE, UPDATE, MOVE = "*** Add File: ", "*** Delete File: ", "*** Update File: ", "*** Move to: "
EOF_MARK = "*** End of File"
# Rust's `char::is_whitespace` (Unicode White_Space): what `str::trim` strips. Python's `str.strip()` also
# strips U+001C..U+001F, which Rust keeps: a header padded with one is no header to codex.
_RUST_WS = ("\t\n\x0b\x0c\r \x85\xa0\u1680" + "".join(map(chr, range(0x2000, 0x200B)))
            + "\u2028\u2029\u202f\u205f\u3000")
_HEREDOC_OPENERS = ("<<EOF", "<<'EOF'", '<<"EOF"')
# `cd <dir> && apply_patch <<'EOF' ... EOF`, the one shell form codex intercepts and applies itself (its
# invocation.rs tree-sitter query; the patch then resolves against cwd/<dir>). Deliberately narrower than
# that query: a command naming apply_patch with a patch in it that this does not match is refused.
_HEREDOC = re.compile(
    r"\A(?:cd[ \t]+(?P<cd>[A-Za-z0-9_./@%+=:,-]+|'[^'\n]*')[ \t]*&&[ \t]*)?"
    r"(?:apply_patch|applypatch)[ \t]*<<[ \t]*(?P<q>['\"]?)(?P<tag>[A-Za-z_][A-Za-z0-9_]*)(?P=q)[ \t]*\n"
    r"(?P<body>(?:.*\n)*?)(?P=tag)\n?\Z")
_LONE_CR = re.compile(r"\r(?!\n)")
_NAMES_PATCH = re.compile(r"\b(?:apply_patch|applypatch)\b")


class PatchError(ValueError):
    """A patch codex would not apply as written, or one the gate cannot read exactly as codex does."""


@dataclass(frozen=True)
class Hunk:
    op: str  # add | delete | update
    path: str
    move_to: str | None = None

    @property
    def paths(self) -> tuple[str, ...]:
        return (self.path,) if self.move_to is None else (self.path, self.move_to)


def _trim(s: str) -> str:
    return s.strip(_RUST_WS)


def _lines(s: str) -> list[str]:
    """Rust's `str::lines`: split on \\n, a \\r before it dropped, no last empty line. Not `splitlines`,
    which also splits on \\v, \\f, \\x1c-\\x1e, \\x85 and U+2028/9: a header hidden behind one of those is a
    line of its own to Python and part of another line to codex."""
    parts = s.split("\n")
    last = parts.pop()  # the one part no \\n ends: its \\r stays, as in Rust
    lines = [p.removesuffix("\r") for p in parts]
    return [*lines, last] if last else lines


def _body(lines: list[str]) -> list[str]:
    """The hunk lines between the markers: strict first, then codex's lenient `<<EOF ... EOF` wrapper."""
    def strict(ls: list[str]) -> list[str] | None:
        if ls and _trim(ls[0]) == BEGIN and _trim(ls[-1]) == END and len(ls) >= 2:
            return ls[1:-1]
        return None

    found = strict(lines)
    if found is None and len(lines) >= 4 and lines[0] in _HEREDOC_OPENERS and lines[-1].endswith("EOF"):
        found = strict(lines[1:-1])
    if found is None:
        raise PatchError("the patch must start with '*** Begin Patch' and end with '*** End Patch'")
    return found


def _chunk(lines: list[str], first: bool) -> int:
    """How many lines one update chunk takes (parse_update_file_chunk)."""
    if lines[0] == "@@" or lines[0].startswith("@@ "):
        start = 1
    elif first:
        start = 0
    else:
        raise PatchError(f"expected an update chunk to start with @@, got {lines[0][:80]!r}")
    if start >= len(lines):
        raise PatchError("an update chunk has no lines")
    taken = 0
    for line in lines[start:]:
        if line == EOF_MARK:
            if taken == 0:
                raise PatchError("an update chunk has no lines")
            taken += 1
            break
        if line[:1] in ("", " ", "+", "-"):
            taken += 1
        elif taken == 0:
            raise PatchError(f"unexpected line in an update chunk: {line[:80]!r}")
        else:
            break
    return taken + start


def _hunk(lines: list[str]) -> tuple[Hunk, int]:
    """One hunk from the start of `lines`, and how many lines it took (parse_one_hunk)."""
    first = _trim(lines[0])
    if first.startswith(ADD):
        n = 1
        while n < len(lines) and lines[n].startswith("+"):
            n += 1
        return Hunk("add", first[len(ADD):]), n
    if first.startswith(DELETE):
        return Hunk("delete", first[len(DELETE):]), 1
    if not first.startswith(UPDATE):
        raise PatchError(f"{first[:80]!r} is not a valid hunk header")
    path, move, n = first[len(UPDATE):], None, 1
    if len(lines) > 1 and lines[1].startswith(MOVE):  # untrimmed, as codex reads it
        move, n = lines[1][len(MOVE):], 2
    chunks = 0
    while n < len(lines):
        if not _trim(lines[n]):
            n += 1
            continue
        if lines[n].startswith("*"):
            break
        n += _chunk(lines[n:], first=chunks == 0)
        chunks += 1
    if chunks == 0:
        raise PatchError(f"the update hunk for {path[:80]!r} is empty")
    return Hunk("update", path, move), n


def parse_patch(text: str) -> list[Hunk]:
    """Every hunk of an apply_patch text, as codex 0.171 parses it; PatchError where codex would fail."""
    if _LONE_CR.search(text):
        # Measured against codex 0.171's apply_patch: a \r that ends no line vanished from the path it sat
        # in (`..\r/` would become `../`). Not in the parser source read here, so not mirrored: refused.
        raise PatchError("a carriage return that ends no line (codex drops it; the gate does not guess how)")
    lines = _body(_lines(_trim(text)))
    hunks, i = [], 0
    while i < len(lines):
        hunk, n = _hunk(lines[i:])
        hunks.append(hunk)
        i += n
    return hunks


def shell_patch(command: str) -> tuple[str, str | None] | None:
    """(patch, cd dir) when a shell command is one codex applies itself (`[cd DIR &&] apply_patch <<EOF`);
    None when it names no patch. PatchError when it names apply_patch and holds a patch in a form the gate
    cannot tell codex's reading of (the shell would run codex's `apply_patch` alias with it)."""
    m = _HEREDOC.match(command.strip())
    if m is not None:
        cd = m.group("cd")
        return m.group("body").rstrip("\n"), (cd[1:-1] if cd and cd.startswith("'") else cd)
    if _NAMES_PATCH.search(command) and BEGIN in command:
        raise PatchError("a shell command runs apply_patch in a form the gate cannot read as codex does")
    return None


def patch_paths(text: str) -> list[str]:
    """Every file an apply_patch text adds, updates, deletes or moves to, as codex reads them."""
    return [p for h in parse_patch(text) for p in h.paths]


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
        written, paths, unparsed = self._written(tool, text, cwd)
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
        if tool == "Bash":
            # exec_command's `workdir` reaches the hook only as its `cwd` (measured on 0.171: a call with
            # workdir /etc came as cwd "/etc", tool_input {command} alone). It is part of what runs: in the
            # call's input, so a person's grant covers it (issue 41), and a path the gate checks when it is not
            # the session's own directory.
            args = {**args, "workdir": cwd}
            if os.path.normpath(cwd) != os.path.normpath(str(worktree)):
                paths = [cwd, *paths]
        call = {"tool": tool, "arguments": args, "paths": paths, "call_id": call_id}
        return {**call, "unparsed": unparsed} if unparsed else call

    @staticmethod
    def _written(tool: str, text: str, cwd: str) -> tuple[list[str], list[str], str]:
        """The files a call's patch touches, as written and as paths for the gate (relative to the session's
        cwd, or to `cd DIR` of a shell-form patch), and why the input cannot be read as codex reads it ("")
        when it cannot: then the gate refuses the call rather than decide a guess."""
        if tool not in ("apply_patch", "Bash"):
            return [], [], ""
        try:
            if tool == "Bash":
                found = shell_patch(text)
                if found is None:
                    return [], [], ""
                text, cd = found
                if cd:
                    cwd = cd if cd.startswith("/") else f"{cwd.rstrip('/')}/{cd}"
            written = patch_paths(text)
        except PatchError as exc:
            return [], [], f"codex's apply_patch grammar: {exc}"
        if any(not p or "\x00" in p for p in written):
            return [], [], "codex's apply_patch grammar: a hunk names an empty path"
        return written, [p if p.startswith("/") else f"{cwd.rstrip('/')}/{p}" for p in written], ""

    def answer(self, d: Decision) -> Answer:
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
        if _UNSAFE_DIR.search(str(dir)):
            raise OSError(f"the gate dir {str(dir)!r} has a character codex's hook command cannot carry")
        client = " ".join(shell_word(a) for a in hook)
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

    def confirms(self, tool: str, verdict: str) -> bool:
        """Whether codex's `--json` stream shows a call like this when codex made it (GateService.reconcile):
        only granted ones, of the kinds that have items (a refused call, `webrun`, MCP resources show none)."""
        return verdict == CallVerdict.run.value and (tool in ("Bash", "apply_patch") or tool.startswith("mcp__"))

    def tool_uses(self, stdout: str) -> list[tuple[str, str]]:
        """(call id, tool name) of every tool item in codex's `--json` stream: the id of the granted call it
        matches, or the item's own id when none does."""
        found = []
        # Split on newlines only: str.splitlines also splits on U+2028, which a CLI's JSON carries raw
        # (Node's JSON.stringify), so a tool call holding one was never read (issue 22).
        for line in stdout.split("\n"):
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
