import asyncio
import re

import env_testkit as kit
import pytest
import verifiers.v1 as vf
from propose_solve import (
    OPERATIONS,
    ProposeData,
    ProposeSolveConfig,
    ProposeSolveEnv,
    ProposeSolveEnvConfig,
    ProposeSolveHarness,
    ProposeSolveTaskset,
    ProposeTask,
    judge_proposal,
    learnability,
    parse_answer,
    proposer_reward,
    solve_prompt,
    solve_rate,
    solver_reward,
    source_prompt,
)

# verifiers keeps some asyncio state bound to the loop that first used it: one loop for this module.
LOOP = asyncio.new_event_loop()
API_KEY_VAR = "PROPOSE_SOLVE_TEST_API_KEY"


# --- parsing and rewards ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reply", "answer"),
    [("68", 68), (" 68\n", 68), ("The answer is -22.", -22), ("23 + 45 = 68", 68), ("sixty-eight", None), (None, None)],
)
def test_parse_answer(reply, answer):
    assert parse_answer(reply) == answer


def judged(reply, op="+", low=10, high=99):
    facts = judge_proposal(reply, op, low, high)
    return facts["problem"], facts["answer"], facts["stated_answer"], facts["valid"]


def test_judge_proposal():
    assert judged("Problem: 23 + 45\nAnswer: 68") == ("23 + 45", 68, 68, True)
    assert judged("Sure!\nproblem:23+45 = ?\nANSWER : 68\nThanks") == ("23 + 45", 68, 68, True)
    assert judged("Problem: 23 - 45\nAnswer: -22", "-") == ("23 - 45", -22, -22, True)
    for times in ("*", "x", "×"):
        assert judged(f"Problem: 12 {times} 11\nAnswer: 132", "*") == ("12 * 11", 132, 132, True)
    assert judged("Problem: 3 * 4\nAnswer: 12", "*", 1, 9) == ("3 * 4", 12, 12, True)
    # the first Problem and Answer count
    assert judged("Problem: 10 + 10\nAnswer: 20\nProblem: 11 + 11\nAnswer: 23") == ("10 + 10", 20, 20, True)


def test_judge_proposal_refuses():
    assert judged("Problem: 23 + 45\nAnswer: 69") == ("23 + 45", 68, 69, False)  # wrong stated answer
    assert judged("Problem: 23 + 45") == ("23 + 45", 68, None, False)  # no stated answer
    assert judged("Problem: 23 - 45\nAnswer: -22") == (None, None, -22, False)  # another operation
    assert judged("Problem: 5 + 45\nAnswer: 50") == (None, None, 50, False)  # a number out of range
    assert judged("Problem: 23 + 100\nAnswer: 123") == (None, None, 123, False)
    assert judged("23 + 45 = 68") == (None, None, None, False)  # no Problem/Answer lines
    assert judged("") == judged(None) == (None, None, None, False)


def facts(answers, answer=68, valid=True):
    return {"valid": valid, "answer": answer, "solver_answers": answers}


def test_rewards():
    assert [learnability(r) for r in (0.0, 0.25, 0.5, 0.75, 1.0)] == [0.0, 0.5, 1.0, 0.5, 0.0]
    assert [learnability(k / 3) for k in range(4)] == pytest.approx([0.0, 2 / 3, 2 / 3, 0.0])
    mixed = facts([68, 67, 68])
    assert solve_rate(mixed) == pytest.approx(2 / 3)
    assert proposer_reward(mixed) == pytest.approx(2 / 3)
    assert [solver_reward(mixed, i) for i in range(3)] == [1.0, 0.0, 1.0]
    assert proposer_reward(facts([68, 68, 68])) == 0.0 == proposer_reward(facts([None, 1, 2]))
    assert proposer_reward(facts([68, 67])) == 1.0
    invalid = facts([None, None, None], answer=None, valid=False)
    assert proposer_reward(invalid) == 0.0 and [solver_reward(invalid, i) for i in range(3)] == [0.0] * 3


