"""`sft`'s evals during training, without a server: which exports `eval --follow-until` picks up and when it stops,
and how sft's rank 0 reads eval's finished policies between steps (the real run: test_sft's eval test)."""

import asyncio
import json
import sys
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

import prime_rl.eval.eval as eval_module
import prime_rl.trainer.sft.evals as sft_evals
from prime_rl.eval.config import EvalConfig
from prime_rl.eval.eval import follow_exports, new_exports, policies
from prime_rl.trainer.sft.config import SFTConfig
from prime_rl.trainer.sft.evals import EvalFailed, FollowingEval, read_policies
from prime_rl.utils.monitor import Monitor


def export(root, step, name="config.json"):
    path = root / f"step_{step}"
    path.mkdir(parents=True)
    (path / name).write_text("{}")
    return path


def test_only_complete_exports_up_to_the_last_step_are_followed(tmp_path):
    """A `step_*` counts once its model or adapter config is there (exports are renamed into place whole); the
    temporary directory of an export being written and steps past `follow_until` are not policies."""
    root = tmp_path / "weights"
    one, four = export(root, 1), export(root, 4, "adapter_config.json")
    (root / "step_3").mkdir()  # no config: not a policy
    export(root, 9)  # past follow_until
    (root / ".step_2.tmp-x1y2").mkdir()
    (root / ".step_2.tmp-x1y2" / "config.json").write_text("{}")
    assert new_exports(root, -1, 5) == [(1, one), (4, four)]
    assert new_exports(root, 1, 5) == [(4, four)]
    assert new_exports(tmp_path / "not-yet", -1, 5) == []  # sft creates weights/ with its first export
    config = EvalConfig(weights_dir=root, follow_until=5)
    assert policies(config) == [("base", None), ("step_1", one), ("step_4", four)]
    assert policies(EvalConfig(weights_dir=tmp_path / "not-yet", follow_until=5)) == [("base", None)]
    with pytest.raises(ValidationError, match="follow_until needs weights_dir"):
        EvalConfig(follow_until=5)


def test_following_yields_each_new_export_as_it_appears_and_stops_after_the_last(tmp_path, monkeypatch):
    monkeypatch.setattr(eval_module, "FOLLOW_POLL", 0.01)
    root = tmp_path / "weights"
    one = export(root, 1)
    config = EvalConfig(weights_dir=root, follow_until=6)

    async def run():
        seen = []
        async for label, path in follow_exports(config, policies(config)):
            seen.append((label, path))
            if label == "step_1":  # written while step_1 is evaluated: both are picked up, in order
                export(root, 4), export(root, 2)
            elif label == "step_4":
                asyncio.get_running_loop().call_later(0.1, export, root, 6)  # the last step, a little later
                export(root, 8)  # past follow_until: never evaluated
        return seen

    seen = asyncio.run(asyncio.wait_for(run(), 10))
    assert [label for label, _ in seen] == ["base", "step_1", "step_2", "step_4", "step_6"]
    assert seen[1] == ("step_1", one) and seen[-1] == ("step_6", root / "step_6")


def policy(label, step_reward):
    metrics = {"eval/rt/avg@2": step_reward, "eval/rt/pass@2": 1.0, "eval/rt/rollouts": 4}
    return {"label": label, "weights": None, "envs": {"rt": {"seconds": 1.5}}, "metrics": metrics}


