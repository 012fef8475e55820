"""propose_solve: one policy proposes an arithmetic problem and attempts it (a verifiers v1 multi-agent `Env`).

One episode: the `proposer` seat gets a source task ("Write an addition problem with two numbers between 10 and
99, then its answer, ..."), and the env parses its reply into a problem (`A + B`) and the proposer's stated answer.
A proposal is valid when it parses, matches the source task (its operation, both numbers in the range) and states
the true answer. Then `num_solvers` attempts of the one `solver` role each get the problem ("What is A + B? Answer
with the number only."), one turn each; a solver's answer is the last integer of its reply. An invalid proposal
runs no solver: the solvers' traces are opened and closed without a turn (no model call, nothing to train).

`ProposeSolveEnv.finalize` scores it: a solver gets reward `correct` 1.0 when its answer is the problem's true
answer, else 0.0 (always 0.0 for an invalid proposal); the proposer gets reward `learnability`, 0.0 for an invalid
proposal, else `1 - |solve_rate - 0.5| * 2`: highest when the solvers split, zero when all succeed or all fail
(then a group-relative solver advantage is zero: the problem teaches the solvers nothing). Metrics on every trace:
`valid_proposal`, and `solve_rate` (only for valid proposals). The episode's facts go to every trace's
`info["propose_solve"]`.

The solvers are one role run `num_solvers` times (as verifiers' best-of-n runs its `agent`): each trace's
`agent.name` is `solver`, so they share one seat's config, baseline and metrics, and the solver traces of one episode
are exactly the attempts at one proposed problem.

Exports (`__all__`): `ProposeSolveTaskset` (taskset id `propose-solve`), `ProposeSolveEnv` (its env), and
`ProposeSolveHarness` (harness id `propose-solve`), an in-process chat harness making one completion per segment.
"""

from __future__ import annotations

import asyncio
import contextlib
import operator
import random
import re
from typing import Literal

import aiohttp
import verifiers.v1 as vf
from pydantic import Field
from verifiers.v1.dialects.chat import message_to_wire

PROPOSER, SOLVER = "proposer", "solver"
"""The roles (the `ProposeSolveEnvConfig` fields, and each trace's `agent.name`)."""

OPERATIONS = {
    "+": ("an addition", operator.add),
    "-": ("a subtraction", operator.sub),
    "*": ("a multiplication", operator.mul),
}
"""Each operation's name in the source task and its value."""

_INTEGER = re.compile(r"[-+]?\d+")
_PROBLEM = re.compile(r"problem\s*:\s*(\d+)\s*([-+*x×])\s*(\d+)", re.IGNORECASE)
_ANSWER = re.compile(r"answer\s*:\s*([-+]?\d+)", re.IGNORECASE)


def source_prompt(op: str, low: int, high: int) -> str:
    """What the proposer is asked."""
    name = OPERATIONS[op][0]
    return (
        f"Write {name} problem with two numbers between {low} and {high}, then its answer, as "
        f"`Problem: A {op} B` and `Answer: C` on two lines."
    )


def solve_prompt(problem: str) -> str:
    """What each solver is asked."""
    return f"What is {problem}? Answer with the number only."


def parse_answer(reply: str | None) -> int | None:
    """A solver's answer: the last integer in its reply (sign included), or None."""
    matches = _INTEGER.findall(reply or "")
    return int(matches[-1]) if matches else None


def judge_proposal(reply: str | None, op: str, low: int, high: int) -> dict:
    """The proposal's facts: `problem` ("A op B", None when the reply has no problem matching the source task:
    its operation, both numbers in [low, high]), its true `answer`, the proposer's `stated_answer` (None: none
    stated) and `valid` (a problem whose stated answer is the true one). The first `Problem:` and `Answer:` count."""
    problem = _PROBLEM.search(reply or "")
    stated = _ANSWER.search(reply or "")
    facts = {"problem": None, "answer": None, "stated_answer": int(stated.group(1)) if stated else None}
    if problem is not None:
        a, symbol, b = int(problem.group(1)), problem.group(2), int(problem.group(3))
        symbol = "*" if symbol in "x×" else symbol
        if symbol == op and low <= a <= high and low <= b <= high:
            facts["problem"], facts["answer"] = f"{a} {op} {b}", OPERATIONS[op][1](a, b)
    facts["valid"] = facts["problem"] is not None and facts["stated_answer"] == facts["answer"]
    return facts