# --- taskset and config -----------------------------------------------------------------------------------------


def sources(**args):
    return [(t.data.op, t.data.low, t.data.high) for t in ProposeSolveTaskset(ProposeSolveConfig(**args))]


def test_generation_is_deterministic_and_configurable():
    assert sources(num_tasks=40, seed=5) == sources(num_tasks=40, seed=5)
    assert sources(num_tasks=40, seed=5) != sources(num_tasks=40, seed=6)
    assert set(sources(num_tasks=300)) == {(op, low, high) for op in "+-*" for low, high in ((1, 9), (10, 99))}
    assert {s[0] for s in sources(num_tasks=50, operations=["*"])} == {"*"}
    assert {s[1:] for s in sources(num_tasks=300, max_digits=3)} == {(1, 9), (10, 99), (100, 999)}
    (task,) = ProposeSolveTaskset(ProposeSolveConfig(num_tasks=1, operations=["+"], max_digits=1))
    assert (task.data.op, task.data.low, task.data.high, task.data.system_prompt) == ("+", 1, 9, None)
    assert task.data.prompt == (
        "Write an addition problem with two numbers between 1 and 9, then its answer, as "
        "`Problem: A + B` and `Answer: C` on two lines."
    )
    assert source_prompt("*", 10, 99).startswith("Write a multiplication problem with two numbers between 10 and 99")
    assert solve_prompt("23 - 45") == "What is 23 - 45? Answer with the number only."
    for bad in ({"max_digits": 0}, {"num_tasks": 0}, {"operations": []}, {"operations": ["/"]}):
        with pytest.raises(ValueError):
            ProposeSolveConfig(**bad)


def test_env_config_with_only_the_taskset():
    config = vf.resolve_env_config({"taskset": {"id": "propose-solve"}})
    assert type(config) is ProposeSolveEnvConfig and isinstance(config.taskset, ProposeSolveConfig)
    assert (config.taskset.num_tasks, config.taskset.max_digits, config.num_solvers) == (1000, 2, 3)
    for role in (config.proposer, config.solver):
        assert role.harness is None and role.runtime.type == "subprocess"
    assert {name: h.id for name, h in config.agent_harnesses().items()} == {
        "proposer": "propose-solve",
        "solver": "propose-solve",
    }
    assert ProposeSolveHarness.SUPPORTS_RESUME and not ProposeSolveHarness.EXECUTES_CODE
    env = vf.load_environment(config)
    assert type(env) is ProposeSolveEnv and len(list(env.taskset)) == 1000


def test_env_config_with_overrides_and_refusals():
    config = vf.resolve_env_config(
        {
            "taskset": {"id": "propose-solve", "num_tasks": 5, "operations": ["-"]},
            "solver": {"sampling": {"temperature": 0.7}, "max_turns": 1},
            "num_solvers": 5,
        }
    )
    assert (config.num_solvers, config.solver.sampling.temperature, config.solver.runtime.type) == (
        5,
        0.7,
        "subprocess",
    )
    assert [t.data.op for t in vf.load_environment(config).taskset] == ["-"] * 5
    with pytest.raises(ValueError, match="agent"):
        vf.resolve_env_config({"taskset": {"id": "propose-solve"}, "agent": {"max_turns": 3}})
    with pytest.raises(ValueError):
        vf.resolve_env_config({"taskset": {"id": "propose-solve"}, "num_solvers": 0})


def test_prime_rl_loads_it_with_its_own_harness_on_both_seats():
    from prime_rl.orchestrator.config import EnvConfig
    from prime_rl.orchestrator.envs import env_config_data, load_env, load_tasks

    spec = EnvConfig(id="propose-solve", args={"num_tasks": 6}, env_args={"num_solvers": 2})
    seat = {"max_total_tokens": 256, "harness": {"id": "propose-solve"}}  # the local runtime is the env's own
    assert env_config_data(spec, 256) == {
        "taskset": {"id": "propose-solve", "num_tasks": 6},
        "proposer": seat,
        "solver": seat,
        "num_solvers": 2,
    }
    env = load_env(spec, 256)
    assert type(env) is ProposeSolveEnv and env.config.num_solvers == 2
    assert (env.config.solver.runtime.type, env.config.proposer.max_total_tokens) == ("subprocess", 256)
    tasks = load_tasks([spec], 256)["propose-solve"]
    assert tasks.size == 6 and tasks[0]["prompt"].startswith("Write ")


