"""prime-chat's MCP tool loop.

The loop alone (a stand-in endpoint and tool box, milliseconds): tool calls run and come back as `tool` messages
with their ids, replies are echoed unchanged, a refused turn ends the program, and every bad call becomes an error
text. Then through real verifiers and real MCP servers (`vf_tools_env`: one server per rollout and one per worker),
with a scripted OpenAI-compatible endpoint standing in for the model: tools listed, called, state kept per rollout,
servers torn down, and a tool that raises, bad arguments, malformed calls and a tool that hangs past its timeout are
tool results in the trace, never a failed rollout. The same paths against the real vLLM server (the model's tokens
parsed by the renderer) are in tests/integration/test_tool_envs.py.
"""

import asyncio
import json
import os
from pathlib import Path

import psutil
import pytest

import prime_chat
from prime_chat.mcp_tools import McpTools

INTEGRATION = str(Path(__file__).resolve().parents[1] / "integration")
ENVIRONMENTS = str(Path(__file__).resolve().parents[2] / "environments")


class FakeTools:
    """A tool box whose `call` records the calls and answers from a dict."""

    def __init__(self, answers: dict[str, str]):
        self.answers, self.calls = answers, []
        self.specs = [
            {"type": "function", "function": {"name": n, "description": "", "parameters": {}}} for n in answers
        ]

    async def call(self, name, arguments):
        self.calls.append((name, arguments))
        return self.answers.get(name, f"Error: unknown tool {name!r}")


def scripted_post(replies: list[tuple[int, dict | str]]):
    bodies = []

    async def post(body):
        bodies.append(json.loads(json.dumps(body)))  # a copy: the loop keeps appending to its list
        status, reply = replies.pop(0)
        content = reply if isinstance(reply, str) else json.dumps({"choices": [{"message": reply}]})
        return status, content.encode()

    return post, bodies


