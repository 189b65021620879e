"""proctor: have a coding agent do a task in a git repo under limits, and judge the result on evidence."""

from proctor.contract import Code, RunAgentRequest, RunAgentResult, Status
from proctor.services.job.run_agent import run_agent

__all__ = ["Code", "RunAgentRequest", "RunAgentResult", "Status", "run_agent"]
