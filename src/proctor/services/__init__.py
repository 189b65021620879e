"""Services: one use of proctor end to end (job: run_agent; commands: run_request; review; listen).

Each composes mechanisms in a documented order; none speaks a protocol of a surface.
"""
