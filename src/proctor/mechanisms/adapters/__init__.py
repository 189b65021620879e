"""Agent adapters: each CLI as data (argv template, prompt channel, env, state dirs, patterns) plus a named
reader of its output; the built-ins (builtin.toml) are declared exactly as a user's TOML adapter is.

It never launches a CLI (the job does) and takes nothing a CLI prints as proof: a reading is a claim.
"""
