"""The job path: one run_agent job from a validated request to the host's own verdict, as its phases
(run_agent.py names them in order: record, admit, prepare, agent, land, validate, judge).

Owns the order of a job and the rule for `needs_human_review`; every OS enforcement, git operation, gate
decision and evidence parser it asks of proctor.mechanisms. It never takes the agent's word as proof.
"""
