"""The trainer on CUDA (`../shared/gpu-checklist.md`): `pytest -m gpu tests/gpu` on a machine with a GPU.

These have never run: the development machine has no GPU, and no GPU was lent while they were written. They need
only torch, transformers, safetensors, pydantic(-settings), loguru, msgspec and tomli-w besides our source
(`PYTHONPATH=src`), which is what a GPU machine without our other dependencies can run.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import fixed_batch
import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

QWEN3_06B = dict(
    hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128, intermediate_size=3072,
    pad_vocab_to=151_936, max_position_embeddings=40_960,
)  # fmt: skip


@pytest.fixture(scope="module")
def qwen3_shaped(tmp_path_factory) -> Path:
    """`scripts/gpu/run.sh` builds it once for the tests and the benchmarks (PRIME_RL_GPU_MODEL); else here."""
    if os.environ.get("PRIME_RL_GPU_MODEL"):
        return Path(os.environ["PRIME_RL_GPU_MODEL"])
    from prime_rl.models.tiny import TinyModelConfig, build_tiny_model

    return build_tiny_model(TinyModelConfig(output=tmp_path_factory.mktemp("m") / "qwen3-0.6b-shaped", **QWEN3_06B))


def run_ranks(script: str, nproc: int, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(script))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(path), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=os.environ.copy())


def test_fsdp2_bf16_on_nccl_learns_a_fixed_batch_with_and_without_optimizer_offload(qwen3_shaped, tmp_path):
    """Checklist 1: FSDP2 on CUDA/NCCL, bf16 compute and fp32 masters, the Qwen3-0.6B-shaped model: the loss of one
    fixed batch falls over a few steps, with `optim.cpu_offload` as without (up to the optimizer's rounding).
    GRPO's clipped loss, because its value is what its gradient descends (AIPO's multiplies a detached importance
    weight, so its value may rise while the objective improves)."""
    plain, offloaded = (fixed_batch.losses(qwen3_shaped, offload, 4096) for offload in (False, True))
    assert all(torch.isfinite(torch.tensor(plain))) and plain[-1] < plain[0], plain
    assert offloaded[0] == plain[0]  # the same weights before any optimizer step: the same forward, bit for bit
    # AdamW on the CPU (offload) and on CUDA round the same fp32 update differently in the last bits, and the bf16
    # forward magnifies that: on an H200 (2026-11-26) the losses of steps 2-5 differed by at most 1.4e-3 relative.
    assert offloaded == pytest.approx(plain, rel=1e-2) and offloaded[-1] < offloaded[0], (plain, offloaded)


def test_packed_rows_on_cuda_give_each_sample_its_own_logprobs(tmp_path):
    """Checklist 3, the GPU twin of `tests/unit/test_trainer_logprobs.py`: samples packed into one row with restarting
    position ids (transformers' block-diagonal attention through sdpa on CUDA) get the log-probs each sample gets
    alone; the same tokens as one continuous sample do not (so a leak would show)."""
    from transformers import AutoModelForCausalLM

    from prime_rl.models.tiny import TinyModelConfig, build_tiny_model
    from prime_rl.trainer.model.logprobs import forward_logprobs, install_logprob_head
    from prime_rl.trainer.packing import PackedRow, collate

    path = build_tiny_model(TinyModelConfig(output=tmp_path / "tiny", hidden_size=128, num_heads=4, num_kv_heads=2))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    install_logprob_head(model, 64)  # 325 positions: 5 chunks and a remainder
    model = model.cuda().eval()

    def logprobs(samples: list[list[int]]) -> torch.Tensor:
        n = sum(len(s) for s in samples)
        row = PackedRow(
            input_ids=torch.tensor([t for s in samples for t in s]),
            position_ids=torch.cat([torch.arange(len(s)) for s in samples]),
            loss_mask=torch.ones(n, dtype=torch.bool),
            inference_logprobs=torch.zeros(n),
            advantages=torch.zeros(n),
            temperatures=torch.ones(n),
            sample_ids=torch.cat([torch.full((len(s),), k) for k, s in enumerate(samples)]),
            num_samples=len(samples),
            sample_indices=list(range(len(samples))),
        )
        batch = collate([row], concatenate=False).to(torch.device("cuda"))
        with torch.no_grad():
            return forward_logprobs(model, batch)[0][0].cpu()

    g = torch.Generator().manual_seed(0)
    samples = [torch.randint(0, 400, (n,), generator=g).tolist() for n in (7, 1, 12, 5, 300)]
    packed, start = logprobs(samples), 0
    for s in samples:
        # fp32 on CUDA (TF32 off for matmuls by default); only the attention mask differs, so 1e-4 is far below what
        # attending to another sample moves (the control below: > 1e-3).
        torch.testing.assert_close(packed[start : start + len(s)], logprobs([s]), rtol=0, atol=1e-4)
        start += len(s)
    a, b = samples[2], samples[4]
    assert (logprobs([a + b])[len(a) + 1 :] - logprobs([b])[1:]).abs().max() > 1e-3


def test_chunked_logprobs_keep_peak_memory_flat_at_qwen3_vocab_and_16k_tokens():
    """Checklist 4: the chunked head's peak memory at vocab 151,936 and 16k tokens, against the full logits (which
    alone are 16k x 151,936 x 4 bytes = 9.3 GiB in fp32)."""
    from prime_rl.trainer.model.logprobs import chunked_logprobs

    tokens, vocab, hidden = 16384, 151_936, 1024
    h = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True) * 0.02
    w.retain_grad()
    targets = torch.randint(vocab, (tokens,), device="cuda")
    temperatures = torch.ones(tokens, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    logp, _ = chunked_logprobs(h, w, targets, temperatures, 1024)
    logp.sum().backward()
    extra = (torch.cuda.max_memory_allocated() - base) / 2**30
    print(f"chunked head, {tokens} tokens x {vocab}: peak {extra:.2f} GiB above its inputs")
    assert extra < 4.0  # chunk logits (1024 x vocab, a few fp32 copies) + the fp32 weight gradient (0.6 GiB)


@pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason="NCCL refuses two ranks on one GPU ('Duplicate GPU detected', seen on an H200): the transfer needs two",
)
def test_nccl_weight_broadcast_trainer_side_delivers_exact_weights(tmp_path, monkeypatch):
    """Checklist 5: the trainer side of the NCCL transfer on GPU 0; a second process on GPU 1 receives as a vLLM
    worker would (`prime_rl.weight_broadcast`), and gets exactly the trainer's parameters in bf16."""
    from prime_rl.utils.net import free_port

    monkeypatch.setenv("PRIME_RL_SECRET", "9c" * 32)  # the sender's; the receiver derives the store key from it
    port = free_port()
    receiver = """
    import sys, time, torch
    from prime_rl.weight_broadcast.protocol import read_session
    from prime_rl.weight_broadcast.transfer import agree, join_group, receive_header, receive_tensors
    from prime_rl.weight_broadcast.client import StoreClient
    from prime_rl.weight_broadcast.wire import StoreError
    from prime_rl.utils.secret import STORE_PURPOSE, derive
    port, out = int(sys.argv[1]), sys.argv[2]
    deadline = time.monotonic() + 60
    while True:  # the sender starts its store
        try:
            store = StoreClient("127.0.0.1", port, derive("9c" * 32, STORE_PURPOSE), 60)
            break
        except StoreError as e:
            assert time.monotonic() < deadline, f"the sender's store never answered: {e}"
            time.sleep(0.2)
    print("receiver: connected", flush=True)
    assert read_session(store, 60)["backend"] == "nccl"
    group = join_group(store, "ab" * 16, 1, 2, "nccl", 60)
    device = torch.device("cuda", 0)
    header = receive_header(group, device, 1 << 20, 60)
    agree(group, True, device, 60)
    torch.save({n: t.cpu() for n, t in receive_tensors(group, header, device, 60)}, out)
    """
    sender = """
    import json, sys, torch
    from prime_rl.config import WeightBroadcastConfig
    from prime_rl.trainer.rl.broadcast import WeightSender
    from prime_rl.trainer.parallel.distributed import init_distributed
    from prime_rl.weight_broadcast.protocol import REQUEST, Request, served_key
    world = init_distributed()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)).cuda()
    sender = WeightSender(WeightBroadcastConfig(type="nccl", port=int(sys.argv[1]), timeout=30), world)
    sender.publish(1)
    sender.table.set(REQUEST, Request("cd" * 16 + "-1", "ab" * 16, 2).encode())
    sender.serve(model, torch.bfloat16)
    print("SERVED", sender.table.get(served_key("cd" * 16 + "-1"), 0).decode())
    torch.save({n: p.detach().to(torch.bfloat16).cpu() for n, p in model.named_parameters()}, sys.argv[2])
    sender.close()
    """
    (tmp_path / "receiver.py").write_text(textwrap.dedent(receiver))
    recv = subprocess.Popen(
        [sys.executable, str(tmp_path / "receiver.py"), str(port), str(tmp_path / "got.pt")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": "1"},
    )  # fmt: skip
    try:
        sent = run_ranks(sender, 1, tmp_path, str(port), str(tmp_path / "sent.pt"))
        received = recv.communicate(timeout=90)[0]
    finally:
        recv.kill()
    report = f"sender:\n{sent.stdout[-3000:]}{sent.stderr[-5000:]}\nreceiver:\n{received[-5000:]}"
    assert sent.returncode == 0 and recv.returncode == 0, report
    assert '"error": null' in sent.stdout, report
    ours, theirs = torch.load(tmp_path / "sent.pt"), torch.load(tmp_path / "got.pt")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[n], theirs[n]) for n in ours)
