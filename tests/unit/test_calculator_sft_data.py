"""scripts/calculator_sft_data.py: the demo's demonstrations are the taskset's own conversations solved with the
environment's tool (call, result, answer) or, for a seeded fraction, a wrong guess made without it."""

import importlib.util
from pathlib import Path

from calculator import SYSTEM_PROMPT, CalculatorConfig, parse_number

ROOT = Path(__file__).parents[2]
spec = importlib.util.spec_from_file_location("calculator_sft_data", ROOT / "scripts" / "calculator_sft_data.py")
sft_data = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sft_data)


def test_tools_are_the_mcp_servers_listing():
    (tool,) = sft_data.tool_specs(CalculatorConfig())
    assert tool["type"] == "function"
    function = tool["function"]
    assert function["name"] == "calculate" and function["description"].startswith("Evaluate an arithmetic")
    assert function["parameters"]["required"] == ["expression"]
    assert function["parameters"]["properties"]["expression"]["type"] == "string"


def test_rows_solve_the_tasks_with_the_tool_except_a_seeded_share_of_guesses():
    config = CalculatorConfig(num_tasks=400, seed=0, digits=2, style="plain")
    rows = sft_data.sft_rows(config, no_tool_fraction=0.3)
    assert rows == sft_data.sft_rows(config, no_tool_fraction=0.3)
    guesses = 0
    for row in rows:
        system, user = row["prompt"]
        assert system == {"role": "system", "content": SYSTEM_PROMPT} and user["role"] == "user"
        assert user["content"].startswith("What is ") and row["tools"] == sft_data.tool_specs(config)
        expression = user["content"].removeprefix("What is ").removesuffix("?")
        if len(row["completion"]) == 1:  # a guess, without the tool: wrong
            guesses += 1
            assert parse_number(row["completion"][0]["content"]) != parse_number(sft_data.calculate(expression))
            continue
        call, result, answer = row["completion"]
        (tool_call,) = call["tool_calls"]
        assert tool_call["function"] == {"name": "calculate", "arguments": {"expression": expression}}
        assert result == {"role": "tool", "tool_call_id": tool_call["id"], "content": sft_data.calculate(expression)}
        assert answer == {"role": "assistant", "content": result["content"]}
    # 400 seeded draws of probability 0.3: 120 expected, std 9.2; +-37 is a 4-sigma band
    assert 83 <= guesses <= 157
    assert all(len(r["completion"]) == 3 for r in sft_data.sft_rows(config))
