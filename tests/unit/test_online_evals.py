"""Online evals (`orchestrator/evals.py`): the metrics of a pass on a hand-worked group, when each environment is due,
the config, and the one-version rule against stand-in servers and workers (the real thing: test_rl's eval run)."""

import asyncio
import itertools
import json
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from prime_rl.eval.eval import env_metrics, eval_line
from prime_rl.orchestrator.config import OrchestratorConfig
from prime_rl.orchestrator.evals import OnlineEvals, next_due, resumed_due
from prime_rl.orchestrator.messages import GroupDone, RolloutResult
from prime_rl.orchestrator.samples import SampleTokens
from prime_rl.utils.monitor import Monitor


def record(example_id, reward, completion_tokens=4, error=None):
    return {
        "example_id": example_id,
        "reward": reward,
        "error": error,
        "metrics": {},
        "prompt_tokens": 10,
        "completion_tokens": completion_tokens,
        "seconds": 0.1,
    }


def test_metrics_of_a_group_by_hand():
    """Two examples x 4 rollouts. Example 0: rewards 1, 0, 1, 0.5 (2 of 4 solved at threshold 1); example 1: 0, 0,
    0, 1 (1 of 4). pass@1 = c/n: (2/4 + 1/4) / 2 = 0.375. pass@2 = 1 - C(n-c, 2)/C(4, 2): example 0 1 - 1/6 = 5/6,
    example 1 1 - 3/6 = 1/2, mean 2/3. pass@4: both 1. avg@4: (2.5/4 + 1/4) / 2 = 0.4375."""
    from prime_rl.eval.eval import summarize

    records = [record(0, r, 6) for r in (1.0, 0.0, 1.0, 0.5)] + [record(1, r, 2) for r in (0.0, 0.0, 0.0, 1.0)]
    metrics = env_metrics("rt", summarize(records, 4, 1.0), 4, 1.0, records)
    assert metrics["eval/rt/pass@1"] == pytest.approx(0.375)
    assert metrics["eval/rt/pass@2"] == pytest.approx(2 / 3)
    assert metrics["eval/rt/pass@4"] == pytest.approx(1.0)
    assert metrics["eval/rt/avg@4"] == pytest.approx(0.4375)
    assert metrics["eval/rt/reward_mean"] == pytest.approx(3.5 / 8)
    assert metrics["eval/rt/completion_len"] == pytest.approx(4.0)
    assert metrics["eval/rt/rollouts"] == 8 and metrics["eval/rt/errors"] == 0
    line = eval_line(3, metrics, ["rt"], {"rt": 4}, 1.25)
    assert line == "eval step 3 | rt avg@4 0.4375 pass@1 0.3750 pass@4 1.0000 len 4.0 | 8 rollouts in 1.2s"


def test_one_rollout_per_example_has_avg_and_pass_at_1():
    from prime_rl.eval.eval import summarize

    records = [record(0, 1.0), record(1, 0.25), record(2, 0.0, error="ProviderError: boom")]
    metrics = env_metrics("rt", summarize(records, 1, 1.0), 1, 1.0, records)
    assert metrics["eval/rt/avg@1"] == pytest.approx(0.625) and metrics["eval/rt/pass@1"] == pytest.approx(0.5)
    assert metrics["eval/rt/errors"] == 1 and "eval/rt/pass@2" not in metrics


def test_when_an_environment_is_due():
    assert [next_due(s, 5) for s in (0, 3, 5, 9, 10)] == [5, 5, 10, 10, 15]
    # Resumed at a due step: again unless its pass completed before the restart; elsewhere the next interval.
    assert resumed_due(10, 5, done=False) == 10
    assert resumed_due(10, 5, done=True) == 15
    assert resumed_due(12, 5, done=False) == 15


def test_config_section():
    config = OrchestratorConfig(
        sampling={"temperature": 0.8, "max_tokens": 16},
        eval={"interval": 4, "env": [{"id": "reverse-text", "num_examples": 3, "interval": 2}], "sampling": {"max_tokens": 8}},
    )  # fmt: skip
    assert config.eval.env_interval(config.eval.env[0]) == 2
    sampling = config.eval_sampling()  # what eval.sampling sets, else the training sampling
    assert (sampling.temperature, sampling.max_tokens, sampling.top_p) == (0.8, 8, 1.0)
    envs = config.rollout_envs()
    assert list(envs) == ["reverse-text", "eval/reverse-text"]
    assert envs["reverse-text"].training and not envs["eval/reverse-text"].training
    assert OrchestratorConfig().eval is None and list(OrchestratorConfig().rollout_envs()) == ["reverse-text"]
    # Evals may sample otherwise than training (top_p < 1 is refused for training only).
    assert OrchestratorConfig(eval={"sampling": {"top_p": 0.9}}).eval_sampling().top_p == 0.9


