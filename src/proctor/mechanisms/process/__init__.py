"""Spawning a process tree under a hard deadline with bounded output and a whole-tree kill (ProcessRunner).

It never interprets output and never uses a shell; limits are confine's.
"""
