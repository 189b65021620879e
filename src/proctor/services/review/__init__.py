"""The review surface: a person's verbs on jobs that ended (DESIGN.md 9).

    jobs     the jobs the ledger knows, their state, one job's full record (`jobs`, `show`)
    diff     the job's commit against its base, computed in a git dir the host made (`diff`)
    land     moving a target branch of the main repo to a validated job's work (`land`)
    revalidate  the job's validation, run again on the tree that would land when the target moved
    gc       removing a job's checkout, branch and objects (`discard`, `gc`)

Every verb is a ledger row; none runs code the repo or the agent controls (hooks, filters, fsmonitor):
re-validation runs the job's own validation, confined as the host confined it. Outcomes cross into the
CLI as values with a stable code (`outcome.Code`), never as exceptions.

It reads the job records the host writes as a job starts and ends (`proctor.services.job.record`:
$PROCTOR_HOME/jobs/<jobId>/) and the ledger, which stays the authority.
"""
