"""The MCP server: `proctor mcp`, an MCP server on stdio over the services the CLI uses (DESIGN.md 2, 9).

Owns building the server (its tool list and calls, its lifespan) and running it on stdio until the client
goes. stdout carries MCP frames only: fd 1 is pointed at stderr for the whole life of the process (stray
prints, child processes) and the frames go to a private duplicate of the original; fd 0 becomes /dev/null the
same way. When the client goes (stdin closes) every running job is cancelled and recorded before the process
exits. It never decides anything itself: the host, the gate and the review verbs do.
"""

from __future__ import annotations

import io
import logging
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib.metadata import version

import anyio
from mcp import types
from mcp.server.lowlevel.server import Server
from mcp.server.stdio import stdio_server

from proctor.mechanisms.config.load import ConfigError, load_config
from proctor.surfaces.mcp.grants import Grants
from proctor.surfaces.mcp.jobs import Jobs
from proctor.surfaces.mcp.surface import Surface
from proctor.surfaces.mcp.tools import Ctx, call_tool, offered

log = logging.getLogger("proctor.mcp")

SERVER_NAME = "proctor"


def build_server(jobs: Jobs, grants: Grants | None = None) -> Server[Surface]:
    surface = Surface(jobs, grants)

    @asynccontextmanager
    async def lifespan(_: Server[Surface]) -> AsyncIterator[Surface]:
        try:
            yield surface
        finally:
            # Sync on purpose: this runs while the loop winds down (the client closed stdin).
            cancelled = jobs.shutdown("the MCP server is shutting down")
            surface.close()
            if cancelled:
                log.warning("cancelled %d running job(s): %s", len(cancelled), ", ".join(cancelled))

    async def list_tools(ctx: Ctx, params: types.PaginatedRequestParams | None) -> types.ListToolsResult:
        return types.ListToolsResult(tools=[
            types.Tool(name=t.name, title=t.annotations.title, description=t.description, input_schema=t.schema(),
                       annotations=t.annotations) for t in offered(surface.grants)])

    async def on_call(ctx: Ctx, params: types.CallToolRequestParams) -> types.CallToolResult:
        return await call_tool(surface, ctx, params.name, params.arguments)

    return Server(SERVER_NAME, version=version("proctor"), lifespan=lifespan, on_list_tools=list_tools,
                  on_call_tool=on_call,
                  instructions="proctor runs coding agents under limits a person set and judges the result "
                               "itself: run_agent starts a job, job_result waits for its verdict.")


def _wire() -> tuple[anyio.AsyncFile[str], anyio.AsyncFile[str]]:
    """The MCP streams on private duplicates of fd 0 and 1; fd 1 becomes stderr and fd 0 /dev/null for the
    rest of the process, so nothing but frames ever reaches the client's stdout (a child's inherited fd 1,
    a stray print, a job still ending after the session closed)."""
    wire_in, wire_out = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    reader = io.TextIOWrapper(os.fdopen(wire_in, "rb"), encoding="utf-8", errors="replace")
    writer = io.TextIOWrapper(os.fdopen(wire_out, "wb"), encoding="utf-8", write_through=True)
    return anyio.wrap_file(reader), anyio.wrap_file(writer)


def serve(jobs: Jobs, grants: Grants | None = None) -> None:
    """Serve MCP on stdio until the client closes stdin; running jobs are cancelled and recorded first.

    A signal is the caller's to handle (`proctor mcp` calls `jobs.shutdown` and exits): unwinding the loop
    from one would wait forever on the thread blocked reading the client's still-open stdin."""
    server = build_server(jobs, grants)
    stdin, stdout = _wire()

    async def main() -> None:
        async with stdio_server(stdin=stdin, stdout=stdout) as (read, write):
            await server.run(read, write, server.create_initialization_options())

    try:
        anyio.run(main)
    finally:
        jobs.shutdown("the MCP server is shutting down")


def config_problem(config_file: str | None) -> str | None:
    """Why `--config` cannot be used (checked once at start; each run_agent loads it again), or None."""
    try:
        load_config(config_file)
    except ConfigError as exc:
        return str(exc)
    return None