@pytest.mark.parametrize(
    ("section", "needle"),
    [
        ({"intervall": 3}, "intervall"),
        ({"env": [{"id": "reverse-text", "num_exmaples": 3}]}, "num_exmaples"),
        ({"env": []}, "configure at least one environment"),
        ({"env": [{"id": "reverse-text"}, {"id": "reverse-text"}]}, "eval.env names must be unique"),
        ({"interval": 0}, "interval"),
    ],
)
def test_bad_eval_config_names_the_key(section, needle):
    with pytest.raises(ValidationError, match=needle):
        OrchestratorConfig(eval=section)


def test_eval_names_must_not_clash_with_training_names():
    with pytest.raises(ValidationError, match="clash"):
        OrchestratorConfig(env=[{"id": "reverse-text", "name": "eval/x"}], eval={"env": [{"id": "reverse-text", "name": "x"}]})  # fmt: skip


# ---------------------------------------------------------------------------------------------------------
# The one-version rule, against stand-ins for the servers and the workers.


class Servers:
    def __init__(self):
        self.urls, self.version, self.load, self.failed = ["http://s/v1"], 0, {"http://s/v1": 0}, []

    def least_loaded(self):
        return self.urls[0]

    def model_name(self, step, base):
        return base

    def mark_failed(self, url, reason):
        self.failed.append(reason)


class Workers:
    def __init__(self):
        self.sent = []

    async def submit(self, request):
        self.sent.append(request)


def answer(request, version, rewards=(1.0, 0.0)):
    """The group as a worker would return it: one rollout per reward, every sampled token labelled `version`."""
    sample = SampleTokens([1, 2, 3], [False, True, True], [0.0, -0.1, -0.2], [-1, version, version])
    rollouts = [RolloutResult(reward=r, samples=[sample], completion_tokens=2) for r in rewards[: request.n]]
    return GroupDone(id=request.id, rollouts=rollouts)


def make_evals(tmp_path, k, max_steps=6, resumed=None):
    config = OrchestratorConfig(
        output_dir=tmp_path, max_async_level=k, max_steps=max_steps,
        eval={"interval": 2, "env": [{"id": "reverse-text", "num_examples": 2, "rollouts_per_example": 2}]},
    )  # fmt: skip
    tasks = {"reverse-text": SimpleNamespace(items=[{"prompt": "a"}, {"prompt": "b"}])}
    servers, workers = Servers(), Workers()
    evals = OnlineEvals(config, tasks, servers, workers, Monitor(tmp_path, "orchestrator"), resumed)
    return evals, servers, workers


def logged(tmp_path):
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines() if (tmp_path / "metrics.jsonl").exists() else []
    return [m for m in map(json.loads, lines) if "eval/step" in m]


def run(coro):
    return asyncio.new_event_loop().run_until_complete(coro)


def test_a_pass_measures_the_version_it_started_on(tmp_path):
    evals, servers, workers = make_evals(tmp_path, k=0)

    async def scenario():
        await evals.start(0)
        assert evals.running and evals.holds_swaps()  # k = 0: the swap waits for the pass
        assert all(r.env == "eval/reverse-text" and r.id < 0 and r.n == 2 for r in workers.sent)
        for request in workers.sent:
            await evals.on_done(answer(request, 0))
        assert not evals.running and servers.load["http://s/v1"] == 0
        await evals.start(1)  # not due: the interval is 2
        assert not evals.running

    run(scenario())
    (row,) = logged(tmp_path)
    assert row["step"] == row["eval/step"] == 0 and row["eval/reverse-text/pass@1"] == pytest.approx(0.5)
    results = [json.loads(line) for line in (tmp_path / "evals" / "step_0" / "results.jsonl").read_text().splitlines()]
    assert len(results) == 4 and {r["step"] for r in results} == {0}
    assert all(r["policy_versions"] == [0] for r in results)
    assert json.loads((tmp_path / "evals" / "step_0" / "summary.json").read_text())["envs"]["reverse-text"]


def test_at_k1_a_swap_discards_the_pass_which_reruns_on_the_new_policy(tmp_path):
    evals, servers, workers = make_evals(tmp_path, k=1)

    async def scenario():
        await evals.start(2)
        assert not evals.holds_swaps()  # k >= 1: training does not wait for a pass (but step 0's)
        first = list(workers.sent)
        await evals.on_done(answer(first[0], 2))
        evals.interrupt(3)  # the swap to 3
        await evals.start(3)
        rerun = workers.sent[len(first) :]
        for request in first[1:]:  # the discarded pass's groups come back late: dropped
            await evals.on_done(answer(request, 3))
        assert evals.running and logged(tmp_path) == []
        for request in rerun:
            await evals.on_done(answer(request, 3))

    run(scenario())
    (row,) = logged(tmp_path)
    assert row["step"] == row["eval/step"] == 3 and row["eval/interruptions"] == 1
    assert servers.load["http://s/v1"] == 0


