"""Surfaces: how a person or a program asks proctor for work (cli, api, mcp, web; the package face).

Each parses, calls one service and shows the outcome; none decides anything a service decides.
"""
