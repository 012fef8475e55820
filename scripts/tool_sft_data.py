"""Write SFT conversations for a bundled tool environment (`lookup` or `calculator`): prompt/completion chat rows
with `tools`, JSONL, from the taskset itself.

    uv run python scripts/tool_sft_data.py --env lookup [--output outputs/lookup/sft-data.jsonl] [--num 2000]
        [--seed 0] [--taskset-args '{"digits": 2, "style": "plain"}'] [--no-tool-fraction 0.0]

Each row is one task of the environment (its system prompt, its user message, and as `tools` the listing of its
own MCP server, as `prime-chat` offers it) solved with the tool: the assistant calls the tool, gets its result as
a `tool` message and answers with that result. So SFT trains the multi-turn, tool-calling conversation that RL and
eval later run. `--seed` picks the taskset's generator seed; evaluate on a different seed to hold tasks out.

`--no-tool-fraction F` makes the demonstrations imperfect, like real ones: a seeded fraction F of them answers at
once, without the tool, with a wrong guess. A model fine-tuned on them skips the tool about as often; the reward
then shows RL what imitation cannot (the tool-use demo, configs/lookup/, uses 0.3).
"""

import argparse
import asyncio
import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import calculator
import lookup

from prime_rl.trainer.sft.data import write_examples


@dataclass(frozen=True)
class ToolEnv:
    config_class: type
    taskset_class: type
    solve: Callable
    """task data -> (tool name, arguments, the answer the tool's result gives)"""
    guess: Callable
    """(task data, rng) -> a wrong answer given without the tool"""


def _calculator_guess(data, rng: random.Random) -> str:
    return re.search(r"\d+", data.prompt).group()  # the problem's first number: never the result


def _lookup_guess(data, rng: random.Random) -> str:
    while (guess := "".join(rng.sample("0123456789", lookup.CODE_DIGITS))) == data.code:
        pass
    return guess


ENVS = {
    "lookup": ToolEnv(
        lookup.LookupConfig,
        lookup.LookupTaskset,
        lambda data: ("lookup", {"key": data.key}, lookup.lookup(data.key)),
        _lookup_guess,
    ),
    "calculator": ToolEnv(
        calculator.CalculatorConfig,
        calculator.CalculatorTaskset,
        lambda data: ("calculate", {"expression": data.expression}, calculator.calculate(data.expression)),
        _calculator_guess,
    ),
}


def tool_specs(env: ToolEnv, config) -> list[dict]:
    """The tools as `prime-chat` offers them: the environment's MCP server's listing (built in process here, not
    served), in OpenAI function format under the name the harness gives them."""
    from mcp.server.mcpserver import MCPServer

    specs = []
    for toolset in env.taskset_class.toolsets(config):
        server = MCPServer(type(toolset).__name__)
        toolset.register(server)
        prefix = toolset.TOOL_PREFIX
        for tool in asyncio.run(server.list_tools()):
            name = f"{prefix}_{tool.name}" if prefix else tool.name
            function = {"name": name, "description": tool.description or "", "parameters": tool.input_schema}
            specs.append({"type": "function", "function": function})
    return specs


def sft_rows(env: ToolEnv, config, no_tool_fraction: float = 0.0) -> list[dict]:
    rng = random.Random(f"no-tool-{config.seed}")
    tools = tool_specs(env, config)
    rows = []
    for task in env.taskset_class(config).load():
        data = task.data
        prompt = [{"role": "system", "content": data.system_prompt}, {"role": "user", "content": data.prompt}]
        if rng.random() < no_tool_fraction:
            completion = [{"role": "assistant", "content": env.guess(data, rng)}]
        else:
            name, arguments, result = env.solve(data)
            call = {"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}}
            completion = [
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": result},
                {"role": "assistant", "content": result},
            ]
        rows.append({"prompt": prompt, "completion": completion, "tools": tools})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", choices=sorted(ENVS), default="lookup")
    parser.add_argument("--output", type=Path, default=None, help="default: outputs/<env>/sft-data.jsonl")
    parser.add_argument("--num", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--taskset-args", type=json.loads, default={}, help="more taskset config, as JSON")
    parser.add_argument("--no-tool-fraction", type=float, default=0.0, help="answers guessed without the tool")
    args = parser.parse_args()
    env = ENVS[args.env]
    config = env.config_class(num_tasks=args.num, seed=args.seed, **args.taskset_args)
    output = args.output or Path("outputs") / args.env / "sft-data.jsonl"
    write_examples(output, sft_rows(env, config, args.no_tool_fraction))
    print(
        f"wrote {args.num} {args.env} conversations (seed {args.seed}, no tool {args.no_tool_fraction:.0%}) to {output}"
    )


if __name__ == "__main__":
    main()
