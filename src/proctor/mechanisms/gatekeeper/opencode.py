"""OpenCode 1.18's hook dialect for a job's gate service (proctor.mechanisms.gatekeeper.service).

OpenCode has no hook that runs a command; its plugins (JavaScript modules it loads in-process) have
`tool.execute.before`, which runs before every tool call and refuses it by throwing (measured on 1.18.33
against a scripted model: the tool never ran, the model heard the error). For one job only, never the
user's ~/.config/opencode:

- the plugin (`opencode_gate.mjs`, written into the gate dir, read-only to the agent) asks proctor's gate
  through the same hook client the other CLIs run, once per call, and throws on a refusal or on any failure
  to get an answer. It is named in `OPENCODE_CONFIG_CONTENT`, the config layer opencode merges last.
- **Fail-closed by construction, not after the fact**: opencode's stream shows a tool call only once it has
  run, so "armed before the first call" could only be checked too late. The job's config therefore enables
  no model provider but a lock (`enabled_providers = [LOCK]`), which the plugin lifts in its `config` hook
  only when the gate answered its session-start ping. A plugin that did not load (measured: removed from the
  config, the CLI made no model request at all and exited 1), or a gate that did not answer, leaves the CLI
  nothing to ask for a tool call. A user's own `enabled_providers` is lifted with the lock (a job's config
  cannot tell the two apart).
- Its sub-agents (`task`) are switched off (`OPENCODE_PERMISSION`, the layer applied over every config):
  their calls pass the plugin too, but its `run --format json` stream shows only the main session's, so
  they could not be reconciled and would read as forged.
- `OPENCODE_DISABLE_PROJECT_CONFIG` keeps a repo's `opencode.json` and `.opencode/` (plugins included, which
  would load beside the gate's and could rewrite a call's arguments after it was decided) out of the job.

What is not gated: opencode's own work between calls (its LSP servers, started by the CLI on files it
edits), and plugins of the user's own config (loaded before the gate's, so the gate sees the arguments they
left); OS confinement bounds both.

Reconciliation: the stream's `tool_use` events carry the model's call id (`part.callID`), the id the plugin
sends, for a granted call (`completed`) and a refused one (`error`) alike.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from proctor.mechanisms.gatekeeper.codex import PatchError, patch_paths
from proctor.mechanisms.gatekeeper.dialect import Answer, reason, settings_path
from proctor.mechanisms.gatekeeper.stream import json_events
from proctor.mechanisms.policy.gate import CallVerdict, Decision
from proctor.mechanisms.policy.task import Effect

# OpenCode 1.18.33's built-in tools (the names its requests offer the model, and the binary's tool ids) and
# what each does. `skill` loads a skill's instructions, `lsp` queries the language servers it starts, `batch`
# runs other tools: each can run programs, so `shell`, as claude's Skill and LSP. `task` is a sub-agent
# with every tool (switched off for a job: module docstring).
OPENCODE_TOOLS: dict[str, tuple[Effect, bool]] = {
    "bash": (Effect.shell, False), "skill": (Effect.shell, False), "lsp": (Effect.shell, False),
    "batch": (Effect.shell, False), "task": (Effect.shell, False),
    "write": (Effect.write, False), "edit": (Effect.write, False), "multiedit": (Effect.write, False),
    "patch": (Effect.write, False), "apply_patch": (Effect.write, False),
    "read": (Effect.read, False), "glob": (Effect.read, False), "grep": (Effect.read, False),
    "list": (Effect.read, False),
    "webfetch": (Effect.network, True), "websearch": (Effect.network, True), "codesearch": (Effect.network, True),
    "todowrite": (Effect.none, False), "todoread": (Effect.none, False), "question": (Effect.none, False),
    "invalid": (Effect.none, False),  # what opencode runs for a call it could not parse: an error text
}
PLUGIN = "opencode-gate.mjs"
# The one provider the job's config enables until the plugin, armed, lifts it: a name no provider has.
LOCK = "proctor-gate-not-loaded"
_PATCH_TOOLS = ("apply_patch", "patch")


class OpencodeDialect:
    """OpenCode's `tool.execute.before` plugin, installed by `OPENCODE_CONFIG_CONTENT` (module docstring)."""

    name = "opencode"
    tools = OPENCODE_TOOLS

    def call(self, payload: dict[str, Any], worktree: Path) -> dict[str, Any]:
        tool = str(payload.get("tool", ""))
        args = payload.get("args") if isinstance(payload.get("args"), dict) else {}
        call: dict[str, Any] = {"tool": tool, "arguments": args, "call_id": str(payload.get("callID", ""))}
        effect = self.tools.get(tool, (None, False))[0]
        paths = [str(args[k]) for k in ("filePath", "path", "workdir") if isinstance(args.get(k), str) and args[k]]
        if tool in _PATCH_TOOLS:
            try:
                paths = patch_paths(str(args.get("patchText") or ""))
            except PatchError as exc:
                return {**call, "paths": [], "unparsed": f"opencode's patch: {exc}"}
        if not paths and effect in (Effect.read, Effect.write):
            paths = [str(worktree)]  # glob, grep and list with no path act on the session's directory
        return {**call, "paths": [p if p.startswith("/") else f"{str(worktree).rstrip('/')}/{p}" for p in paths]}

    def answer(self, d: Decision) -> Answer:
        return Answer(json.dumps({"allow": d.verdict is CallVerdict.run, "reason": reason(d)}))

    def config(self, dir: Path) -> dict[str, Any]:
        """The job's config layer (`OPENCODE_CONFIG_CONTENT`): the gate's plugin and the provider lock, no
        snapshot repo of the worktree, no share link, no self-update."""
        return {"plugin": [(dir / PLUGIN).as_uri()], "enabled_providers": [LOCK], "snapshot": False,
                "share": "disabled", "autoupdate": False}

    def files(self, hook: list[str], dir: Path) -> dict[str, str]:
        """The plugin, and the config layer as the CLI gets it (for a person reading the gate dir)."""
        source = (resources.files("proctor.mechanisms.gatekeeper") / "opencode_gate.mjs").read_text()
        plugin = source.replace("__PROCTOR_HOOK__", json.dumps(hook)).replace("__PROCTOR_LOCK__", json.dumps(LOCK))
        return {PLUGIN: plugin, settings_path(dir, self.name).name: json.dumps(self.config(dir), indent=1)}

    def env(self, dir: Path) -> dict[str, str]:
        return {"OPENCODE_CONFIG_CONTENT": json.dumps(self.config(dir)),
                "OPENCODE_PERMISSION": json.dumps({"task": "deny"}), "OPENCODE_DISABLE_PROJECT_CONFIG": "1"}

    def tool_uses(self, stdout: str) -> list[tuple[str, str]]:
        """(call id, tool) of every `tool_use` event of `run --format json`, granted or refused."""
        found = []
        for ev in json_events(stdout, '"tool_use"'):
            part = ev.get("part") if ev.get("type") == "tool_use" else None
            if isinstance(part, dict) and part.get("type") == "tool":
                found.append((str(part.get("callID", "")), str(part.get("tool", ""))))
        return found
