"""calculator: arithmetic word problems on bigger numbers, with a `calculate(expression)` tool.

The exported in-process harness `CalculatorHarness` (harness id `calculator`, the taskset's default) offers the
tool as an OpenAI function tool, executes the model's tool calls with a safe evaluator (numbers, + - * /,
parentheses and unary minus only; parsed with `ast`, never `eval`), sends the results back as `tool` messages and
continues until the model answers without a tool call or `max_turns` model calls were made.

Reward `correct`: the final answer (the last number in the last assistant message, if that message made no tool
call) equals the true result. Metrics: `tool_calls`, `tool_errors`, `answered`.
"""

from __future__ import annotations

import ast
import asyncio
import json
import operator
import random
import re
from fractions import Fraction

import httpx
import verifiers.v1 as vf
from pydantic import Field
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.types import content_text

SYSTEM_PROMPT = "Solve the problem. You may use the calculate tool. End with the final answer as a number."

CALCULATE_TOOL = {
    "type": "function",
    "function": {
        "name": "calculate",
        "description": "Evaluate an arithmetic expression: numbers, + - * / and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. (1200 + 345) * 12"}},
            "required": ["expression"],
        },
    },
}

# --- the safe evaluator -----------------------------------------------------------------------------------------

MAX_EXPRESSION_CHARS = 200


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate; the message is shown to the model."""


_BINARY_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _evaluate(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        try:
            # Exact: ints stay ints, a float literal is read as the decimal it was written as (0.1 -> 1/10).
            return Fraction(node.value if isinstance(node.value, int) else repr(node.value))
        except (OverflowError, ValueError):  # inf from an out-of-range literal such as 1e999
            raise CalculatorError("number out of range") from None
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise CalculatorError("division by zero")
        return _BINARY_OPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate(node.operand)
    raise CalculatorError(f"unsupported syntax ({type(node).__name__}); use numbers, + - * / and parentheses")


def safe_eval(expression: str) -> Fraction:
    """Evaluate `expression` exactly. Only number literals, binary + - * /, unary minus and parentheses are
    accepted; names, attributes, calls, subscripts, ** and everything else raise `CalculatorError`."""
    if not isinstance(expression, str):
        raise CalculatorError("the expression must be a string")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise CalculatorError("invalid expression") from None
    return _evaluate(tree.body)


def format_number(value: Fraction) -> str:
    """An integer as digits; anything else as a decimal rounded to 10 places (`7/2` -> `3.5`, `1/3` -> `0.3333333333`)."""
    if value.denominator == 1:
        return str(value.numerator)
    try:
        text = f"{float(value):.10f}".rstrip("0").rstrip(".")
    except OverflowError:
        return str(value)
    return text if text not in ("", "-0") else "0"


def calculate(expression: str) -> str:
    """The tool: the value of `expression`, or `Error: ...`."""
    try:
        return format_number(safe_eval(expression))
    except CalculatorError as e:
        return f"Error: {e}"


def run_tool_call(name: str | None, arguments: str | None) -> str:
    """Execute one tool call as the model sent it (a function name and JSON arguments)."""
    if name != "calculate":
        return f"Error: unknown tool {name!r}; the only tool is calculate."
    try:
        args = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        args = None
    if not isinstance(args, dict) or not isinstance(args.get("expression"), str | int | float):
        return 'Error: arguments must be a JSON object like {"expression": "12 * (3 + 4)"}.'
    return calculate(str(args["expression"]))


# --- answers ----------------------------------------------------------------------------------------------------

_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?")


def parse_number(text: str | None) -> Fraction | None:
    """The last number in `text` (optional sign, optional thousands commas, optional decimals), or None."""
    matches = _NUMBER.findall(text or "")
    return Fraction(matches[-1].replace(",", "")) if matches else None


def final_answer(trace: vf.Trace) -> Fraction | None:
    """The number in the model's last message, if that message is a final answer (made no tool call)."""
    replies = trace.assistant_messages
    if not replies or replies[-1].tool_calls:
        return None
    return parse_number(replies[-1].content)


# --- the data ---------------------------------------------------------------------------------------------------


class CalculatorData(vf.TaskData):
    expression: str
    """The computation the problem describes."""
    answer: int
    max_turns: int
    """Model calls allowed (tool rounds included)."""


def problem(rng: random.Random, digits: int) -> tuple[str, str, int]:
    """One (word problem, expression, integer answer); operands have `digits` digits, counts 2-99."""
    low, high = 10 ** (digits - 1), 10**digits - 1

    def big() -> int:
        return rng.randint(low, high)

    def small() -> int:
        return rng.randint(2, 99)

    kind = rng.randrange(5)
    if kind == 0:
        a, b, c = big(), small(), big()
        text = f"A warehouse holds {a} boxes. {b} trucks deliver {c} boxes each. How many boxes does it hold now?"
        expression = f"{a} + {b} * {c}"
    elif kind == 1:
        a, b = big(), small()
        c = rng.randint(1, a * b - 1)
        text = f"A farm packs {a} crates of {b} apples each and sells {c} apples. How many apples are left?"
        expression = f"{a} * {b} - {c}"
    elif kind == 2:
        a, b, c, d = small(), big(), small(), big()
        text = (
            f"A school buys {a} laptops at {b} dollars each and {c} desks at {d} dollars each. "
            "How many dollars does it spend?"
        )
        expression = f"{a} * {b} + {c} * {d}"
    elif kind == 3:
        share, teams = big(), small()
        text = f"{share * teams} dollars are split equally among {teams} teams. How many dollars does each team get?"
        expression = f"{share * teams} / {teams}"
    else:
        b, c = big(), small()
        a = b * c + big()
        text = f"A tank holds {a} liters. {b} liters drain out every hour for {c} hours. How many liters are left?"
        expression = f"{a} - {b} * {c}"
    value = safe_eval(expression)
    assert value.denominator == 1 and value > 0
    return text, expression, int(value)


