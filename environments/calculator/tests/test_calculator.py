import asyncio
import json
from fractions import Fraction

import env_testkit as kit
import pytest
from calculator import (
    SYSTEM_PROMPT,
    CalculatorConfig,
    CalculatorData,
    CalculatorError,
    CalculatorTask,
    CalculatorTaskset,
    calculate,
    format_number,
    parse_number,
    safe_eval,
)

# verifiers keeps some asyncio state bound to the loop that first used it: one loop for this module.
LOOP = asyncio.new_event_loop()
API_KEY_VAR = "CALCULATOR_TEST_API_KEY"


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("2 + 3 * 4", 14),
        ("(2 + 3) * 4", 20),
        ("1200 + 12 * 345", 5340),
        ("-5 + 2", -3),
        ("--3", 3),
        ("-(2 - 10) * 3", 24),
        ("7 / 2", Fraction(7, 2)),
        ("1 / 3 * 3", 1),
        ("0.1 + 0.2", Fraction(3, 10)),
        ("  84  ", 84),
        ("123456789 * 987654321", 121932631112635269),
    ],
)
def test_safe_eval(expression, value):
    assert safe_eval(expression) == value


@pytest.mark.parametrize(
    "expression",
    [
        "__import__('os')",
        "__import__('os').system('echo pwned')",
        "os",
        "x + 1",
        "(1).real",
        "abs(-1)",
        "print(1)",
        "2 ** 10",
        "7 // 2",
        "7 % 2",
        "+5",
        "[1, 2]",
        "(1, 2)",
        "1 if 1 else 2",
        "lambda: 1",
        "'a'",
        "True",
        "1j",
        "1 < 2",
        "",
        "1 +",
        "1; 2",
        "1 / 0",
        "1 / (3 - 3)",
        "1e999",
        "1" * 201,
        "(" * 100 + "1" + ")" * 100,
    ],
)
def test_safe_eval_rejects(expression):
    with pytest.raises(CalculatorError):
        safe_eval(expression)


def test_safe_eval_rejects_non_strings():
    with pytest.raises(CalculatorError):
        safe_eval(12)


def test_format_and_calculate():
    assert format_number(Fraction(14)) == "14"
    assert format_number(Fraction(-7, 2)) == "-3.5"
    assert format_number(Fraction(1, 3)) == "0.3333333333"
    assert format_number(Fraction(2, 3)) == "0.6666666667"
    assert format_number(Fraction(-1, 10**12)) == "0"
    assert calculate("(1200 + 345) * 12") == "18540"
    assert calculate("1 / 0") == "Error: division by zero"
    assert calculate("__import__('os')").startswith("Error: unsupported syntax (Call)")
    assert calculate("a.b").startswith("Error: unsupported syntax (Attribute)")


@pytest.mark.parametrize(
    ("text", "number"),
    [
        ("5340", 5340),
        ("The warehouse holds 5,340 boxes.", 5340),
        ("5340.0", 5340),
        ("-3.5", Fraction(-7, 2)),
        ("12 trucks, so 1200 + 4140 = 5340", 5340),
        ("no number", None),
        (None, None),
    ],
)
def test_parse_number(text, number):
    assert parse_number(text) == number


def test_generation_is_deterministic_and_consistent():
    def tasks(**args):
        return list(CalculatorTaskset(CalculatorConfig(**args)))

    first = tasks(num_tasks=50, seed=7)
    assert [t.data for t in first] == [t.data for t in tasks(num_tasks=50, seed=7)]
    assert [t.data.prompt for t in first] != [t.data.prompt for t in tasks(num_tasks=50, seed=8)]
    for task in first:
        d = task.data
        assert safe_eval(d.expression) == d.answer > 0
        assert d.system_prompt == SYSTEM_PROMPT and d.max_turns == 3
        for number in d.expression.replace("*", " ").replace("+", " ").replace("-", " ").replace("/", " ").split():
            assert number in d.prompt
    kinds = {next(k for k in ("warehouse", "farm", "school", "teams", "tank") if k in t.data.prompt) for t in first}
    assert len(kinds) == 5  # all five problem kinds occur
    big = tasks(num_tasks=10, digits=5, max_turns=2)
    assert all(d.max_turns == 2 and any(len(n) >= 5 for n in d.expression.split()) for d in (t.data for t in big))


def test_plain_style_asks_the_same_expressions():
    word = list(CalculatorTaskset(CalculatorConfig(num_tasks=20, seed=3, digits=2)))
    plain = list(CalculatorTaskset(CalculatorConfig(num_tasks=20, seed=3, digits=2, style="plain")))
    for w, p in zip(word, plain, strict=True):
        assert (p.data.expression, p.data.answer) == (w.data.expression, w.data.answer)
        assert p.data.prompt == f"What is {w.data.expression}?"


def tool_call(expression: str, call_id: str = "call_1") -> dict:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": "calculate", "arguments": json.dumps({"expression": expression})},
    }


def scripted(*replies: dict):
    """The n-th model call gets replies[n-1] (n-1 assistant messages in the request)."""

    def script(body: dict) -> dict:
        return replies[sum(m["role"] == "assistant" for m in body["messages"])]

    return script


