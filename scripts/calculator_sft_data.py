"""Write calculator SFT conversations (prompt/completion chat rows with `tools`, JSONL) from the `calculator` taskset.

    uv run python scripts/calculator_sft_data.py [--output outputs/calculator-sft.jsonl] [--num 2000] [--seed 0]
        [--digits 2] [--style plain] [--no-tool-fraction 0.0]

Each row is one task of the bundled environment (same system prompt, same user message, the same tool list that
`prime-chat` offers from the environment's MCP server) solved with the tool: the assistant calls
`calculate(expression)` with the task's expression, gets the tool's result as a `tool` message and answers with
it. So SFT trains exactly the multi-turn, tool-calling conversation that RL and eval later run. `--seed` picks the
taskset's generator seed; evaluate on a different seed to hold tasks out.

`--no-tool-fraction F` makes the demonstrations imperfect, like real ones: a seeded fraction F of them answers at
once, without the tool, with a guess (the problem's first number, reward 0). A model fine-tuned on them skips the
tool about as often; the reward then shows RL what imitation cannot (the calculator demo uses this).
"""

import argparse
import asyncio
import random
import re
from pathlib import Path

from calculator import CalculatorConfig, CalculatorTaskset, calculate

from prime_rl.trainer.sft.data import write_examples


def tool_specs(config: CalculatorConfig) -> list[dict]:
    """The tools as `prime-chat` offers them: the environment's MCP server's listing (built in process here, not
    served), in OpenAI function format under the name the harness gives them."""
    from mcp.server.mcpserver import MCPServer

    specs = []
    for toolset in CalculatorTaskset.toolsets(config):
        server = MCPServer(type(toolset).__name__)
        toolset.register(server)
        prefix = toolset.TOOL_PREFIX
        for tool in asyncio.run(server.list_tools()):
            name = f"{prefix}_{tool.name}" if prefix else tool.name
            function = {"name": name, "description": tool.description or "", "parameters": tool.input_schema}
            specs.append({"type": "function", "function": function})
    return specs


def sft_rows(config: CalculatorConfig, no_tool_fraction: float = 0.0) -> list[dict]:
    rng = random.Random(f"no-tool-{config.seed}")
    tools = tool_specs(config)
    rows = []
    for task in CalculatorTaskset(config).load():
        data = task.data
        prompt = [{"role": "system", "content": data.system_prompt}, {"role": "user", "content": data.prompt}]
        if rng.random() < no_tool_fraction:
            guess = re.search(r"\d+", data.prompt).group()  # the first number: wrong
            completion = [{"role": "assistant", "content": guess}]
        else:
            call = {"id": "call_1", "type": "function"}
            call["function"] = {"name": "calculate", "arguments": {"expression": data.expression}}
            result = calculate(data.expression)
            completion = [
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": result},
                {"role": "assistant", "content": result},
            ]
        rows.append({"prompt": prompt, "completion": completion, "tools": tools})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=Path("outputs/calculator-sft.jsonl"))
    parser.add_argument("--num", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--digits", type=int, default=2)
    parser.add_argument("--style", choices=["word", "plain"], default="plain")
    parser.add_argument("--no-tool-fraction", type=float, default=0.0, help="answers guessed without the tool")
    args = parser.parse_args()
    config = CalculatorConfig(num_tasks=args.num, seed=args.seed, digits=args.digits, style=args.style)
    write_examples(args.output, sft_rows(config, args.no_tool_fraction))
    print(
        f"wrote {args.num} calculator conversations (seed {args.seed}, {args.style}, {args.digits} digits, "
        f"no tool {args.no_tool_fraction:.0%}) to {args.output}"
    )


if __name__ == "__main__":
    main()
