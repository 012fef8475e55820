"""benchmarks/bench_vs_trl.py's pure parts: the numbers per run, the table, the step lines and the process-tree
sampler (on a real process tree). TRL is an optional group CI does not install: the module must import without it."""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
from script_module import ROOT, load_script

bench = load_script("benchmarks/bench_vs_trl.py")


def synthetic_samples(cpu_rate: float, busy_rate: float, until: float = 30.0) -> list:
    """A sample every second: the tree uses `cpu_rate` cores, the machine `busy_rate` besides the probe, which uses
    0.02 cores; PSS peaks at 1 GiB at t=3."""
    return [
        bench.Sample(float(t), cpu_rate * t, 2**20 if t == 3 else 2**19, busy_rate * t, 0.02 * t)
        for t in range(int(until) + 1)
    ]


def test_run_stats_steady_window_startup_and_cpu():
    ends = {step: 10.0 + 2.0 * (step - 1) for step in range(1, 11)}  # step 1 ends at 10 s, then 2 s per step
    stats = bench.run_stats(0.0, 30.0, ends, synthetic_samples(1.5, 1.6), skip=5)
    assert stats["wall_s"] == 30.0
    assert stats["step_s"] == pytest.approx(2.0)
    assert stats["steady_steps"] == "6..10"
    assert stats["startup_s"] == pytest.approx(8.0)  # the end of step 1 less one steady step
    assert stats["cpu_pct"] == pytest.approx(150.0)
    assert stats["background_cpu_pct"] == pytest.approx(10.0)
    assert stats["probe_cpu_pct"] == pytest.approx(2.0)
    assert stats["peak_pss_gib"] == pytest.approx(1.0)


def test_run_stats_short_run_and_missing_steps():
    stats = bench.run_stats(0.0, 20.0, {1: 10.0, 2: 13.0, 3: 16.0}, synthetic_samples(1.0, 1.0), skip=5)
    assert stats["steady_steps"] == "3..3" and stats["step_s"] == pytest.approx(3.0)
    with pytest.raises(ValueError, match="step 1"):
        bench.run_stats(0.0, 20.0, {1: 10.0}, synthetic_samples(1.0, 1.0))


def test_value_at_interpolates_and_clamps():
    samples = synthetic_samples(2.0, 2.0, until=4)
    assert bench.value_at(samples, 1.5, "cpu_s") == pytest.approx(3.0)
    assert bench.value_at(samples, -1.0, "cpu_s") == 0.0
    assert bench.value_at(samples, 99.0, "cpu_s") == pytest.approx(8.0)


def test_format_table_spread_mean_and_ratio():
    peer = [
        {"wall_s": 30.0, "startup_s": 10.0, "step_s": 1.0, "cpu_pct": 100.0, "peak_pss_gib": 1.0, "reward": 0.8},
        {"wall_s": 40.0, "startup_s": 10.0, "step_s": 1.0, "cpu_pct": 100.0, "peak_pss_gib": 1.0, "reward": 0.6},
    ]
    ours = [{**r, "wall_s": 70.0, "background_cpu_pct": 3.0, "probe_cpu_pct": 1.5} for r in peer]
    table = bench.format_table(peer, ours).splitlines()
    assert table[0] == "| | TRL min-max | TRL mean | ours min-max | ours mean | ours/TRL |"
    assert len(table) == 2 + len(bench.ROWS)
    assert table[2] == "| wall, command to exit (s) | 30.0-40.0 | 35.0 | 70.0 | 70.0 | 2.00 |"
    assert "| held-out reward (eval) | 0.600-0.800 | 0.700 | 0.600-0.800 | 0.700 | 1.00 |" in table
    assert table[-2] == "| background CPU %, steady (should be ~0) | - | - | 3 | 3 | - |"  # the peer has none
    assert table[-1] == "| this script's CPU %, steady (the probe; should be ~0) | - | - | 1.5 | 1.5 | - |"


