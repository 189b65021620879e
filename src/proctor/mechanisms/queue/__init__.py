"""The signed job queue: envelopes, keys, trusted signers, backends (JetStream, in-memory), the listener.

Owns moving a job from a sender to the one host it names and its signed result back. It never decides what
an agent may do inside a job: that is the host's (run_agent) and the gate's business.
"""