def test_a_pass_with_tokens_of_another_version_is_discarded(tmp_path):
    evals, servers, workers = make_evals(tmp_path, k=0)

    async def scenario():
        await evals.start(2)
        sent = list(workers.sent)
        await evals.on_done(answer(sent[0], 2))
        servers.version = 3  # a server changed weights under the pass
        await evals.on_done(answer(sent[1], 3))
        assert evals.running and evals.current.step == 3  # rerun at once on what is served now
        for request in workers.sent[len(sent) :]:
            await evals.on_done(answer(request, 3))

    run(scenario())
    assert [row["step"] for row in logged(tmp_path)] == [3]
    assert not (tmp_path / "evals" / "step_2").exists()


def test_retry_of_a_group_that_failed_on_the_server(tmp_path):
    evals, servers, workers = make_evals(tmp_path, k=0)

    async def scenario():
        await evals.start(0)
        first = workers.sent[0]
        failed = GroupDone(id=first.id, rollouts=[RolloutResult(0.0, [], error="ProviderError: 503", retryable=True)])
        await evals.on_done(failed)
        assert servers.failed and len(workers.sent) == 3  # the group went again
        for request in workers.sent[1:]:
            await evals.on_done(answer(request, 0))

    run(scenario())
    assert logged(tmp_path)[0]["eval/reverse-text/rollouts"] == 4


def test_resume_does_not_evaluate_a_step_again(tmp_path):
    evals, _, workers = make_evals(tmp_path, k=0)

    async def finish(step):
        await evals.start(step)
        for request in list(workers.sent):
            await evals.on_done(answer(request, step))
        workers.sent.clear()

    run(finish(0))
    run(finish(2))
    (tmp_path / "evals" / "step_4").mkdir()  # a pass of a policy past the checkpoint: an earlier life's
    resumed, _, workers = make_evals(tmp_path, k=0, resumed=2)
    assert not (tmp_path / "evals" / "step_4").exists() and (tmp_path / "evals" / "step_2").exists()
    run(resumed.start(2))
    assert not resumed.running and workers.sent == []  # step 2 was evaluated before the restart
    run(resumed.start(3))
    assert not resumed.running
    run(resumed.start(4))
    assert resumed.running and resumed.current.step == 4
    # A fresh run in the same output dir starts without the earlier run's passes.
    make_evals(tmp_path, k=0)
    assert list((tmp_path / "evals").glob("step_*")) == []


def test_final_policy_is_evaluated_even_off_interval(tmp_path):
    evals, _, workers = make_evals(tmp_path, k=0, max_steps=5)
    evals.due["reverse-text"] = 6
    run(evals.start(5))
    assert evals.running and evals.current.step == 5
    assert len(list(itertools.chain(workers.sent))) == 2


def test_rl_sizes_the_servers_for_an_eval_pass_beside_training(tmp_path):
    """`rl` gives vLLM room for the rollouts in flight: training's, plus an eval pass's (at most as many again)."""
    from prime_rl.rl.config import RLConfig

    def seqs(**orchestrator):
        config = RLConfig(output_dir=tmp_path, inference={}, orchestrator={"batch_size": 64, **orchestrator})
        return config.inference.max_num_seqs

    one_pass = {"env": [{"id": "reverse-text", "num_examples": 16, "rollouts_per_example": 2}]}
    assert seqs() == 64  # 8 groups of 8
    assert seqs(eval=one_pass) == 64 + 32
    assert seqs(eval={"env": [{"id": "reverse-text"}]}) == 128  # every task: unknown here, as many again


# ---------------------------------------------------------------------------------------------------------
# The scheduler's side: a swap waits for the pass in flight (k = 0) or discards it (k >= 1).


class SwappingServers(Servers):
    """Also swaps: `load_policy` moves every server to the step at once, as `InferenceServers` does."""

    recovering, fatal = {}, None

    def healthy(self):
        return self.urls

    async def load_policy(self, step, from_disk=False):
        self.version = step
        return 0.0


class AnsweringWorkers(Workers):
    """Keeps the groups sent; `receive` hands back the answers queued with `answer_all`."""

    def __init__(self):
        super().__init__()
        self.done = asyncio.Queue()
        self.served = []

    async def policy_served(self, step):
        self.served.append(step)

    def answer_all(self, version):
        for request in self.sent:
            self.done.put_nowait(answer(request, version))
        self.sent.clear()

    async def receive(self, timeout):
        try:
            return await asyncio.wait_for(self.done.get(), timeout)
        except TimeoutError:
            return None