def call(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def test_loop_runs_the_calls_and_sends_back_their_results_until_a_reply_calls_none():
    first = {"role": "assistant", "content": "", "reasoning_content": None, "tool_calls": [call("a", "x", "{}")]}
    second = {"role": "assistant", "content": None, "tool_calls": [call("b", "y", '{"k": 1}'), call("c", "zz", "[]")]}
    post, bodies = scripted_post([(200, first), (200, second), (200, {"role": "assistant", "content": "done"})])
    tools = FakeTools({"x": "1", "y": "2"})
    result = asyncio.run(prime_chat.tool_loop(post, "m", [{"role": "user", "content": "go"}], tools))
    assert (result.exit_code, result.stderr) == (0, "")
    assert tools.calls == [("x", "{}"), ("y", '{"k": 1}'), ("zz", "[]")]
    assert all(b["tools"] == tools.specs and b["model"] == "m" for b in bodies)
    # Each request extends the previous one: the reply as it came (None fields dropped), then one result per call.
    assert bodies[1]["messages"][1:] == [
        {"role": "assistant", "content": "", "tool_calls": [call("a", "x", "{}")]},
        {"role": "tool", "tool_call_id": "a", "content": "1"},
    ]
    assert bodies[2]["messages"][3:] == [
        {"role": "assistant", "tool_calls": second["tool_calls"]},
        {"role": "tool", "tool_call_id": "b", "content": "2"},
        {"role": "tool", "tool_call_id": "c", "content": "Error: unknown tool 'zz'"},
    ]


def test_loop_ends_the_program_when_a_turn_is_refused():
    post, bodies = scripted_post([(200, {"role": "assistant", "tool_calls": [call("a", "x", "{}")]}), (400, "stop")])
    result = asyncio.run(prime_chat.tool_loop(post, "m", [{"role": "user", "content": "go"}], FakeTools({"x": "1"})))
    assert (result.exit_code, result.stderr, len(bodies)) == (1, "stop", 2)


def test_a_bad_call_is_an_error_text_not_an_exception():
    tools = McpTools(timeout=1.0)
    tools._routes["t_add"] = (None, "add")  # never reached: each of these is refused before any server call
    assert asyncio.run(tools.call("nope", "{}")) == "Error: unknown tool 'nope'; the tools are: t_add"
    assert asyncio.run(tools.call("t_add", '{"a": 1')).startswith("Error: the arguments are not valid JSON")
    assert asyncio.run(tools.call("t_add", "[1, 2]")) == "Error: the arguments must be a JSON object, got list"


# --- real verifiers, real MCP servers, a scripted model ---------------------------------------------------------


@pytest.fixture
def tools_env_path(monkeypatch):
    """vf_tools_env importable here and in the tool-server processes verifiers starts (`python -m vf_tools_env`)."""
    monkeypatch.syspath_prepend(INTEGRATION)
    monkeypatch.syspath_prepend(ENVIRONMENTS)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [INTEGRATION, os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("SCRIPTED_KEY", "k")


# What the scripted model calls, turn by turn (then it answers in text).
CALLS = [
    ("t_bump", "{}"),
    ("s_bump", "{}"),
    ("t_bump", "{}"),
    ("s_bump", "{}"),
    ("t_boom", "{}"),
    ("t_add", '{"a": "many", "b": 2}'),
    ("t_add", '{"a": 1'),
    ("t_nope", "{}"),
    ("s_nap", '{"seconds": 30}'),
    ("s_add", '{"a": 7, "b": 5}'),
]


def script(body: dict) -> dict:
    turn = sum(m["role"] == "assistant" for m in body["messages"])
    if turn == len(CALLS):
        return {"content": "done"}
    name, arguments = CALLS[turn]
    return {"content": "", "tool_calls": [call(f"call_{turn}", name, arguments)]}


def run_tool_episodes(n: int, max_turns: int | None = None):
    from env_testkit import run_episodes

    config = {
        "taskset": {"id": "vf-tools-env"},
        "agent": {
            "harness": {"id": "prime-chat", "tool_timeout": 3},
            "runtime": {"type": "subprocess"},
            "max_turns": max_turns,
        },
    }
    return asyncio.run(run_episodes(config, script, lambda env: list(env.taskset.take(n)), api_key_var="SCRIPTED_KEY"))


def test_tools_through_verifiers_and_real_mcp_servers_of_both_lifecycles(tools_env_path):
    episodes, requests = run_tool_episodes(2)
    traces = [episode.traces[0] for episode in episodes]
    assert all(e.ok and not t.has_error for e, t in zip(episodes, traces, strict=True)), [e.errors for e in episodes]
    # Listed: both servers' four tools, named <server>_<tool> as verifiers' own harnesses name them.
    offered = {tool["function"]["name"] for tool in requests[0]["tools"]}
    assert offered == {f"{s}_{t}" for s in "ts" for t in ("bump", "add", "boom", "nap")}
    for trace in traces:
        results = [m.content for m in trace.tool_messages]
        assert [m.tool_call_id for m in trace.tool_messages] == [f"call_{i}" for i in range(len(CALLS))]
        t_pid, s_pid = results[0].split()[1], results[1].split()[1]
        # Called, and state kept per rollout: the rollout's one state (both servers read and write it) counts this
        # rollout's bumps from 0, on the shared server too.
        assert results[:4] == [f"1 {t_pid}", f"2 {s_pid}", f"3 {t_pid}", f"4 {s_pid}"]
        assert trace.state.count == 4  # and the trace holds it
        assert results[4].startswith("Error") and "boom: this tool always raises" in results[4]  # raised
        assert results[5].startswith("Error") and "validation error" in results[5]  # bad arguments
        assert results[6].startswith("Error: the arguments are not valid JSON")  # malformed call
        assert results[7].startswith("Error: unknown tool 't_nope'")
        assert results[8] == "Error: tool 's_nap' timed out after 3 s"  # hangs past harness.tool_timeout
        assert results[9] == "12"  # the server still serves after a timed-out call
        assert trace.last_reply == "done" and trace.num_branches == 1
        assert trace.metrics["tool_errors"] == 5 and trace.metrics["err_timeout"] == 1
    pids = [[int(m.content.split()[1]) for m in t.tool_messages[:2]] for t in traces]
    assert pids[0][0] != pids[1][0]  # one task-scoped server per rollout
    assert pids[0][1] == pids[1][1]  # one shared server for the worker
    assert not any(psutil.pid_exists(pid) for pid in {p for pair in pids for p in pair})  # all torn down


def test_max_turns_ends_the_tool_loop_as_a_stop_not_an_error(tools_env_path):
    episodes, requests = run_tool_episodes(1, max_turns=2)
    (trace,) = episodes[0].traces
    assert episodes[0].ok and not trace.has_error and trace.stop_condition == "max_turns"
    assert trace.num_turns == 2 and len(requests) == 2


def test_a_task_without_tools_makes_no_mcp_client(monkeypatch):
    """The single-call path: mcp_urls empty, so no MCP client is built and the request carries no tools."""
    monkeypatch.setattr(McpTools, "connect", None)  # calling it would raise
    post, bodies = scripted_post([(200, {"role": "assistant", "content": "hi"})])
    monkeypatch.setattr(prime_chat, "post_chat", lambda endpoint, secret, body: post(body))
    harness = prime_chat.ChatHarness(None)
    harness.resolve_prompt = lambda data: (None, "hello")
    result = asyncio.run(harness.launch(type("Ctx", (), {"model": "m"}), None, None, "http://x/v1", "k", {}, None))
    assert result.exit_code == 0 and bodies == [{"model": "m", "messages": [{"role": "user", "content": "hello"}]}]
    assert "tools" not in bodies[0]
