"""`vf-tools-env`: a verifiers v1 taskset whose tools are MCP servers (`vf.Toolset`), for prime-chat's tool loop.

Two servers with the same tools, one per lifecycle verifiers defines:
- `t` (`Task.toolsets`): task-scoped, one server process started for each rollout and stopped after it;
- `s` (`Taskset.toolsets`): worker-shared, one server process for all rollouts of a worker; each rollout's calls
  carry its own state route, so `state` (a `Counter`) is still per rollout.

Tools: `bump` (count + 1 in the rollout's state; answers `"<count> <server pid>"`), `add(a, b)` (typed arguments:
bad ones are refused by the server), `boom` (raises), `nap(seconds)` (sleeps; past the harness's `tool_timeout`
it is a timeout). `task.tools` picks the tools the servers offer (each offered tool costs ~120 prompt tokens
with the tiny tokenizer) and `task.servers` which servers run.

The metrics report what the trace shows, for the tests to check through `eval`/`rl` records: `tools_offered`,
`tool_calls`, `tool_errors`, the first and last count and the server pid a `bump` answered, `branches` (1: every
turn extended the previous one's tokens), and one count per error kind. Reward: 1 when some tool result is not an
error and, for `add`, the sum is at least 10 (so a group's rewards vary with what the model wrote).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from typing import Literal

import verifiers.v1 as vf
from verifiers.v1.types import content_text
from verifiers.v1.utils.decorators import discover_decorated

ALL_TOOLS = ["bump", "add", "boom", "nap"]


class Counter(vf.State):
    count: int = 0


class ToolsServerConfig(vf.ToolsetConfig):
    scope: Literal["task"] = "task"
    tools: list[str] = ALL_TOOLS


class SharedToolsServerConfig(vf.SharedToolsetConfig):
    scope: Literal["shared"] = "shared"
    tools: list[str] = ALL_TOOLS


class Tools:
    """The tools both servers offer (a mixin: each server is a `vf.Toolset` with its own prefix)."""

    @vf.tool
    def bump(self) -> str:
        """Count one more."""
        self.state.count += 1
        return f"{self.state.count} {os.getpid()}"

    @vf.tool
    def add(self, a: int, b: int) -> int:
        """Add."""
        return a + b

    @vf.tool
    def boom(self) -> str:
        """Fail."""
        raise ValueError("boom: this tool always raises")

    @vf.tool
    async def nap(self, seconds: float) -> str:
        """Sleep."""
        await asyncio.sleep(seconds)
        return "awake"

    def register(self, mcp) -> None:
        for fn in discover_decorated(self, "tool"):
            if fn.__name__ in self.config.tools:
                mcp.add_tool(self._with_state(fn), name=fn.__name__, description=(fn.__doc__ or "").strip() or None)


class TaskTools(Tools, vf.Toolset[ToolsServerConfig, Counter]):
    TOOL_PREFIX = "t"


class SharedTools(Tools, vf.Toolset[SharedToolsServerConfig, Counter]):
    TOOL_PREFIX = "s"


class ToolsTaskConfig(vf.TaskConfig):
    servers: list[str] = ["t", "s"]
    """Which servers run: `t` (one per rollout) and/or `s` (one per worker)."""
    tools: list[str] = ALL_TOOLS
    """Which tools they offer."""


class ToolsTask(vf.Task[vf.TaskData, Counter, ToolsTaskConfig]):
    @classmethod
    def toolsets(cls, config: ToolsTaskConfig) -> list[vf.Toolset]:
        return [TaskTools(ToolsServerConfig(tools=config.tools))] if "t" in config.servers else []

    @vf.reward
    async def useful(self, trace: vf.Trace) -> float:
        results = [content_text(m.content) for m in trace.tool_messages]
        good = [r for r in results if not r.startswith("Error")]
        return float(any(not r.isdigit() or int(r) >= 10 for r in good))

    @vf.metric
    async def tools_offered(self, trace: vf.Trace) -> float:
        return float(len(trace.tools or []))

    @vf.metric
    async def tool_calls(self, trace: vf.Trace) -> float:
        return float(sum(len(m.tool_calls or []) for m in trace.assistant_messages))

    @vf.metric
    async def tool_results(self, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages))

    @vf.metric
    async def tool_errors(self, trace: vf.Trace) -> float:
        return float(sum(content_text(m.content).startswith("Error") for m in trace.tool_messages))

    @vf.metric
    async def branches(self, trace: vf.Trace) -> float:
        return float(trace.num_branches)

    @vf.metric
    async def bumps(self, trace: vf.Trace) -> dict[str, float]:
        """The counts and the server pid `bump` answered (-1: no bump answered)."""
        answers = [re.fullmatch(r"(\d+) (\d+)", content_text(m.content)) for m in trace.tool_messages]
        answers = [(int(a[1]), int(a[2])) for a in answers if a]
        first, last = answers[0] if answers else (-1, -1), answers[-1] if answers else (-1, -1)
        return {
            "first_count": first[0],
            "last_count": last[0],
            "server_pid": first[1],
            "final_state": trace.state.count,
        }

    @vf.metric
    async def errors(self, trace: vf.Trace) -> dict[str, float]:
        texts = [content_text(m.content) for m in trace.tool_messages]
        kinds = {
            "err_unknown": "unknown tool",
            "err_json": "not valid JSON",
            "err_raised": "boom: this tool always raises",
            "err_args": "validation error",
            "err_timeout": "timed out",
        }
        return {kind: float(sum(needle in t for t in texts)) for kind, needle in kinds.items()}


class ToolsConfig(vf.TasksetConfig):
    num_tasks: int = 4
    task: ToolsTaskConfig = ToolsTaskConfig()


class ToolsTaskset(vf.Taskset[ToolsTask, ToolsConfig]):
    def load(self):
        for i in range(self.config.num_tasks):
            data = vf.TaskData(system_prompt="You call tools.", prompt=f"Use a tool ({i}).")
            yield ToolsTask(data, self.config.task)

    @classmethod
    def toolsets(cls, config: ToolsConfig) -> list[vf.Toolset]:
        servers = config.task.servers
        return [SharedTools(SharedToolsServerConfig(tools=config.task.tools))] if "s" in servers else []


__all__ = ["ToolsTaskset"]


if __name__ == "__main__":  # verifiers starts a server as `python -m vf_tools_env`, its config in VF_CONFIG
    (TaskTools if json.loads(os.environ["VF_CONFIG"])["scope"] == "task" else SharedTools).run()