def scheduler_with_evals(tmp_path, k):
    from prime_rl.orchestrator.scheduler import Scheduler

    evals, _, _ = make_evals(tmp_path, k)
    servers, workers = SwappingServers(), AnsweringWorkers()
    evals.servers, evals.workers = servers, workers
    s = Scheduler(evals.config, None, {}, servers, workers, evals=evals)
    return s, evals, servers, workers


def test_at_k0_the_swap_waits_until_the_pass_is_done(tmp_path):
    s, evals, servers, workers = scheduler_with_evals(tmp_path, k=0)

    async def scenario():
        servers.version = 2
        await evals.start(2)
        swap = asyncio.create_task(s.swap(3))
        await asyncio.sleep(0.3)
        assert not swap.done() and servers.version == 2  # held while the pass runs
        workers.answer_all(2)
        await asyncio.wait_for(swap, 5)
        assert servers.version == 3 and not evals.running

    run(scenario())
    assert [row["step"] for row in logged(tmp_path)] == [2]
    assert s.stats.wait_for_evals >= 0.3


def test_at_k1_the_swap_goes_ahead_and_the_pass_reruns_on_the_new_policy(tmp_path):
    s, evals, servers, workers = scheduler_with_evals(tmp_path, k=1)

    async def scenario():
        servers.version = 2
        await s.announce_policy()  # the pass of step 2 starts with the policy at k >= 1
        assert evals.running and evals.current.step == 2
        workers.answer_all(2)  # its answers come back only after the swap: dropped
        await asyncio.wait_for(s.swap(3), 1)
        await s.announce_policy()
        assert servers.version == 3 and evals.current.step == 3 and evals.current.interruptions == 1
        while not workers.done.empty():
            await s.receive(0.1)
        assert evals.running  # the late answers did not finish the new pass
        workers.answer_all(3)
        while evals.running:
            await s.receive(0.1)

    run(scenario())
    assert [row["step"] for row in logged(tmp_path)] == [3]


def test_report_draws_the_held_out_curve(tmp_path, capsys):
    from prime_rl.utils.report import main

    lines = [{"process": "orchestrator", "step": s, "reward/mean": 0.1 * s} for s in range(1, 5)]
    lines += [
        {"process": "orchestrator", "step": s, "eval/step": s, "eval/rt/reward_mean": 0.2 * s, "eval/rt/avg@2": 0.2 * s,
         "eval/rt/pass@1": 0.1 * s, "eval/rt/pass@2": 0.15 * s}
        for s in (0, 2, 4)
    ]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    main([str(tmp_path)])
    assert (tmp_path / "report" / "eval.png").exists()
    assert "<h2>Held-out reward during RL (online evals)</h2>" in (tmp_path / "report" / "index.html").read_text()


def test_sft_eval_config_is_checked_before_training(tmp_path, capsys):
    """`sft`'s eval file is loaded by `eval --dry-run` when sft starts: a misspelt key ends it (exit 2) naming the key."""
    from prime_rl.trainer.sft.config import SFTConfig
    from prime_rl.trainer.sft.evals import check_eval_config, eval_command, policy_step, score_line

    good = tmp_path / "eval.toml"
    good.write_text('[[env]]\nid = "reverse-text"\nnum_examples = 2\n')
    config = SFTConfig(output_dir=tmp_path / "sft", eval=good, model={"name": "some/model"})
    check_eval_config(config)
    command = eval_command(config)
    assert command[command.index("--model.name") + 1] == "some/model"
    assert command[command.index("--weights-dir") + 1] == str(tmp_path / "sft" / "weights")
    assert command[command.index("--follow-until") + 1] == "100"  # max_steps: sft always exports its last step
    bad = tmp_path / "bad.toml"
    bad.write_text('[[env]]\nid = "reverse-text"\nnum_exmaples = 2\n')
    with pytest.raises(SystemExit) as exit_info:
        check_eval_config(SFTConfig(output_dir=tmp_path / "sft", eval=bad))
    assert exit_info.value.code == 2 and "num_exmaples" in capsys.readouterr().err
    with pytest.raises(ValidationError, match="is not a file"):
        SFTConfig(eval=tmp_path / "missing.toml")
    assert [policy_step(label) for label in ("base", "step_3", "step_40")] == [0, 3, 40]
    line = score_line(2, {"eval/rt/avg@2": 0.5, "eval/rt/pass@2": 0.75, "eval/rt/reward_mean": 0.5})
    assert line == "eval step 2 | rt avg@2 0.5000 | rt pass@2 0.7500"
