"""Validation evidence: what the host reads to judge a test run, beside (never instead of) its exit code.

Owns the per-ecosystem readers of per-test outcomes (a pytest plugin the host loads from outside the tree,
`go test -json`, libtest's lines, TAP), the rules that turn them into a verdict, and the signals in the
agent's diff that a person must look at. It never launches a process and never trusts the tree's own files.
"""
