import resource
from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen3Config

from prime_rl.trainer.perf import (
    TRAINER_BENCH_COLUMNS,
    ThroughputMeter,
    flops_per_token,
    matmul_params_per_token,
    peak_flops,
    peak_memory_gib,
)
from prime_rl.utils.bench import format_bench_table


def qwen3_0_6b():
    return Qwen3Config(
        hidden_size=1024,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=3072,
        vocab_size=151936,
    )


# h 8, 2 layers, 2 heads, 1 kv head, no head_dim (-> 8 / 2 = 4), intermediate 16, vocab 10.
TINY = SimpleNamespace(
    hidden_size=8,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    intermediate_size=16,
    vocab_size=10,
)


def test_matmul_params_tiny():
    # Per layer: q + o = 2*8*2*4 = 128, k + v = 2*8*1*4 = 64, MLP 3*8*16 = 384 -> 576; x2 = 1152; lm_head 10*8 = 80.
    assert matmul_params_per_token(TINY) == 1232


def test_matmul_params_qwen3_0_6b():
    # Per layer: q + o = 2*1024*16*128 = 4,194,304; k + v = 2*1024*8*128 = 2,097,152; MLP 3*1024*3072 = 9,437,184
    # -> 15,728,640; x28 = 440,401,920; lm_head 151936*1024 = 155,582,464; total 595,984,384.
    # head_dim 128 != 1024 / 16 = 64: the explicit head_dim must be used.
    assert matmul_params_per_token(qwen3_0_6b()) == 595_984_384


def test_flops_per_token():
    # Tiny at seq 5: 6*1232 = 7392 + 12*2*2*4*5 = 960 -> 8352.
    assert flops_per_token(TINY, 5) == 8352
    # Qwen3-0.6B at seq 1024: 6*595,984,384 = 3,575,906,304 + 12*28*16*128*1024 = 704,643,072 -> 4,280,549,376.
    assert flops_per_token(qwen3_0_6b(), 1024) == 4_280_549_376


def test_peak_flops_lookup():
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA H100 NVL") == 835e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("NVIDIA GeForce RTX 4090") == 165e12
    assert peak_flops("cpu") is None
    assert peak_flops("Tesla T4") is None


def test_throughput_meter_window():
    meter = ThroughputMeter(window=2)
    assert meter.tokens_per_s is None and meter.mfu(1.0, 1.0, 1) is None
    meter.update(10.0, 100, 200)  # warm-up step: ignored
    assert meter.tokens_per_s is None
    meter.update(2.0, 300, 400)
    meter.update(3.0, 200, 100)  # a shared prompt: fewer positions computed than the samples hold
    # Window (2s, 300 tokens/400 computed), (3s, 200/100): 500 tokens / 5 s = 100 tok/s.
    assert meter.tokens_per_s == pytest.approx(100.0)
    meter.update(5.0, 100, 200)
    # Window (3s, 200/100), (5s, 100/200): 300 / 8 = 37.5 tok/s; computed 300 / 8 = 37.5 positions/s.
    assert meter.tokens_per_s == pytest.approx(37.5)
    # MFU counts the positions computed: 100 * 1e3 FLOP/position * 37.5 /s / (1e5 FLOP/s * 2 devices) = 18.75 %.
    assert meter.mfu(1e3, 1e5, 2) == pytest.approx(18.75)
    meter.update(1.0, 100, 700)
    # Window (5s, 100/200), (1s, 100/700): computed 900 / 6 = 150 /s -> 100 * 1e3 * 150 / 2e5 = 75 %; tokens 200/6.
    assert meter.mfu(1e3, 1e5, 2) == pytest.approx(75.0)
    assert meter.tokens_per_s == pytest.approx(200 / 6)
    assert meter.mfu(1e3, None, 2) is None


def test_throughput_meter_rejects_bad_input():
    meter = ThroughputMeter()
    with pytest.raises(ValueError):
        meter.update(1.0, -1, 5)
    with pytest.raises(ValueError):
        meter.update(0.0, 1, 1)
    with pytest.raises(ValueError):
        ThroughputMeter(window=0)


def test_peak_memory_cpu():
    expected = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB -> GiB
    value = peak_memory_gib(torch.device("cpu"))
    assert value >= expected > 0.01  # a Python process with torch loaded uses more than 10 MiB


def test_format_bench_table():
    rows = [
        {
            "step": 1,
            "seconds": 4.0,
            "time_forward": 1.0,
            "time_backward": 2.0,
            "time_optimizer": 0.5,
            "tokens_per_s": 50.0,
            "padding_fraction": 0.25,
            "mfu": None,
            "peak_memory_gib": 1.5,
        },
        {
            "step": 2,
            "seconds": 2.0,
            "time_forward": 0.5,
            "time_backward": 1.0,
            "time_optimizer": 0.25,
            "tokens_per_s": 100.0,
            "padding_fraction": 0.1,
            "mfu": 30.0,
            "peak_memory_gib": 1.5,
        },
        {
            "step": 3,
            "seconds": 4.0,
            "time_forward": 1.5,
            "time_backward": 2.0,
            "time_optimizer": 0.25,
            "tokens_per_s": 50.0,
            "padding_fraction": 0.0,
            "mfu": 10.0,
            "peak_memory_gib": 2.0,
        },
    ]
    table = format_bench_table(rows, TRAINER_BENCH_COLUMNS)
    lines = table.splitlines()
    assert len(lines) == 5 and "tokens/s" in lines[0] and "MFU %" in lines[0]
    assert lines[1].split() == ["1", "4.000", "1.000", "2.000", "0.500", "50.0", "25.0", "-", "1.50"]
    assert lines[2].split() == ["2", "2.000", "0.500", "1.000", "0.250", "100.0", "10.0", "30.00", "1.50"]
    # Summary over steps 2 and 3, written like the cells: seconds 2, 4 -> 3 ± sqrt(2); forward 0.5, 1.5 -> 1 ±
    # sqrt(2) / 2; backward 1, 2 -> 1.5 ± sqrt(2) / 2; optimizer 0.25 twice -> 0.25 ± 0; tokens/s 100, 50 -> 75 ±
    # sqrt(2) * 25; MFU 30, 10 -> 20 ± sqrt(2) * 10.
    assert lines[4] == (
        "summary over 2 steps after the first: seconds 3.000 ± 1.414, forward s 1.000 ± 0.707, "
        "backward s 1.500 ± 0.707, optim s 0.250 ± 0.000, tokens/s 75.0 ± 35.4, MFU % 20.00 ± 14.14"
    )
    assert "no steps after" in format_bench_table(rows[:1], TRAINER_BENCH_COLUMNS)
