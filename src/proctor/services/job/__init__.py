"""The job path: one run_agent job from a validated request to the host's own verdict (DESIGN.md 2).

host (the service) -> attempts (launch, retry, classify) -> process, cgroup (spawn, deadline, tree kill)
                   -> worktree, git, landing, frozen (the job's repo, the tree that would land, frozen checks)
                   -> validate, agent_version
The policy half (gate, task, policy, breaker, stop, runtime) stays beside it in proctor/; confinement in
proctor/confine/.
"""
