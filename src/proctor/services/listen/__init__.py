"""The queue worker: takes this host's jobs off the queue, checks each, runs it once, answers signed.

The only service that knows both the queue and the job path; it never judges an agent's work.
"""
