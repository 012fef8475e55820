"""The on-disk batch format shared by the orchestrator (writer) and the trainer (reader).

One file per trainer step, `{output_dir}/rollouts/step_{n}/batch.bin`, msgpack-encoded with msgspec. The writer
publishes the file atomically (temp file + fsync + rename), so a reader that sees the path always sees a complete
file; the reader decodes with a typed decoder so a wrong-typed field fails at load time, not deep in training.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Sequence
from pathlib import Path

import msgspec

from prime_rl.utils.fs import write_atomic


class TrainingSample(msgspec.Struct, frozen=True):
    """One trajectory, token-aligned: every per-token list has one entry per token in `token_ids` (an optional
    stream may instead be empty: it trains nothing).

    Three loss components, each a sum over its own tokens divided by its own count in the whole step, so the
    trainer executes whatever streams an algorithm ships without knowing the algorithm (`docs/trainer.md`, "Loss
    components"): the policy gradient on `loss_mask` tokens (`advantages`), cross-entropy on tokens of
    `ce_weights` > 0, and the reverse KL to `ref_logprobs` on `ref_kl_mask` tokens.
    """

    token_ids: list[int]
    """Prompt + completion (+ environment turns): exactly the tokens the model saw."""
    loss_mask: list[bool]
    """True on tokens sampled by the policy that are trained on."""
    inference_logprobs: list[float]
    """Logprob of each token under the sampling policy (0.0 where `loss_mask` is False)."""
    advantages: list[float]
    """Per-token advantage (a per-sample advantage repeated over its tokens)."""
    temperature: float = 1.0
    """Sampling temperature; the trainer divides logits by it so its logprobs match the sampler's."""
    policy_versions: list[int] = []
    """Distinct policy steps that generated the sample's tokens, ascending."""
    reward: float = 0.0
    """The reward of the rollout the sample is part of: the trainer's critic (`[critic]`) computes advantages from it."""
    ce_weights: list[float] = []
    """Per-token cross-entropy weight w >= 0: a token with w > 0 adds -w * log pi(token). Empty: no CE tokens."""
    ref_logprobs: list[float] = []
    """Per-token logprob under a frozen reference (a teacher, or the policy shown a demonstration). Empty: none."""
    ref_kl_mask: list[bool] = []
    """Tokens trained with the reverse KL to `ref_logprobs` (which they require). Empty: none."""


class TrainingBatch(msgspec.Struct, frozen=True):
    """Everything the trainer consumes for one step."""

    step: int
    """Trainer step that consumes this batch."""
    samples: list[TrainingSample]


class BatchError(ValueError):
    """A batch file that cannot be used; the message names the file and, where relevant, the sample index."""


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(TrainingBatch)


def batch_path(output_dir: Path, step: int) -> Path:
    """Where the batch for `step` lives; the one place both processes agree on the layout."""
    return Path(output_dir) / "rollouts" / f"step_{step}" / "batch.bin"


def remove_batch(output_dir: Path, step: int) -> None:
    """Delete `rollouts/step_{step}/` once its batch is trained: the consumer (trainer) owns a written batch.

    Nothing reads a trained batch again: a resumed run restarts after its checkpoint step, and `rl` deletes
    the batches after that step so the orchestrator writes them anew.
    """
    shutil.rmtree(batch_path(output_dir, step).parent, ignore_errors=True)


def write_batch(batch: TrainingBatch, path: Path) -> None:
    """Write `batch` so that `path` appears only once complete (temp file, fsync, rename)."""
    write_atomic(Path(path), _ENCODER.encode(batch))


def read_batch(path: Path) -> TrainingBatch:
    """Load and type-check a batch file; any decoding failure becomes a BatchError naming the file.

    A missing file is not a corrupt one, so its OSError passes through unchanged.
    """
    data = Path(path).read_bytes()
    try:
        return _DECODER.decode(data)
    except msgspec.DecodeError as exc:  # ValidationError is a subclass
        raise BatchError(f"{path}: corrupt or truncated batch file: {exc}") from None


def _first_non_finite(values: Sequence[float]) -> int | None:
    """Index of the first NaN/inf, or None; the all() fast path keeps the common case in C."""
    if all(map(math.isfinite, values)):
        return None
    return next(i for i, v in enumerate(values) if not math.isfinite(v))


def _sample_problem(sample: TrainingSample, vocab_size: int, seq_len: int) -> str | None:
    """Describe the first thing wrong with one sample, or None if it is usable."""
    n = len(sample.token_ids)
    lengths = {
        "loss_mask": len(sample.loss_mask),
        "inference_logprobs": len(sample.inference_logprobs),
        "advantages": len(sample.advantages),
    }
    unequal = {name: length for name, length in lengths.items() if length != n}
    if unequal:
        detail = ", ".join(f"{name} has {length}" for name, length in unequal.items())
        return f"has unequal list lengths: token_ids has {n}, {detail}"
    if n == 0:
        return "is empty"
    if n > seq_len:
        return f"has {n} tokens, more than seq_len={seq_len}"
    if min(sample.token_ids) < 0 or max(sample.token_ids) >= vocab_size:
        pos, tok = next((i, t) for i, t in enumerate(sample.token_ids) if not 0 <= t < vocab_size)
        return f"has token id {tok} at position {pos}, outside the vocabulary [0, {vocab_size})"
    for name in ("inference_logprobs", "advantages"):
        values = getattr(sample, name)
        pos = _first_non_finite(values)
        if pos is not None:
            return f"has non-finite {name} value {values[pos]} at position {pos}"
    if (sample.ce_weights or sample.ref_logprobs or sample.ref_kl_mask) and (problem := _stream_problem(sample, n)):
        return problem
    if not math.isfinite(sample.reward):
        return f"has non-finite reward {sample.reward}"
    if not (math.isfinite(sample.temperature) and sample.temperature > 0):
        return f"has temperature {sample.temperature}, which must be finite and > 0"
    return None


def _stream_problem(sample: TrainingSample, n: int) -> str | None:
    """The first thing wrong with the optional streams (`ce_weights`, `ref_logprobs`, `ref_kl_mask`), or None."""
    for name in ("ce_weights", "ref_logprobs", "ref_kl_mask"):
        length = len(getattr(sample, name))
        if length not in (0, n):
            return f"has {length} {name} for {n} tokens (one per token, or none)"
    weights = sample.ce_weights
    pos = _first_non_finite(weights)
    if pos is not None:
        return f"has non-finite ce_weights value {weights[pos]} at position {pos}"
    if weights and min(weights) < 0:
        pos = next(i for i, w in enumerate(weights) if w < 0)
        return f"has negative ce_weights value {weights[pos]} at position {pos}"
    if True in sample.ref_kl_mask:
        if not sample.ref_logprobs:
            return "has ref_kl_mask tokens but no ref_logprobs"
        logprobs = sample.ref_logprobs
        bad = next((t for t, m in enumerate(sample.ref_kl_mask) if m and not math.isfinite(logprobs[t])), None)
        if bad is not None:
            return f"has non-finite ref_logprobs value {sample.ref_logprobs[bad]} at ref_kl_mask position {bad}"
    return None


def validate_batch(batch: TrainingBatch, path: Path, vocab_size: int, seq_len: int) -> None:
    """Reject a batch the trainer cannot train on, before it turns into a CUDA index error or a NaN loss.

    Whether `batch.step` is the step the trainer expects is the caller's check.
    """
    for i, sample in enumerate(batch.samples):
        problem = _sample_problem(sample, vocab_size, seq_len)
        if problem is not None:
            raise BatchError(f"{path}: sample {i} {problem}")
