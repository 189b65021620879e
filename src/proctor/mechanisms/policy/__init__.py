"""The policy half (DESIGN.md): what may happen, decided before it happens, from what a person declared.

    task      the declared task: tools, effects, permissions, limits
    trusted   the trusted policy (policy.toml): ceilings, forbidden effects, approvals, budgets
    gate      a tool call decided before it runs, with a stable code
    runtime   the gate as a running job asks it, with its ledger rows and grants
    stop      the stop switch
    breaker   the circuit breaker per credential pool
    budget, governor, tally   spend budgets, booked before launch by compare-and-set

It imports nothing of the job path (proctor.services.job): the job path asks it.
"""
