"""calculator: arithmetic word problems on bigger numbers, with a `calculate(expression)` tool.

The tool is an MCP server written the verifiers-v1 way (`calculator.tools.CalculatorTools`, a `vf.Toolset`): one
server per environment worker (`Taskset.toolsets`), shared by its rollouts; the tool keeps no state. It evaluates
with a safe evaluator (numbers, + - * /, parentheses and unary minus only; parsed with `ast`, never `eval`). The
taskset brings no harness: any MCP-capable harness plays it (prime-rl's in-process `prime-chat`, verifiers' `null`
or `bash`), looping until the model answers without a tool call; a `@vf.stop` ends the episode after `max_turns`
model calls.

Reward `correct`: the final answer (the last number in the last assistant message, if that message made no tool
call) equals the true result. Metrics: `tool_calls`, `tool_errors`, `answered`.
"""

from __future__ import annotations

import ast
import operator
import random
import re
from fractions import Fraction
from typing import Literal

import verifiers.v1 as vf
from pydantic import Field
from verifiers.v1.types import content_text

SYSTEM_PROMPT = "Solve the problem. You may use the calculate tool. End with the final answer as a number."

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


def problem(rng: random.Random, digits: int, style: str = "word") -> tuple[str, str, int]:
    """One (problem, expression, integer answer); operands have `digits` digits, counts 2-99. `style="plain"` asks
    for the expression itself (`What is 45 + 12 * 67?`) instead of a word problem."""
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
    if style == "plain":
        text = f"What is {expression}?"
    return text, expression, int(value)


class CalculatorTask(vf.Task[CalculatorData]):
    @vf.stop
    async def out_of_turns(self, trace: vf.Trace) -> bool:
        """`max_turns` model calls were made (checked before each call, like an agent's `max_turns`)."""
        return trace.num_turns >= self.data.max_turns

    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        return float(final_answer(trace) == self.data.answer)

    @vf.metric
    async def tool_calls(self, trace: vf.Trace) -> float:
        return float(sum(len(m.tool_calls or []) for m in trace.assistant_messages))

    @vf.metric
    async def tool_errors(self, trace: vf.Trace) -> float:
        return float(sum(content_text(m.content).startswith("Error") for m in trace.tool_messages))

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
    style: Literal["word", "plain"] = "word"
    """`word`: word problems; `plain`: the expression itself (`What is 45 + 12 * 67?`), which a tiny model learns to
    pass to the tool by copying (the tool-use demo, configs/calculator/)."""
    tools: vf.SharedToolsetConfig = vf.SharedToolsetConfig()
    """Where the tool server runs (default: a local subprocess, one per environment worker)."""


def generate(config: CalculatorConfig) -> list[tuple[str, str, int]]:
    """(problem, expression, answer) triples, deterministic in `config.seed`."""
    rng = random.Random(config.seed)
    return [problem(rng, config.digits, config.style) for _ in range(config.num_tasks)]


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

    @classmethod
    def toolsets(cls, config: CalculatorConfig) -> list[vf.Toolset]:
        from calculator.tools import CalculatorTools

        return [CalculatorTools(config.tools)]


__all__ = ["CalculatorTaskset"]