def test_step_watcher_reads_complete_trainer_lines_once(tmp_path):
    path = tmp_path / "metrics.jsonl"
    watcher = bench.StepWatcher(path)
    watcher.poll()  # no file yet
    lines = [
        {"process": "orchestrator", "step": 1},
        {"process": "trainer", "step": 1, "time": 5.0},
        {"process": "trainer", "step": 1, "table": "samples"},
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in lines) + '{"process": "trainer", "st')
    watcher.poll()
    assert watcher.ends == {1: 5.0}
    with open(path, "a") as f:
        f.write('ep": 2}\n')
    before = time.time()
    watcher.poll()
    watcher.poll()
    assert set(watcher.ends) == {1, 2} and watcher.ends[1] == 5.0 and watcher.ends[2] >= before


def test_sampler_sums_a_real_process_tree(tmp_path):
    """A parent whose child burns 0.5 s of CPU and holds 64 MiB: the tree has both, their CPU and their memory."""
    ready = tmp_path / "ready"
    child = textwrap.dedent(f"""
        import time
        held = bytearray(64 * 2**20)
        for i in range(0, len(held), 4096):
            held[i] = 1
        while time.process_time() < 0.5:
            pass
        open({str(ready)!r}, "w").close()
        time.sleep(60)
    """)
    parent = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}])"
    proc = subprocess.Popen([sys.executable, "-c", parent])
    try:
        sampler = bench.TreeSampler(proc.pid, interval=0.05, pss_interval=0)
        deadline = time.time() + 60
        while not ready.exists():
            assert time.time() < deadline and proc.poll() is None
            time.sleep(0.05)
        time.sleep(0.1)
        sample = sampler.sample()
        assert len(bench.process_tree(proc.pid)) == 2
        # The child stops at 0.5 s of exact CPU time (process_time); /proc counts whole clock ticks (10 ms) by
        # sampling which task the tick lands on, so under load it can show a few ticks less (0.49 s seen in CI).
        assert sample.cpu_s >= 0.45
        assert sample.pss_kib >= 64 * 1024
    finally:
        for pid in reversed(bench.process_tree(proc.pid)):
            subprocess.run(["kill", str(pid)], check=False)
        proc.wait()
    sampler.start()
    sampler.stop()  # the tree is gone: sampling it still works and keeps what was counted
    assert sampler.samples[-1].cpu_s >= sample.cpu_s


def test_sampler_reads_pss_at_most_every_pss_interval():
    """Reading PSS walks the page tables (~100 ms of CPU for our tree): a sampler reads it once per `pss_interval`,
    however often it samples the CPU."""
    sampler = bench.TreeSampler(os.getpid(), interval=0.01, pss_interval=60.0)
    first, second = sampler.sample(), sampler.sample()
    assert first.pss_kib > 0 and second.pss_kib is None
    assert second.cpu_s >= first.cpu_s > 0


def test_imports_without_trl():
    code = "import sys; sys.modules['trl'] = None; import runpy; runpy.run_path(sys.argv[1], run_name='x')"
    subprocess.run([sys.executable, "-c", code, str(ROOT / "benchmarks/bench_vs_trl.py")], check=True)


def test_top_others_names_the_busiest_outside_processes():
    tick = bench.CLK_TCK
    snapshots = [
        (0.0, {(1, 0): 0, (2, 0): 10 * tick}),
        (5.0, {(1, 0): 2 * tick}),
        (10.0, {(1, 0): 5 * tick, (2, 0): 10 * tick + tick // 2, (3, 7): tick}),  # 3 started in between
    ]
    top = bench.top_others(snapshots, 0.0, 10.0)
    assert [pid for pid, _ in top] == [1, 3, 2]
    assert [round(cpu) for _, cpu in top] == [50, 10, 5]
    assert bench.top_others(snapshots, 0.0, 10.0, n=1) == top[:1]


def test_a_runs_seed_reaches_both_sides(tmp_path):
    """Run r's seed sets our buffer's task order and engine's sampling, and TRL's seed (one seed repeats TRL's run)."""
    from prime_rl.config.loader import load_config
    from prime_rl.rl.config import RLConfig

    flags = ["@", str(ROOT / "configs/reverse_text/rl.toml"), "--output-dir", str(tmp_path)]
    config, _ = load_config(RLConfig, "rl", flags + bench.run_seed_flags(3))
    assert (config.orchestrator.buffer.seed, config.inference.seed) == (3, 3)
    assert config.trainer.seed == 0  # the base the bench adds the run's index to
    assert bench.peer_spec(config, tmp_path / "trl", 3)["seed"] == 3
