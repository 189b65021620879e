"""User configuration (config.toml) and the settings types it and the repos' .proctor.toml share.

It never holds trusted policy (policy.toml is policy's).
"""
