"""The MCP surface: `proctor mcp`, an MCP server on stdio over the services the CLI uses.

Owns the tools, their arguments and results, the jobs this server runs, and serving on stdio (server.py, the
entry); it never decides anything itself: the host, the gate and the review verbs do.
"""