def write_policies(path, items, tail=""):
    """As eval does: the whole file replaced at once (`tail`: a stand-in for a line still being written)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(p) + "\n" for p in items) + tail)
    tmp.replace(path)


def test_finished_policies_are_read_once_each(tmp_path):
    path = tmp_path / "policies.jsonl"
    assert read_policies(path, 0) == []  # eval has not finished one yet
    write_policies(path, [policy("base", 0.1), policy("step_2", 0.5)], tail='{"label": "step_')
    assert [p["label"] for p in read_policies(path, 0)] == ["base", "step_2"]
    assert [p["label"] for p in read_policies(path, 1)] == ["step_2"]
    assert read_policies(path, 2) == []


def sft_config(tmp_path, **kw):
    eval_file = tmp_path / "eval.toml"
    eval_file.write_text('[[env]]\nid = "reverse-text"\nnum_examples = 2\n')
    return SFTConfig(output_dir=tmp_path / "sft", eval=eval_file, max_steps=4, **kw)


def test_sft_logs_each_policy_at_its_step_between_steps_and_fails_when_the_eval_does(tmp_path):
    config = sft_config(tmp_path, eval_timeout=5)
    monitor = Monitor(config.output_dir, "sft")
    follower = FollowingEval(config, monitor)
    follower.process = SimpleNamespace(poll=lambda: None, tail=lambda: "")  # running
    follower.poll()  # nothing finished yet
    write_policies(follower.results, [policy("base", 0.1)])
    follower.poll()
    follower.poll()  # the same file again: nothing new
    write_policies(follower.results, [policy("base", 0.1), policy("step_2", 0.5)])
    follower.poll()
    rows = [json.loads(line) for line in (config.output_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["eval/step"], r["eval/rt/avg@2"]) for r in rows] == [(0, 0, 0.1), (2, 2, 0.5)]
    assert rows[0]["eval/seconds"] == 1.5 and follower.logged == [0, 2]

    # After the last step: the last export must be there, and the eval must end well with its result.
    with pytest.raises(EvalFailed, match="weights/step_4 is missing"):
        follower.finish()
    export(config.output_dir / "weights", 4)
    write_policies(follower.results, [policy("base", 0.1), policy("step_2", 0.5), policy("step_4", 0.9)])
    follower.process = SimpleNamespace(poll=lambda: 0, tail=lambda: "")
    follower.finish()
    assert follower.logged == [0, 2, 4]
    follower.process = SimpleNamespace(poll=lambda: 1, tail=lambda: "eval: boom")
    with pytest.raises(EvalFailed, match="exited with code 1; .*\n.*boom"):
        follower.finish()
    monitor.close()


def test_the_eval_starts_on_this_runs_exports_only(tmp_path, monkeypatch):
    """Exports after the step the run starts from are an earlier run's (the eval would take them for this one's), and
    so is an earlier eval's policies file; a run that stops early stops its eval."""
    config = sft_config(tmp_path)
    weights = config.output_dir / "weights"
    for step in (1, 2, 3):
        export(weights, step)
    write_policies(config.output_dir / "eval" / "policies.jsonl", [policy("base", 0.1)])
    monkeypatch.setattr(sft_evals, "eval_command", lambda _: [sys.executable, "-c", "import time; time.sleep(60)"])
    monitor = Monitor(config.output_dir, "sft")
    follower = FollowingEval(config, monitor)
    follower.start(2)
    try:
        assert sorted(p.name for p in weights.iterdir()) == ["step_1", "step_2"]
        assert not follower.results.exists()
        assert follower.process.poll() is None
    finally:
        follower.stop()
    assert follower.process.poll() is not None
    monitor.close()


def test_an_sft_file_names_its_eval_file_and_upstreams_eval_table_is_refused(tmp_path, capsys):
    """Our `eval = "eval.toml"` loads from an sft file; upstream's `[eval]` table (its own environments and interval)
    is refused, pointing at the file form."""
    from prime_rl.config.loader import load_config

    eval_file = tmp_path / "eval.toml"
    eval_file.write_text('[[env]]\nid = "reverse-text"\nnum_examples = 2\n')
    ours = tmp_path / "sft.toml"
    ours.write_text(f'eval = "{eval_file}"\nmax_steps = 3\n')
    config, _ = load_config(SFTConfig, "sft", ["@", str(ours)])
    assert config.eval == eval_file
    theirs = tmp_path / "upstream.toml"
    theirs.write_text('[eval]\ninterval = 25\n[[eval.source]]\nname = "rt"\nenv.taskset.id = "reverse-text"\n')
    with pytest.raises(SystemExit) as exit_info:
        load_config(SFTConfig, "sft", ["@", str(theirs)])
    error = capsys.readouterr().err
    assert exit_info.value.code == 2 and "evals during `sft` as a table" in error and 'eval = "eval.toml"' in error
