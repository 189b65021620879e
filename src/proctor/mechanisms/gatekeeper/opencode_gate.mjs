// proctor's gate for one opencode job, written into the job's gate dir (read-only to the agent) and named in
// OPENCODE_CONFIG_CONTENT's `plugin` list (proctor/mechanisms/gatekeeper/opencode.py says why each piece).
// Every tool call asks proctor's gate through the hook client before it runs; a refusal, or any failure to
// get an answer, throws, which opencode turns into the call's error (the tool never runs).
// The job's config names no model provider but a lock (`enabled_providers`), which this plugin lifts only
// once the gate said it is armed: a plugin that did not load, or a gate that did not answer, leaves the CLI
// with no model to ask, so no tool call can happen ungated.
import { spawnSync } from "node:child_process";

const HOOK = __PROCTOR_HOOK__;
const LOCK = __PROCTOR_LOCK__;

function ask(event, payload) {
  const r = spawnSync(HOOK[0], [...HOOK.slice(1), event], {
    input: JSON.stringify(payload), encoding: "utf8", timeout: 65000, maxBuffer: 4 << 20,
  });
  const failed = (r.stderr || (r.error ? String(r.error) : "")).trim();
  if (r.error || r.status !== 0) {
    return { ok: false, reason: failed || "[proctor GATE_UNAVAILABLE] the gate hook did not answer" };
  }
  // The gate answers the session-start ping with nothing at all; anything else is not the gate.
  if (event !== "PreToolUse") return { ok: r.stdout.trim() === "", reason: "" };
  try {
    const answer = JSON.parse(r.stdout);
    if (typeof answer.allow !== "boolean") throw new Error("no decision");
    return { ok: answer.allow, reason: String(answer.reason || "") };
  } catch {
    return { ok: false, reason: "[proctor GATE_UNAVAILABLE] the gate's answer was unreadable" };
  }
}

export const ProctorGate = async () => {
  const armed = ask("SessionStart", {}).ok;
  return {
    config: async (cfg) => {
      const held = cfg.enabled_providers;
      if (armed && Array.isArray(held) && held.length === 1 && held[0] === LOCK) delete cfg.enabled_providers;
    },
    "tool.execute.before": async (input, output) => {
      let answer;
      try {
        answer = ask("PreToolUse", { tool: input.tool, callID: input.callID, sessionID: input.sessionID,
                                     args: output.args });
      } catch (err) {
        answer = { ok: false, reason: `[proctor GATE_UNAVAILABLE] ${err}` };
      }
      if (!answer.ok) throw new Error(answer.reason || "[proctor GATE_UNAVAILABLE] refused");
    },
  };
};