# --- episodes ---------------------------------------------------------------------------------------------------


def make_task(op="+", low=10, high=99) -> ProposeTask:
    return ProposeTask(ProposeData(prompt=source_prompt(op, low, high), op=op, low=low, high=high))


def scripted(proposal: str, *answers: str):
    """The proposer's call gets `proposal`; the solvers' calls get `answers`, in call order."""
    it = iter(answers)

    def script(body: dict) -> dict:
        asked = body["messages"][-1]["content"]
        return {"content": proposal if asked.startswith("Write ") else next(it)}

    return script


def run(script, tasks, **config):
    return LOOP.run_until_complete(
        kit.run_episodes({"taskset": {"id": "propose-solve"}, **config}, script, tasks, api_key_var=API_KEY_VAR)
    )


def roles(episode, solvers: int = 3) -> tuple[vf.Trace, list[vf.Trace]]:
    by_role = episode.by_agent
    assert sorted(by_role) == ["proposer", "solver"] and len(by_role["solver"]) == solvers
    (proposer,) = by_role["proposer"]
    return proposer, sorted(by_role["solver"], key=lambda t: t.info["propose_solve"]["solver"])


def assert_never_acted(trace: vf.Trace) -> None:
    assert trace.calls == [] and trace.nodes == [] and trace.branches == []
    assert trace.num_turns == 0 and trace.usage is None
    assert trace.ok and not trace.has_error and trace.is_completed
    assert trace.stop_condition == "user_closed"


def test_episode_valid_proposal_with_mixed_solvers(monkeypatch):
    monkeypatch.setenv(API_KEY_VAR, "sk-test")
    proposal = "Problem: 23 + 45\nAnswer: 68"
    (episode,), requests = run(scripted(proposal, "68", "The answer is 67", "68"), [make_task()])
    assert episode.ok, episode.errors
    proposer, solvers = roles(episode)
    assert len(requests) == 4
    assert requests[0]["messages"] == [{"role": "user", "content": source_prompt("+", 10, 99)}]
    for request in requests[1:]:
        assert request["messages"] == [{"role": "user", "content": "What is 23 + 45? Answer with the number only."}]
    facts = proposer.info["propose_solve"]
    assert {k: v for k, v in facts.items() if k != "solver_answers"} == {
        "source": {"op": "+", "low": 10, "high": 99, "prompt": source_prompt("+", 10, 99)},
        "proposal": proposal,
        "problem": "23 + 45",
        "answer": 68,
        "stated_answer": 68,
        "valid": True,
        "solver": None,
    }
    assert sorted(facts["solver_answers"]) == [67, 68, 68]
    for index, trace in enumerate(solvers):
        assert trace.info["propose_solve"] == facts | {"solver": index}
        assert parse_answer(trace.last_reply) == facts["solver_answers"][index]
        assert trace.reward == trace.rewards["correct"].score == float(facts["solver_answers"][index] == 68)
        assert [(m.role, m.content) for m in trace.messages] == [
            ("user", "What is 23 + 45? Answer with the number only."),
            ("assistant", trace.last_reply),
        ]
    assert sorted(t.reward for t in solvers) == [0.0, 1.0, 1.0]
    assert proposer.rewards["learnability"].score == pytest.approx(2 / 3) and proposer.reward == pytest.approx(2 / 3)
    for trace in (proposer, *solvers):
        assert trace.ok and trace.agent.trainable is True and trace.num_turns == 1
        assert trace.agent.config.harness.id == "propose-solve"
        assert trace.metrics == pytest.approx({"valid_proposal": 1.0, "solve_rate": 2 / 3})


