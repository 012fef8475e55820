import asyncio
import json

import env_testkit as kit
from lookup import (
    KEY_LETTERS,
    SYSTEM_PROMPT,
    LookupConfig,
    LookupTask,
    LookupTaskset,
    code_of,
    is_key,
    lookup,
    lookup_task,
    matched,
)

# verifiers keeps some asyncio state bound to the loop that first used it: one loop for this module.
LOOP = asyncio.new_event_loop()
API_KEY_VAR = "LOOKUP_TEST_API_KEY"


def test_codes_are_fixed_four_distinct_digits():
    assert code_of("#BCDG") == "1259"  # a SHA-256 of the key: the same in every process and Python version
    codes = {code_of(key) for key in ("#BCDG", "#GDCB", "#PZBH", "#RQPH", "#QVGJ")}
    assert len(codes) == 5
    for code in codes:
        assert len(code) == 4 and code.isdigit() and len(set(code)) == 4


def test_lookup_refuses_what_is_not_a_key():
    assert lookup("#BCDG") == "1259"
    for bad in ("BCDG", "#BCD", "#BCDGH", "#BCDB", "#bcdg", "#ABCD", "#KBCD", "#BC G", "##BCD", 12, None):
        assert not is_key(bad)
        assert lookup(bad).startswith("Error: no key")
    assert len(lookup("X" * 10_000)) < 120  # the echo is bounded


def test_matched_counts_digits_in_place_over_the_longer_length():
    assert matched("1259", "1259") == 1.0
    assert matched("1289", "1259") == 0.75
    assert matched("2591", "1259") == 0.0  # right digits, each one place off
    assert matched("1259 maybe", "1259") == 0.4
    assert matched("125", "1259") == 0.75
    assert matched("", "1259") == matched(None, "1259") == 0.0


def test_generation_is_deterministic_and_uses_only_key_letters():
    def tasks(**args):
        return [t.data for t in LookupTaskset(LookupConfig(**args))]

    first = tasks(num_tasks=200, seed=7)
    assert first == tasks(num_tasks=200, seed=7)
    assert [d.key for d in first] != [d.key for d in tasks(num_tasks=200, seed=8)]
    for d in first:
        assert is_key(d.key) and d.code == code_of(d.key)
        assert d.prompt == f"what is the code of {d.key}?" and d.system_prompt == SYSTEM_PROMPT and d.max_turns == 3
    # the key's letters are the only capitals in the prompts the model reads
    assert not any(c.isupper() or c == "#" for c in SYSTEM_PROMPT + first[0].prompt.replace(first[0].key, ""))
    assert set("".join(d.key[1:] for d in first)) == set(KEY_LETTERS)


def tool_call(key: str, call_id: str = "call_1") -> dict:
    return {"id": call_id, "type": "function", "function": {"name": "lookup", "arguments": json.dumps({"key": key})}}


def task(key: str) -> LookupTask:
    return lookup_task(key, max_turns=3)


# One scripted player per task, told apart by the key in the question: one episode batch, one MCP server start.
PLAYERS = {
    "#BCDG": [{"content": "", "tool_calls": [tool_call("#BCDG")]}, {"content": " 1259\n"}],  # right
    "#PZBH": [{"content": "1234"}],  # a guess without the tool
    "#RQPH": [{"content": "", "tool_calls": [tool_call("#RQPD")]}, {"content": code_of("#RQPD")}],  # the wrong key
    "#QVGJ": [
        {"content": "", "tool_calls": [tool_call("qvgj")]},
        {"content": code_of("#QVGJ") + " maybe"},
    ],  # not a key
    "#DGHJ": [
        {"content": code_of("#DGHJ"), "tool_calls": [tool_call("#DGHJ", f"c{i}")]} for i in range(4)
    ],  # no answer
}


def player(body: dict) -> dict:
    key = next(m["content"] for m in body["messages"] if m["role"] == "user")[-6:-1]
    return PLAYERS[key][sum(m["role"] == "assistant" for m in body["messages"])]


async def run_episodes(task_list, **taskset_args):
    """Episodes with prime-rl's `prime-chat`, which runs the tool calls against the taskset's MCP tool server (a
    real subprocess)."""
    taskset = {"id": "lookup", **taskset_args}
    return await kit.run_prime_chat_episodes(taskset, player, task_list, api_key_var=API_KEY_VAR)


def test_episodes_through_the_mcp_tool(monkeypatch):
    monkeypatch.setenv(API_KEY_VAR, "sk-test")
    episodes, requests = LOOP.run_until_complete(run_episodes([task(key) for key in PLAYERS], num_tasks=1))
    traces = {}
    for episode in episodes:
        (trace,) = episode.traces
        assert episode.ok and not trace.has_error, trace.errors
        traces[trace.messages[1].content[-6:-1]] = trace
    assert len(requests) == 2 + 1 + 2 + 2 + 3

    right = traces["#BCDG"]
    assert right.reward == 1.0 and right.metrics == {"correct": 1.0, "tool_calls": 1.0, "tool_errors": 0.0}
    assert [m.role for m in right.messages] == ["system", "user", "assistant", "tool", "assistant"]
    (result,) = right.tool_messages
    assert (result.tool_call_id, result.content) == ("call_1", "1259")
    for request in requests:  # the MCP server's tool, in OpenAI function format
        (tool,) = request["tools"]
        assert tool["function"]["name"] == "lookup" and tool["function"]["parameters"]["required"] == ["key"]

    # partial credit for the digits in place: a guess, the wrong key's code, the right code with words after it
    guess, wrong_key, wordy = traces["#PZBH"], traces["#RQPH"], traces["#QVGJ"]
    assert guess.reward == matched("1234", code_of("#PZBH")) < 1.0
    assert guess.metrics == {"correct": 0.0, "tool_calls": 0.0, "tool_errors": 0.0}
    assert wrong_key.reward == matched(code_of("#RQPD"), code_of("#RQPH")) < 1.0
    assert wrong_key.metrics == {"correct": 0.0, "tool_calls": 1.0, "tool_errors": 0.0}
    assert (wordy.reward, wordy.metrics) == (0.4, {"correct": 0.0, "tool_calls": 1.0, "tool_errors": 1.0})
    assert wordy.tool_messages[0].content.startswith("Error: no key 'qvgj'")
    out_of_turns = traces["#DGHJ"]
    assert out_of_turns.stop_condition == "out_of_turns" and out_of_turns.num_turns == 3
    assert out_of_turns.reward == 0.0  # its last message is a tool call, not a final answer
