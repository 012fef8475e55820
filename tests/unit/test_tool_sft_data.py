"""scripts/tool_sft_data.py: the demonstrations are the taskset's own conversations solved with the environment's
tool (call, result, answer) or, for a seeded fraction, a wrong guess made without it."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
spec = importlib.util.spec_from_file_location("tool_sft_data", ROOT / "scripts" / "tool_sft_data.py")
sft_data = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sft_data)

CASES = {
    # env: (taskset args, tool, its one argument, the task field passed, a description's start)
    "lookup": ({}, "lookup", "key", "key", "return the code"),
    "calculator": ({"digits": 2, "style": "plain"}, "calculate", "expression", "expression", "Evaluate an arithmetic"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_tools_are_the_mcp_servers_listing(name):
    args, tool_name, argument, _, description = CASES[name]
    env = sft_data.ENVS[name]
    (tool,) = sft_data.tool_specs(env, env.config_class(**args))
    assert tool["type"] == "function"
    function = tool["function"]
    assert function["name"] == tool_name and function["description"].startswith(description)
    assert function["parameters"]["required"] == [argument]
    assert function["parameters"]["properties"][argument]["type"] == "string"


@pytest.mark.parametrize("name", sorted(CASES))
def test_rows_solve_the_tasks_with_the_tool_except_a_seeded_share_of_guesses(name):
    args, tool_name, argument, field, _ = CASES[name]
    env = sft_data.ENVS[name]
    config = env.config_class(num_tasks=400, seed=0, **args)
    rows = sft_data.sft_rows(env, config, no_tool_fraction=0.3)
    assert rows == sft_data.sft_rows(env, config, no_tool_fraction=0.3)
    tasks = [t.data for t in env.taskset_class(config)]
    guesses = 0
    for row, data in zip(rows, tasks, strict=True):
        system, user = row["prompt"]
        assert system == {"role": "system", "content": data.system_prompt}
        assert user == {"role": "user", "content": data.prompt} and row["tools"] == sft_data.tool_specs(env, config)
        _, _, truth = env.solve(data)
        if len(row["completion"]) == 1:  # a guess, without the tool: wrong
            guesses += 1
            (guess,) = row["completion"]
            assert guess["role"] == "assistant" and guess["content"] != truth
            continue
        call, result, answer = row["completion"]
        (tool_call,) = call["tool_calls"]
        assert tool_call["function"] == {"name": tool_name, "arguments": {argument: getattr(data, field)}}
        assert result == {"role": "tool", "tool_call_id": tool_call["id"], "content": truth}
        assert answer == {"role": "assistant", "content": truth} and not truth.startswith("Error")
    # 400 seeded draws of probability 0.3: 120 expected, std 9.2; +-37 is a 4-sigma band
    assert 83 <= guesses <= 157
    assert all(len(r["completion"]) == 3 for r in sft_data.sft_rows(env, config))


def test_lookup_answers_are_the_tools_codes():
    from lookup import code_of, lookup

    env = sft_data.ENVS["lookup"]
    data = next(iter(env.taskset_class(env.config_class(num_tasks=1)))).data
    assert env.solve(data) == ("lookup", {"key": data.key}, lookup(data.key)) and lookup(data.key) == code_of(data.key)