def solve_rate(facts: dict) -> float:
    """The fraction of solvers whose answer is the true one."""
    answers = facts["solver_answers"]
    return sum(answer == facts["answer"] for answer in answers) / len(answers)


def learnability(rate: float) -> float:
    """1 at a solve rate of 1/2, falling linearly to 0 at 0 and 1 (with 3 solvers: 0, 2/3, 2/3, 0)."""
    return 1.0 - abs(rate - 0.5) * 2


def proposer_reward(facts: dict) -> float:
    return learnability(solve_rate(facts)) if facts["valid"] else 0.0


def solver_reward(facts: dict, index: int) -> float:
    return float(facts["valid"] and facts["solver_answers"][index] == facts["answer"])


# --- the taskset ------------------------------------------------------------------------------------------------


class ProposeData(vf.TaskData):
    op: Literal["+", "-", "*"]
    """The operation the proposed problem must use."""
    low: int
    """Both numbers of the proposed problem lie in [low, high]."""
    high: int


class ProposeTask(vf.Task[ProposeData]):
    """No per-trace rewards: every reward depends on the whole episode, scored by `ProposeSolveEnv.finalize`."""


class ProposeSolveConfig(vf.TasksetConfig):
    num_tasks: int = Field(1000, ge=1)
    """Number of tasks generated."""
    seed: int = 0
    """Generator seed: the same seed always yields the same tasks."""
    operations: list[Literal["+", "-", "*"]] = Field(default_factory=lambda: ["+", "-", "*"], min_length=1)
    """A task's operation is drawn uniformly from these."""
    max_digits: int = Field(2, ge=1, le=6)
    """A task's numbers have d digits, d drawn uniformly from [1, max_digits] (1 digit: 1 to 9)."""


def generate(config: ProposeSolveConfig) -> list[tuple[str, int, int]]:
    """The source tasks as (op, low, high), deterministic in `config.seed`."""
    rng = random.Random(config.seed)
    tasks = []
    for _ in range(config.num_tasks):
        op, digits = rng.choice(config.operations), rng.randint(1, config.max_digits)
        tasks.append((op, 1 if digits == 1 else 10 ** (digits - 1), 10**digits - 1))
    return tasks


class ProposeSolveTaskset(vf.Taskset[ProposeTask, ProposeSolveConfig]):
    def load(self):
        for op, low, high in generate(self.config):
            data = ProposeData(prompt=source_prompt(op, low, high), op=op, low=low, high=high)
            yield ProposeTask(data, self.config.task)


# --- the env ----------------------------------------------------------------------------------------------------


class ProposeSolveEnvConfig(vf.EnvConfig):
    # Tool-less chat turns, so both roles run locally by default (verifiers' default is a remote sandbox).
    proposer: vf.AgentConfig = vf.AgentConfig(runtime=vf.SubprocessConfig())
    """Writes the problem."""
    solver: vf.AgentConfig = vf.AgentConfig(runtime=vf.SubprocessConfig())
    """Attempts it, `num_solvers` times per episode."""
    num_solvers: int = Field(3, ge=1)
    """Solver attempts per valid proposal."""