WAREHOUSE = CalculatorTask(
    CalculatorData(
        prompt="A warehouse holds 1200 boxes. 12 trucks deliver 345 boxes each. How many boxes does it hold now?",
        system_prompt=SYSTEM_PROMPT,
        expression="1200 + 12 * 345",
        answer=5340,
        max_turns=3,
    )
)


async def run_episodes(script, task_list, **taskset_args):
    """Episodes with prime-rl's `prime-chat`, which runs the tool calls against the taskset's MCP tool server."""
    taskset = {"id": "calculator", **taskset_args}
    return await kit.run_prime_chat_episodes(taskset, script, task_list, api_key_var=API_KEY_VAR)


def test_episode_tool_call_then_answer(monkeypatch):
    monkeypatch.setenv(API_KEY_VAR, "sk-test")
    script = scripted(
        {"content": None, "tool_calls": [tool_call("1200 + 12 * 345")]},
        {"content": "The warehouse holds 5,340 boxes."},
    )
    episodes, requests = LOOP.run_until_complete(run_episodes(script, [WAREHOUSE], num_tasks=1))
    (trace,) = episodes[0].traces
    assert episodes[0].ok and not trace.has_error, trace.errors
    assert trace.reward == 1.0 and trace.rewards["correct"].score == 1.0
    assert trace.metrics == {"answered": 1.0, "tool_calls": 1.0, "tool_errors": 0.0}
    assert [m.role for m in trace.messages] == ["system", "user", "assistant", "tool", "assistant"]
    (tool_message,) = trace.tool_messages
    assert (tool_message.tool_call_id, tool_message.content) == ("call_1", "5340")
    assert [t.name for t in trace.tools] == ["calculate"]
    assert len(requests) == 2 and trace.num_branches == 1
    for request in requests:  # the MCP server's tool, in OpenAI function format
        (tool,) = request["tools"]
        assert tool["function"]["name"] == "calculate" and tool["function"]["parameters"]["required"] == ["expression"]
    assert requests[1]["messages"][-1] == {"role": "tool", "tool_call_id": "call_1", "content": "5340"}
    assert requests[1]["messages"][-2]["tool_calls"] == [tool_call("1200 + 12 * 345")]


def test_episode_refused_tool_call_and_wrong_answer(monkeypatch):
    monkeypatch.setenv(API_KEY_VAR, "sk-test")
    script = scripted(
        {
            "content": "Let me try.",
            "tool_calls": [
                tool_call("__import__('os').system('echo pwned')", "a"),
                tool_call("12 * 345", "b"),
                {"id": "c", "type": "function", "function": {"name": "calculate", "arguments": '{"expr": "1"}'}},
            ],
        },
        {"content": "5000"},
    )
    episodes, requests = LOOP.run_until_complete(run_episodes(script, [WAREHOUSE], num_tasks=1))
    (trace,) = episodes[0].traces
    assert not trace.has_error, trace.errors
    refused, result, bad_args = [m.content for m in trace.tool_messages]
    assert (refused, result) == ("Error: unsupported syntax (Call); use numbers, + - * / and parentheses", "4140")
    assert bad_args.startswith("Error") and "expression" in bad_args  # the server refuses a call without it
    assert [m.tool_call_id for m in trace.tool_messages] == ["a", "b", "c"]
    assert trace.reward == 0.0
    assert trace.metrics == {"answered": 1.0, "tool_calls": 3.0, "tool_errors": 2.0}


def test_episode_out_of_turns(monkeypatch):
    monkeypatch.setenv(API_KEY_VAR, "sk-test")
    script = scripted(*[{"content": "5340?", "tool_calls": [tool_call("1200 + 12 * 345", f"c{i}")]} for i in range(4)])
    episodes, requests = LOOP.run_until_complete(run_episodes(script, [WAREHOUSE], num_tasks=1))
    (trace,) = episodes[0].traces
    assert len(requests) == 3 and trace.stop_condition == "out_of_turns"  # max_turns model calls
    assert trace.reward == 0.0  # the last message is a tool call, not a final answer
    assert trace.metrics == {"answered": 0.0, "tool_calls": 3.0, "tool_errors": 0.0}


def test_episodes_from_taskset(monkeypatch):
    """Tasks as the taskset generates them, and a player that computes each problem's expression with the tool
    and answers with the tool's result."""
    monkeypatch.setenv(API_KEY_VAR, "sk-test")
    expressions: dict[str, str] = {}

    def player(body: dict) -> dict:
        messages = body["messages"]
        if messages[-1]["role"] == "tool":
            return {"content": f"The answer is {messages[-1]['content']}."}
        return {"content": None, "tool_calls": [tool_call(expressions[messages[-1]["content"]])]}

    def tasks(env):
        tasks_ = list(env.taskset)
        expressions.update({t.data.prompt: t.data.expression for t in tasks_})
        return tasks_

    episodes, requests = LOOP.run_until_complete(run_episodes(player, tasks, num_tasks=5, digits=4))
    assert len(episodes) == 5 and len(requests) == 10
    for episode in episodes:
        (trace,) = episode.traces
        assert episode.ok, episode.errors
        assert trace.agent.config.harness.id == "prime-chat"
        assert trace.reward == 1.0
        assert trace.metrics["tool_calls"] == 1.0
