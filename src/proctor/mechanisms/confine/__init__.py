"""OS-enforced confinement of an agent's process tree: bubblewrap outside, Landlock inside (DESIGN.md 6).
Also its resource limits (limits, cgroup, disk) and its network (egress, endpoints, http1, relay).

The whole API the host uses:

    caps = detect()                                          # tried once per process, cached
    confiner = choose("auto" | "required" | "off", caps)     # -> Confiner | Unavailable
    req = job_roots(wt.path, tmpdir, adapter_state_dirs, readonly=(main_checkout, main_git_dir),
                    network=False)                            # -> ConfineRequest | Unavailable
    with EgressProxy(adapter_egress, socket, on_decision):    # network=True: declared hosts only
        req = replace(req, egress_socket=socket, egress=adapter_egress)
    refuse_hard_links(root)                                  # planted hard links beat every layer
    plan = confiner.wrap(agent_argv, req)                    # -> ConfinePlan | Unavailable
    # spawn plan.argv (shell=False, cwd=wt.path, env={**job_env, **plan.env}) through the process runner,
    # which still joins the job cgroup; record plan.confinement, plan.details and plan.gaps in the result.

`confinement` is "bwrap+landlock" | "bwrap" | "landlock" | "none"; "none" happens only for mode off, or auto on
a machine with neither layer (the host then records a risk). Every refusal is an `Unavailable(reason,
code=CONFINEMENT_UNAVAILABLE)` value, never an exception; with one, launch nothing. The Landlock helper exits
126 with `proctor-landlock: ...` on stderr if it cannot confine, before running anything.

This package never spawns the agent and never kills anything: the process runner and proctor.mechanisms.confine.cgroup do.
"""

from proctor.mechanisms.confine.detect import Capabilities, detect
from proctor.mechanisms.confine.plan import CONFINE_ORDER, Confiner, LayeredConfiner, Mode, choose
from proctor.mechanisms.confine.request import ConfinePlan, ConfineRequest, Confinement, Unavailable
from proctor.mechanisms.confine.roots import checkout_hidden, job_roots, refuse_hard_links

__all__ = [
    "CONFINE_ORDER",
    "Capabilities", "ConfinePlan", "ConfineRequest", "Confinement", "Confiner", "LayeredConfiner", "Mode",
    "Unavailable", "checkout_hidden", "choose", "detect", "job_roots", "refuse_hard_links",
]