def test_episode_every_solver_right_teaches_nothing(monkeypatch):
    monkeypatch.setenv(API_KEY_VAR, "sk-test")
    (episode,), _ = run(scripted("Problem: 7 * 8\nAnswer: 56", "56", "56"), [make_task("*", 1, 9)], num_solvers=2)
    proposer, solvers = roles(episode, 2)
    assert episode.ok, episode.errors
    assert [t.reward for t in solvers] == [1.0, 1.0] and proposer.reward == 0.0
    assert proposer.metrics == {"valid_proposal": 1.0, "solve_rate": 1.0}


@pytest.mark.parametrize(
    ("proposal", "problem", "stated"),
    [
        ("I cannot think of one.", None, None),  # unparseable
        ("Problem: 23 + 45\nAnswer: 69", "23 + 45", 69),  # a wrong stated answer
        ("Problem: 230 + 45\nAnswer: 275", None, 275),  # off the task's range
    ],
)
def test_episode_invalid_proposal_runs_no_solver(monkeypatch, proposal, problem, stated):
    monkeypatch.setenv(API_KEY_VAR, "sk-test")
    (episode,), requests = run(scripted(proposal), [make_task()])
    assert episode.ok, episode.errors
    assert len(requests) == 1  # the proposer's only
    proposer, solvers = roles(episode)
    facts = proposer.info["propose_solve"]
    assert (facts["problem"], facts["stated_answer"], facts["valid"]) == (problem, stated, False)
    assert facts["solver_answers"] == [None, None, None]
    assert (proposer.reward, proposer.rewards["learnability"].score, proposer.num_turns) == (0.0, 0.0, 1)
    for trace in solvers:
        assert_never_acted(trace)
        assert trace.agent.name == "solver" and trace.rewards["correct"].score == 0.0 and trace.reward == 0.0
    for trace in (proposer, *solvers):
        assert trace.metrics == {"valid_proposal": 0.0}  # no solve_rate without a valid proposal


def test_episodes_over_the_taskset_yield_a_rollout_per_seat(monkeypatch):
    """A proposer that always writes a valid problem for its source task, and solvers right on every other call:
    prime-rl's `episode_results` gives each trace as a rollout named by its seat."""
    from prime_rl.orchestrator.results import episode_results

    calls = []

    def script(body: dict) -> dict:
        asked = body["messages"][-1]["content"]
        source = re.match(r"Write an? \w+ problem with two numbers between (\d+) and (\d+)", asked)
        if source:
            op = re.search(r"`Problem: A (.) B`", asked).group(1)
            a = int(source.group(1))
            return {"content": f"Problem: {a} {op} {a}\nAnswer: {OPERATIONS[op][1](a, a)}"}
        calls.append(asked)
        a, op, b = re.match(r"What is (\d+) (.) (\d+)\?", asked).groups()
        value = OPERATIONS[op][1](int(a), int(b))
        return {"content": str(value if len(calls) % 2 else value + 1)}

    monkeypatch.setenv(API_KEY_VAR, "sk-test")
    taskset = {"id": "propose-solve", "num_tasks": 4, "seed": 1, "max_digits": 3}
    episodes, requests = run(script, lambda env: list(env.taskset), taskset=taskset, num_solvers=2)
    assert len(episodes) == 4 and len(requests) == 4 * 3
    for episode in episodes:
        assert episode.ok, episode.errors
        proposer, solvers = roles(episode, 2)
        assert proposer.info["propose_solve"]["valid"] and proposer.reward == 1.0  # one of two solvers right
        results = episode_results(episode, 0.0)
        assert sorted(r.seat for r in results) == ["proposer", "solver", "solver"]
        assert all(r.error is None and r.samples == [] for r in results)  # chat completions carry no tokens
        assert sorted(r.reward for r in results if r.seat == "solver") == [0.0, 1.0]
