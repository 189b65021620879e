"""Mechanisms: the parts services compose (policy, gatekeeper, queue, confine, process, git, validation,
evidence, adapters, config, ledger, terminal). None imports a service or a surface.
"""
