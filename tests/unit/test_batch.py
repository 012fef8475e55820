"""The orchestrator -> trainer batch file: atomic writes, typed reads, validation."""

from pathlib import Path

import msgspec
import pytest

from prime_rl.batch import (
    BatchError,
    TrainingBatch,
    TrainingSample,
    batch_path,
    read_batch,
    validate_batch,
    write_batch,
)

VOCAB = 100
SEQ_LEN = 16


def sample(n: int = 4, **overrides) -> TrainingSample:
    fields = dict(
        token_ids=list(range(1, n + 1)),
        loss_mask=[i >= n // 2 for i in range(n)],
        inference_logprobs=[-0.5 if i >= n // 2 else 0.0 for i in range(n)],
        advantages=[0.25] * n,
        temperature=0.7,
        policy_versions=[3, 4],
    )
    fields.update(overrides)
    return TrainingSample(**fields)


def make_batch(*samples: TrainingSample, step: int = 5) -> TrainingBatch:
    return TrainingBatch(step=step, samples=list(samples) or [sample(), sample(6)])


def test_batch_path(tmp_path: Path):
    assert batch_path(tmp_path, 7) == tmp_path / "rollouts" / "step_7" / "batch.bin"


def test_round_trip_and_no_temp_file_left(tmp_path: Path):
    batch = make_batch(sample(), sample(7, temperature=1.0, policy_versions=[]))
    path = batch_path(tmp_path, 5)
    write_batch(batch, path)
    assert read_batch(path) == batch
    assert [p.name for p in path.parent.iterdir()] == ["batch.bin"]
    assert not list(tmp_path.rglob("*.tmp*"))


def test_overwrite_is_atomic_replace(tmp_path: Path):
    path = tmp_path / "batch.bin"
    write_batch(make_batch(step=1), path)
    write_batch(make_batch(step=2), path)
    assert read_batch(path).step == 2
    assert [p.name for p in tmp_path.iterdir()] == ["batch.bin"]


def test_defaults_apply_when_fields_absent(tmp_path: Path):
    path = tmp_path / "batch.bin"
    raw = {
        "step": 0,
        "samples": [{"token_ids": [1], "loss_mask": [True], "inference_logprobs": [-1.0], "advantages": [1]}],
    }
    path.write_bytes(msgspec.msgpack.encode(raw))
    s = read_batch(path).samples[0]
    assert (s.temperature, s.policy_versions, s.advantages) == (1.0, [], [1.0])


def _assert_clean_batch_error(path: Path) -> BatchError:
    with pytest.raises(BatchError) as info:
        read_batch(path)
    assert str(path) in str(info.value)
    assert "corrupt or truncated batch file" in str(info.value)
    assert not isinstance(info.value, msgspec.MsgspecError)
    return info.value


def test_truncated_file(tmp_path: Path):
    path = tmp_path / "batch.bin"
    write_batch(make_batch(), path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    _assert_clean_batch_error(path)


@pytest.mark.parametrize("data", [b"", b"\xc1\x00garbage", bytes(range(256)), b"\x93\x01\x02"])
def test_garbage_file(tmp_path: Path, data: bytes):
    path = tmp_path / "batch.bin"
    path.write_bytes(data)
    _assert_clean_batch_error(path)


def test_wrong_typed_field(tmp_path: Path):
    path = tmp_path / "batch.bin"
    good = msgspec.to_builtins(make_batch(sample(), sample()))
    good["samples"][1]["token_ids"][2] = "oops"
    path.write_bytes(msgspec.msgpack.encode(good))
    err = _assert_clean_batch_error(path)
    assert "samples[1].token_ids[2]" in str(err)


def test_missing_file_is_not_a_batch_error(tmp_path: Path):
    with pytest.raises(FileNotFoundError):
        read_batch(tmp_path / "nope.bin")


def test_valid_batch_passes(tmp_path: Path):
    validate_batch(make_batch(sample(), sample(SEQ_LEN)), tmp_path, VOCAB, SEQ_LEN)


@pytest.mark.parametrize(
    ("bad", "needle"),
    [
        (sample(loss_mask=[True]), "unequal"),
        (sample(inference_logprobs=[0.0] * 5), "inference_logprobs has 5"),
        (sample(advantages=[]), "advantages has 0"),
        (sample(0), "empty"),
        (sample(token_ids=[1, 2, -1, 3]), "token id -1 at position 2"),
        (sample(token_ids=[1, VOCAB, 2, 3]), f"token id {VOCAB} at position 1"),
        (sample(SEQ_LEN + 1), f"has {SEQ_LEN + 1} tokens, more than seq_len={SEQ_LEN}"),
        (sample(inference_logprobs=[0.0, 0.0, float("nan"), -1.0]), "non-finite inference_logprobs"),
        (sample(advantages=[0.0, float("inf"), 0.0, 0.0]), "non-finite advantages value inf at position 1"),
        (sample(temperature=0.0), "temperature"),
        (sample(temperature=-1.0), "temperature"),
        (sample(reward=float("nan")), "non-finite reward nan"),
    ],
)
def test_validate_batch_names_path_sample_and_problem(tmp_path: Path, bad: TrainingSample, needle: str):
    path = tmp_path / "batch.bin"
    with pytest.raises(BatchError) as info:
        validate_batch(make_batch(sample(), sample(), bad), path, VOCAB, SEQ_LEN)
    msg = str(info.value)
    assert str(path) in msg and "sample 2 " in msg and needle in msg, msg


# The loss streams: ce_weights, ref_logprobs, ref_kl_mask (empty: none).

STREAMS = dict(
    ce_weights=[0.0, 0.0, 1.0, 0.5], ref_logprobs=[0.0, 0.0, -1.5, -0.25], ref_kl_mask=[False, False, True, True]
)


def test_round_trip_with_the_loss_streams(tmp_path: Path):
    batch = make_batch(sample(**STREAMS), sample(6), sample(ce_weights=[0.0, 1.0, 2.0, 0.0]))
    path = batch_path(tmp_path, 5)
    write_batch(batch, path)
    assert read_batch(path) == batch
    assert read_batch(path).samples[0].ref_kl_mask == [False, False, True, True]
    validate_batch(read_batch(path), path, VOCAB, SEQ_LEN)


def test_a_batch_written_before_the_streams_loads_without_them(tmp_path: Path):
    path = tmp_path / "batch.bin"
    old = {  # every field a batch had before the streams, none of theirs
        "step": 0,
        "samples": [{"token_ids": [1, 2], "loss_mask": [False, True], "inference_logprobs": [0.0, -1.0],
                     "advantages": [1.0, 1.0], "temperature": 1.0, "policy_versions": [0], "reward": 1.0}],
    }  # fmt: skip
    path.write_bytes(msgspec.msgpack.encode(old))
    batch = read_batch(path)
    s = batch.samples[0]
    assert (s.ce_weights, s.ref_logprobs, s.ref_kl_mask) == ([], [], [])
    validate_batch(batch, path, VOCAB, SEQ_LEN)


def test_a_wrong_typed_stream_is_a_batch_error(tmp_path: Path):
    path = tmp_path / "batch.bin"
    raw = msgspec.to_builtins(make_batch(sample(), sample(**STREAMS)))
    raw["samples"][1]["ref_kl_mask"][1] = "yes"
    path.write_bytes(msgspec.msgpack.encode(raw))
    assert "samples[1].ref_kl_mask[1]" in str(_assert_clean_batch_error(path))


@pytest.mark.parametrize(
    ("bad", "needle"),
    [
        (sample(ce_weights=[1.0] * 3), "has 3 ce_weights for 4 tokens"),
        (sample(ref_logprobs=[0.0] * 5), "has 5 ref_logprobs for 4 tokens"),
        (sample(ref_kl_mask=[True]), "has 1 ref_kl_mask for 4 tokens"),
        (sample(ce_weights=[0.0, 0.0, -0.5, 1.0]), "negative ce_weights value -0.5 at position 2"),
        (sample(ce_weights=[0.0, float("nan"), 0.0, 1.0]), "non-finite ce_weights value nan at position 1"),
        (sample(ce_weights=[0.0, 0.0, float("inf"), 1.0]), "non-finite ce_weights value inf at position 2"),
        (sample(ref_kl_mask=[False, False, True, True]), "has ref_kl_mask tokens but no ref_logprobs"),
        (
            sample(ref_logprobs=[0.0, 0.0, -1.0, float("-inf")], ref_kl_mask=[False, False, True, True]),
            "non-finite ref_logprobs value -inf at ref_kl_mask position 3",
        ),
        (sample(reward=float("nan"), **STREAMS), "non-finite reward nan"),  # the checks after the streams still run
    ],
)
def test_validate_batch_names_a_bad_stream(tmp_path: Path, bad: TrainingSample, needle: str):
    path = tmp_path / "batch.bin"
    with pytest.raises(BatchError) as info:
        validate_batch(make_batch(sample(), sample(**STREAMS), bad), path, VOCAB, SEQ_LEN)
    msg = str(info.value)
    assert str(path) in msg and "sample 2 " in msg and needle in msg, msg


def test_streams_that_train_nothing_are_valid(tmp_path: Path):
    # a reference log-prob may be anything (even -inf: the reference rules the token out) where no ref_kl token is;
    # all-zero ce weights and an all-False mask train nothing
    fine = sample(ce_weights=[0.0] * 4, ref_logprobs=[float("-inf"), 0.0, -1.0, 0.0], ref_kl_mask=[False] * 4)
    validate_batch(make_batch(fine, sample(ref_logprobs=[0.0, float("nan"), -1.0, -2.0])), tmp_path, VOCAB, SEQ_LEN)
