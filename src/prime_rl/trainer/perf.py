"""Throughput and model-FLOPs-utilisation (MFU) accounting for the trainer and its benchmark mode.

FLOPs are counted from the model config, not measured: only matmuls count (they dominate and are what
the peak numbers describe), and only tokens that carry data (padding is work the model does for nothing,
so it lowers MFU instead of inflating it).
"""

import resource
import sys
import time
from collections import defaultdict, deque
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from prime_rl.utils.bench import Column

# Dense BF16 tensor-core peak per device (no sparsity), keyed by a substring of `torch.cuda.get_device_name()`.
# The bare "H100" / "H200" keys are the SXM parts; the longer keys win when they match.
PEAK_BF16_FLOPS: dict[str, float] = {
    "H100": 989e12,
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "H200": 989e12,
    "A100": 312e12,
    "B200": 2.25e15,
    "L40S": 362e12,
    "4090": 165e12,
}


def _head_dim(config) -> int:
    """Per-head width: Qwen3 sets it explicitly (and it need not be hidden / heads), older configs derive it."""
    head_dim = getattr(config, "head_dim", None)
    return head_dim if head_dim else config.hidden_size // config.num_attention_heads


def matmul_params_per_token(config) -> int:
    """Weights every token is multiplied by: attention and MLP projections of each layer, plus the LM head.

    Per layer: q (h*H*d), k and v (h*KV*d each), o (H*d*h), gated MLP (3*h*I). Embedding lookups are not
    matmuls, and tied embeddings still cost a full LM-head matmul, so the LM head counts either way.
    Norms and biases are left out: they are negligible next to the matmuls.
    """
    h = config.hidden_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    d = _head_dim(config)
    per_layer = 2 * h * heads * d + 2 * h * kv_heads * d + 3 * h * config.intermediate_size
    return config.num_hidden_layers * per_layer + config.vocab_size * h


def flops_per_token(config, seq_len: int) -> int:
    """Training (forward + backward) matmul FLOPs per token: `6*N + 12*L*H*d*seq_len`.

    `6*N`: each weight costs 2 FLOPs (multiply-add) in the forward and 4 in the backward (grads w.r.t. input
    and weight). `12*L*H*d*seq_len`: the two attention matmuls (q@k^T and p@v), 2*H*d*seq_len FLOPs each
    forward per token per layer, times 3 for forward + backward. `seq_len` is the length attended over; the
    causal mask is ignored (no /2), the usual convention, so MFU stays comparable with other reports.
    """
    n = matmul_params_per_token(config)
    return 6 * n + 12 * config.num_hidden_layers * config.num_attention_heads * _head_dim(config) * seq_len


def attention_entry_cost(config) -> float:
    """One attention score entry's (a query-key pair's) training FLOPs over one position's in the layers: 12*L*H*d
    over 6*N less the LM head's weights (`flops_per_token`'s two terms). The head is left out because the positions a
    shared prompt saves are never scored by it (`model/logprobs.py` scores only positions before trained tokens).
    Qwen3-0.6B: 1/3,840; SmolLM2-135M: 1/3,072. What decides whether samples share a prompt (`packing.unit_cost`)."""
    layers, heads = config.num_hidden_layers, config.num_attention_heads
    in_layers = matmul_params_per_token(config) - config.vocab_size * config.hidden_size
    return 2 * layers * heads * _head_dim(config) / in_layers


def peak_flops(device_name: str) -> float | None:
    """Peak dense BF16 FLOP/s of one device from its name; None when unknown (including any CPU)."""
    matches = [key for key in PEAK_BF16_FLOPS if key.lower() in device_name.lower()]
    if not matches:
        return None
    return PEAK_BF16_FLOPS[max(matches, key=len)]


class ThroughputMeter:
    """Rolling throughput over the last `window` steps; the first step is dropped (compilation, allocator warm-up).

    Feed it global counts (summed over all ranks) so that `mfu` can divide by the world size.
    """

    def __init__(self, window: int = 10) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self._steps: deque[tuple[float, int, int]] = deque(maxlen=window)
        self._seen = 0

    def update(self, step_seconds: float, tokens: int, computed_tokens: int) -> None:
        """Record one step: wall time, the samples' tokens, and the positions the model computed for them (padding
        excluded; fewer than `tokens` where samples share a prompt, `packing.layout_units`)."""
        if step_seconds <= 0:
            raise ValueError(f"step_seconds must be > 0, got {step_seconds}")
        if tokens < 0 or computed_tokens < 0:
            raise ValueError(f"token counts must be >= 0, got {tokens} and {computed_tokens}")
        self._seen += 1
        if self._seen > 1:
            self._steps.append((step_seconds, tokens, computed_tokens))

    @property
    def tokens_per_s(self) -> float | None:
        """The samples' tokens per second over the window; None until a step after the warm-up one is recorded."""
        if not self._steps:
            return None
        return sum(s[1] for s in self._steps) / sum(s[0] for s in self._steps)

    def mfu(self, flops_per_token: float, peak_flops_per_device: float | None, world_size: int) -> float | None:
        """Model FLOPs utilisation in percent; None when the device peak is unknown or nothing is measured yet."""
        if peak_flops_per_device is None or not self._steps:
            return None
        computed_per_s = sum(s[2] for s in self._steps) / sum(s[0] for s in self._steps)  # the FLOPs actually spent
        return 100.0 * flops_per_token * computed_per_s / (peak_flops_per_device * world_size)


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this process on `device` in GiB: allocated CUDA memory, or max RSS on the host."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return max_rss / 2**30 if sys.platform == "darwin" else max_rss / 2**20


class PhaseTimer:
    """Seconds per phase of a step (`forward`, `backward`, `optimizer`), summed over the step's micro-batches.

    On CUDA the host runs ahead of the kernels, so a phase is timed with CUDA events and read once at the end of the
    step (`pop`, one synchronisation) instead of stalling the host after every micro-batch; on a CPU by the clock.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._spans: dict[str, list] = defaultdict(list)

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._spans[phase].append((start, end))
        else:
            t0 = time.perf_counter()
            yield
            self._spans[phase].append(time.perf_counter() - t0)

    def pop(self) -> dict[str, float]:
        """`time_<phase>` in seconds for each phase timed since the last call."""
        if self.cuda and self._spans:
            torch.cuda.synchronize()
        times = {
            f"time_{phase}": sum(s[0].elapsed_time(s[1]) / 1e3 if self.cuda else s for s in spans)
            for phase, spans in self._spans.items()
        }
        self._spans.clear()
        return times


TRAINER_BENCH_COLUMNS = [
    Column("step", "step", "d"),
    Column("seconds", "seconds", ".3f", summary=True),
    Column("forward s", "time_forward", ".3f", summary=True),
    Column("backward s", "time_backward", ".3f", summary=True),
    Column("optim s", "time_optimizer", ".3f", summary=True),
    Column("tokens/s", "tokens_per_s", ".1f", summary=True),
    Column("padding %", "padding_fraction", ".1f", scale=100),
    Column("MFU %", "mfu", ".2f", summary=True),
    Column("peak mem GiB", "peak_memory_gib", ".2f"),
]
"""The trainer's `--bench` table (`utils.bench.format_bench_table`): `seconds` is the training time of a step, of
which forward, backward and the optimizer step are the main parts (`PhaseTimer`)."""
