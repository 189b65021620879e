"""The MCP surface: `proctor mcp`, an MCP server on stdio over the services the CLI uses.

Owns the tools, their schemas and results; it never decides anything itself.
"""
