"""User configuration: config.toml's types (model), reading them from TOML (load), and the per-repo settings
the repos' .proctor.toml shares (settings). It never holds trusted policy (policy.toml is policy's).
"""
