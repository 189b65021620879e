"""Agent adapters: data (argv template, prompt channel, env, patterns) plus a named output reader."""
