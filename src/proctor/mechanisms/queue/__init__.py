"""The signed job queue: envelopes, keys and trusted signers, backends (JetStream, in-memory), the sender,
and the store a listener fences deliveries with (which job runs where, once, owned by whom).

Owns moving a job from a sender to the one host it names and its signed result back. It never runs a job
and never decides what an agent may do inside one: the listener (proctor.services.listen) runs them.
"""
