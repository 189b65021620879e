"""`proctor schema`: the JSON schema of the v1 request and result."""

from __future__ import annotations

import json

import click

from proctor.surfaces.cli.main import main
from proctor.contract import RunAgentRequest, RunAgentResult


@main.command("schema")
def schema_cmd() -> None:
    """Print the JSON schema of RunAgentRequest and RunAgentResult."""
    click.echo(json.dumps({
        "RunAgentRequest": RunAgentRequest.model_json_schema(by_alias=True),
        "RunAgentResult": RunAgentResult.model_json_schema(by_alias=True, mode="serialization"),
    }, indent=2))
