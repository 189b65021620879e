"""Host-side git: the job's repositories, the tree that would land (scanned, built, materialised), frozen checks.

Reads only configuration the host chose; never runs anything the repo or the agent controls.
"""