class ProposeSolveEnv(vf.Env[ProposeSolveEnvConfig]):
    async def run(self, task: ProposeTask, agents: vf.Agents) -> None:
        data, count = task.data, self.config.num_solvers
        proposer = await agents.proposer.run(task)
        facts = {"source": {"op": data.op, "low": data.low, "high": data.high, "prompt": data.prompt}}
        facts |= {"proposal": proposer.last_reply} | judge_proposal(proposer.last_reply, data.op, data.low, data.high)
        if facts["valid"]:
            solve_task = vf.Task(vf.TaskData(idx=data.idx, prompt=solve_prompt(facts["problem"])))
            async with asyncio.TaskGroup() as group:  # a raising attempt cancels its siblings
                runs = [group.create_task(agents.solver.run(solve_task)) for _ in range(count)]
            solvers = [run.result() for run in runs]
            facts["solver_answers"] = [parse_answer(trace.last_reply) for trace in solvers]
        else:
            # Nothing to solve: each solver's trace exists (the episode's shape does not depend on the proposal),
            # with no model call and so nothing to train.
            idle = vf.Task(vf.TaskData(idx=data.idx, prompt=None))
            async with contextlib.AsyncExitStack() as stack:
                opened = [await stack.enter_async_context(agents.solver.interaction(idle)) for _ in range(count)]
            solvers = [interaction.trace for interaction in opened]
            facts["solver_answers"] = [None] * count
        proposer.info["propose_solve"] = facts | {"solver": None}
        for index, trace in enumerate(solvers):
            trace.info["propose_solve"] = facts | {"solver": index}

    async def finalize(self, task: ProposeTask, episode: vf.Episode) -> None:
        by_role = episode.by_agent
        count = self.config.num_solvers
        if len(by_role.get(PROPOSER, [])) != 1 or len(by_role.get(SOLVER, [])) != count or len(by_role) != 2:
            found = {name: len(traces) for name, traces in by_role.items()}
            raise ValueError(f"propose-solve needs 1 {PROPOSER} trace and {count} {SOLVER} traces; got {found}")
        (proposer,), solvers = by_role[PROPOSER], by_role[SOLVER]
        facts = proposer.info.get("propose_solve")
        if facts is None or any(_shared(t.info.get("propose_solve")) != _shared(facts) for t in solvers):
            raise ValueError("the traces do not carry the same episode facts (info['propose_solve'])")
        if sorted(t.info["propose_solve"]["solver"] for t in solvers) != list(range(count)):
            raise ValueError("the solver traces' indices are not 0..num_solvers-1")
        metrics = {"valid_proposal": float(facts["valid"])}
        if facts["valid"]:
            metrics["solve_rate"] = solve_rate(facts)
        proposer.record_reward("learnability", proposer_reward(facts))
        proposer.record_metrics(metrics)
        for trace in solvers:
            trace.record_reward("correct", solver_reward(facts, trace.info["propose_solve"]["solver"]))
            trace.record_metrics(metrics)


def _shared(facts: dict | None) -> dict | None:
    """The facts every trace of the episode shares (all but the trace's own solver index)."""
    return None if facts is None else {k: v for k, v in facts.items() if k != "solver"}


# --- the harness ------------------------------------------------------------------------------------------------


def chat_messages(system: str | None, prompt) -> list[dict]:
    messages = [{"role": "system", "content": system}] if system else []
    if isinstance(prompt, str):
        return messages + [{"role": "user", "content": prompt}]
    return messages + [m if isinstance(m, dict) else message_to_wire(m) for m in prompt or []]


class ProposeSolveHarness(vf.Harness[vf.HarnessConfig]):
    """One chat completion per segment, made in this process (no subprocess, no `uv`). Each call opens its own
    aiohttp session: that costs about 10 microseconds, and every seat makes one call per episode, so a shared pool
    would buy nothing worth its lifetime management. Resumable (verifiers' relaunch on the conversation so far),
    which lets the env open a solver's interaction that never takes a turn."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, *args, **kwargs):
        system, prompt = self.resolve_prompt(data)
        body = {"model": ctx.model, "messages": chat_messages(system, prompt)}
        url = f"{endpoint.rstrip('/')}/chat/completions"
        # The endpoint is verifiers' local interception server: no proxies, no total timeout (the rollout's own
        # deadline bounds a turn).
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30.0)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async with session.post(url, json=body, headers={"Authorization": f"Bearer {secret}"}) as response:
                text = await response.text()
        if response.status == 200:
            return vf.ProgramResult(0, "", "")
        # The interception server records the real cause (a stop condition or provider error) on the trace.
        return vf.ProgramResult(1, "", f"chat completion failed: HTTP {response.status}: {text[:2000]}")


__all__ = ["ProposeSolveTaskset", "ProposeSolveEnv", "ProposeSolveHarness"]
