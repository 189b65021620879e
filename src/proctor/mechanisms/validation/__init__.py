"""How the host validates a tree: the plan (what to run) and the environment it runs in (environment, the face,
over layout, venvs, shares, probe). It never reads the agent's copy of a recipe; judging the evidence is evidence's.
"""