class CalculatorTask(vf.Task[CalculatorData]):
    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        return float(final_answer(trace) == self.data.answer)

    @vf.metric
    async def tool_calls(self, trace: vf.Trace) -> float:
        return float(sum(len(m.tool_calls or []) for m in trace.assistant_messages))

    @vf.metric
    async def tool_errors(self, trace: vf.Trace) -> float:
        return float(sum(content_text(m.content).startswith("Error:") for m in trace.tool_messages))

    @vf.metric
    async def answered(self, trace: vf.Trace) -> float:
        return float(final_answer(trace) is not None)


class CalculatorConfig(vf.TasksetConfig):
    num_tasks: int = Field(1000, ge=1)
    """Number of tasks generated."""
    seed: int = 0
    """Generator seed: the same seed always yields the same tasks."""
    digits: int = Field(3, ge=2, le=9)
    """Digits of the big operands (counts such as trucks or teams are 2-99)."""
    max_turns: int = Field(3, ge=1)
    """Model calls per episode, tool rounds included."""


def generate(config: CalculatorConfig) -> list[tuple[str, str, int]]:
    """(problem, expression, answer) triples, deterministic in `config.seed`."""
    rng = random.Random(config.seed)
    return [problem(rng, config.digits) for _ in range(config.num_tasks)]


class CalculatorTaskset(vf.Taskset[CalculatorTask, CalculatorConfig]):
    def load(self):
        for text, expression, answer in generate(self.config):
            data = CalculatorData(
                prompt=text,
                system_prompt=SYSTEM_PROMPT,
                expression=expression,
                answer=answer,
                max_turns=self.config.max_turns,
            )
            yield CalculatorTask(data, self.config.task)


# --- the harness ------------------------------------------------------------------------------------------------

_HTTP_CLIENTS: dict[asyncio.AbstractEventLoop, httpx.AsyncClient] = {}


def http_client() -> httpx.AsyncClient:
    """One shared client per event loop, created on first use and never closed by a rollout (creating one per
    rollout costs ~20 ms of TLS-context setup, and closing a shared one breaks its siblings)."""
    loop = asyncio.get_running_loop()
    client = _HTTP_CLIENTS.get(loop)
    if client is None:
        for old in [old for old in _HTTP_CLIENTS if old.is_closed()]:
            del _HTTP_CLIENTS[old]
        # The endpoint is verifiers' local interception server: no proxies, no read timeout (the rollout's own
        # deadline bounds a turn), no pool cap (one connection per rollout in flight).
        client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=30.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=1024),
            trust_env=False,
        )
        _HTTP_CLIENTS[loop] = client
    return client


async def chat_completion(endpoint: str, secret: str, body: dict) -> dict:
    """POST `{endpoint}/chat/completions` and return `choices[0]` of the response."""
    response = await http_client().post(
        f"{endpoint.rstrip('/')}/chat/completions", json=body, headers={"Authorization": f"Bearer {secret}"}
    )
    if response.status_code != 200:
        # The interception server records the real cause (a stop condition or provider error) on the trace.
        raise RuntimeError(f"chat completion failed: HTTP {response.status_code}: {response.text[:500]}")
    return response.json()["choices"][0]


def initial_messages(harness: vf.Harness, data: vf.TaskData) -> list[dict]:
    system, prompt = harness.resolve_prompt(data)
    messages = [{"role": "system", "content": system}] if system else []
    if isinstance(prompt, str):
        messages.append({"role": "user", "content": prompt})
    else:
        messages += [message_to_wire(m) for m in prompt or []]
    return messages


def assistant_echo(message: dict, tool_calls: list[dict]) -> dict:
    """The reply as the next request's assistant message: text, reasoning and tool calls as returned (so the trace
    recognizes it as the turn it recorded)."""
    echo: dict = {"role": "assistant", "content": message.get("content") or ("" if not tool_calls else None)}
    for key in ("reasoning_content", "reasoning"):
        if message.get(key):
            echo[key] = message[key]
            break
    if tool_calls:
        echo["tool_calls"] = tool_calls
    return echo


def function_calls(message: dict) -> list[dict]:
    """The message's function tool calls in wire form (`id`, `type`, `function.name`, `function.arguments`)."""
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        calls.append(
            {
                "id": call.get("id") or f"call_{len(calls)}",
                "type": "function",
                "function": {"name": function.get("name") or "", "arguments": function.get("arguments") or ""},
            }
        )
    return calls


class CalculatorHarness(vf.Harness[vf.HarnessConfig]):
    """A chat loop with the `calculate` tool, in this process; tools run here, not in the runtime."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True  # a stateless chat + tool loop can continue from any transcript
    EXECUTES_CODE = False  # the model gets an arithmetic evaluator, not code execution
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data):
        messages = initial_messages(self, data)
        for _ in range(data.max_turns):
            body = {"model": ctx.model, "messages": messages, "tools": [CALCULATE_TOOL]}
            message = (await chat_completion(endpoint, secret, body))["message"]
            calls = function_calls(message)
            messages.append(assistant_echo(message, calls))
            if not calls:
                break
            for call in calls:
                result = run_tool_call(call["function"]["name"], call["function"]["arguments"])
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        return vf.ProgramResult(0, "", "")


__all__ = ["CalculatorTaskset", "CalculatorHarness"]
