"""The policy half (DESIGN.md): what may happen, decided before it happens, from what a person declared.

    task      the declared task: tools, effects, permissions, limits
    trusted   the trusted policy (policy.toml): ceilings, forbidden effects, approvals, budgets
    gate      a tool call decided before it runs, with a stable code
    plan      a task as it would run (`check-task`): its capped limits, each tool as the gate sees it
    diffcheck a job's diff held against what its task declared
    runtime   the in-process loop: an adapter's events, each tool call through the gate, its ledger rows
    stop      the stop switch
    breaker   the circuit breaker per credential pool
    budget, windows, governor, tally   spend budgets, booked before launch by compare-and-set

It imports nothing of the job path (proctor.services.job): the job path asks it.
"""
