"""The in-memory weight broadcast's protocol, end to end without vLLM: the real trainer side (`WeightSender`, serving
from the trainer's wait loop on a one-rank world), the real orchestrator side (`BroadcastClient`) and stand-in workers
(`broadcast_receiver.py`, long-lived processes that receive as vLLM's workers do). The vLLM side is
tests/integration/test_weight_broadcast.py."""

import asyncio
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import TEST_KEY, TEST_SECRET
from transformers import AutoModelForCausalLM

from prime_rl.config import CheckpointConfig, WeightBroadcastConfig
from prime_rl.models.tiny import TinyModelConfig, build_tiny_model
from prime_rl.orchestrator.broadcast import BroadcastClient
from prime_rl.trainer.rl import train
from prime_rl.trainer.rl.batches import wait_until
from prime_rl.trainer.rl.broadcast import WeightSender, header
from prime_rl.trainer.weights import STABLE, save_hf_dir
from prime_rl.utils.net import free_port
from prime_rl.utils.secret import SECRET_VAR
from prime_rl.weight_broadcast.protocol import ORCHESTRATOR_DONE, Header, layer_groups

RECEIVER = Path(__file__).with_name("broadcast_receiver.py")
TIMEOUT = 20.0


def test_layer_groups_put_non_layer_tensors_first_and_keep_order_within_a_layer():
    names = [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.10.mlp.up_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.2.input_layernorm.weight",
        "model.norm.weight",
        "lm_head.weight",
    ]
    assert layer_groups(names) == [
        ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"],
        ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.up_proj.weight"],
        ["model.layers.2.input_layernorm.weight"],
        ["model.layers.10.mlp.up_proj.weight"],  # numeric order: 10 after 2
    ]


def test_header_round_trips_and_lists_a_tied_output_layer_once(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(TinyModelConfig(output=tmp_path / "m")))
    h = header(model, 7, torch.bfloat16)
    assert Header.decode(h.encode()) == h
    assert h.step == 7 and h.dtype == "bfloat16"
    specs = h.specs()
    assert "lm_head.weight" not in specs and specs["model.embed_tokens.weight"] == tuple(
        model.model.embed_tokens.weight.shape
    )
    assert set(specs) == {n for n, _ in model.named_parameters()}  # every parameter once
    assert [len(g) for g in h.groups[1:]] == [len(h.groups[1])] * (len(h.groups) - 1)  # one group per layer


class Receiver:
    """A stand-in worker process: one JSON line in, one JSON answer out, per transfer."""

    def __init__(self, name: str, tmp: Path, settings: dict):
        self.name, self.tmp, self.settings = name, tmp, settings
        self.proc = subprocess.Popen(
            [sys.executable, str(RECEIVER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.count = 0

    async def receive(self, body: dict, **test_fields) -> dict:
        self.count += 1
        out = self.tmp / f"{self.name}-{self.count}.pt"
        line = json.dumps({"broadcast": body["broadcast"], "settings": self.settings, "out": str(out), **test_fields})

        def exchange() -> dict:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
            answer = self.proc.stdout.readline()
            if not answer:
                raise ConnectionError(f"{self.name} died (exit {self.proc.wait()})")
            return json.loads(answer)

        reply = await asyncio.to_thread(exchange)
        if "step" in reply:
            reply["tensors"] = torch.load(out)
        return reply

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def trainer(tmp_path, one_rank, monkeypatch):
    """The trainer side on a one-rank world: `WeightSender` hosting the store, serving from `wait_until` in a thread
    (as the trainer does while it waits for a batch) until the orchestrator says it is done."""
    monkeypatch.setenv(SECRET_VAR, TEST_SECRET)
    world = one_rank
    config = WeightBroadcastConfig(type="gloo", port=free_port(), timeout=TIMEOUT)
    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(TinyModelConfig(output=tmp_path / "model")))
    sender = WeightSender(config, world)
    run = SimpleNamespace(model=model, export_dtype=torch.bfloat16)
    errors = []

    def serve() -> None:
        try:
            done = lambda: sender.table.check([ORCHESTRATOR_DONE])  # noqa: E731
            wait_until(world, done, "the test to finish", 120, sender, run)
        except BaseException as e:  # pragma: no cover - reported by the test
            errors.append(e)

    thread = threading.Thread(target=serve)
    thread.start()
    settings = {"host": config.host, "port": config.port, "timeout": TIMEOUT, "key": TEST_KEY.hex()}
    yield SimpleNamespace(config=config, sender=sender, model=model, errors=errors, settings=settings)
    sender.table.set(ORCHESTRATOR_DONE, "test")
    thread.join(30)
    sender.close()
    assert not errors, errors


def expected(model, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    return {name: p.detach().to(dtype) for name, p in model.named_parameters()}


def test_every_receiver_gets_the_exact_weights_and_a_dead_one_fails_only_that_transfer(trainer, tmp_path):
    a, b = Receiver("a", tmp_path, trainer.settings), Receiver("b", tmp_path, trainer.settings)
    client = BroadcastClient(trainer.config, ack_timeout=TIMEOUT)
    receivers = {"a": a, "b": b}

    async def scenario():
        trainer.sender.publish(1)
        while client.published() != 1:  # the client connects to the trainer's store lazily
            await asyncio.sleep(0.05)
        # Two transfers to both: exact bf16 copies of the parameters, labelled with the step; one group for both.
        step, results = await client.transfer([("a", 1), ("b", 1)], lambda url, body: receivers[url].receive(body))
        first_group = client.group
        assert step == 1 and first_group is not None
        for result in results:
            assert result["step"] == 1
            assert result["tensors"].keys() == expected(trainer.model).keys()
            for name, tensor in expected(trainer.model).items():
                assert torch.equal(result["tensors"][name], tensor), name
        with torch.no_grad():
            for p in trainer.model.parameters():
                p.add_(1.0)
        trainer.sender.publish(2)
        step, results = await client.transfer([("a", 1), ("b", 1)], lambda url, body: receivers[url].receive(body))
        assert step == 2 and client.group == first_group  # same members: the group was kept
        assert all(
            torch.equal(r["tensors"]["model.norm.weight"], expected(trainer.model)["model.norm.weight"])
            for r in results
        )
        # Every answer was deleted once read, and so were the group's rendezvous keys: nothing stale is left.
        assert sorted(trainer.sender.table.data) == ["published", "session"]

        # A receiver refuses the header: nobody receives anything (the orchestrator ends the run on the server's 422).
        step, results = await client.transfer(
            [("a", 1), ("b", 1)],
            lambda url, body: receivers[url].receive(body, refuse=url == "b"),
        )
        assert [r.get("refused") for r in results] == [True, True]
        assert "refused" in client.last_served["error"]

        # b dies after its third tensor of the next transfer (a crashed worker).
        started = time.monotonic()
        step, results = await client.transfer(
            [("a", 1), ("b", 1)],
            lambda url, body: receivers[url].receive(body, die_after=3 if url == "b" else None),
        )
        elapsed = time.monotonic() - started
        assert isinstance(results[1], ConnectionError)
        served = client.last_served
        # Gloo sees the closed connection at once: the trainer reports it well within the timeout, and goes on.
        assert "Connection reset by peer" in served["error"] or "Connection closed by peer" in served["error"], served
        assert elapsed < TIMEOUT / 2, elapsed
        assert client.members is None  # the next transfer builds a new group

        # The next transfer goes to a alone, in a new group: a gets the current weights exactly.
        with torch.no_grad():
            for p in trainer.model.parameters():
                p.mul_(0.5)
        trainer.sender.publish(3)
        step, results = await client.transfer([("a", 1)], lambda url, body: receivers[url].receive(body))
        assert step == 3 and client.group != first_group
        for name, tensor in expected(trainer.model).items():
            assert torch.equal(results[0]["tensors"][name], tensor), name

    try:
        asyncio.run(scenario())
    finally:
        client.close()
        a.close()
        b.close()


def test_a_restarted_orchestrator_never_acts_on_an_earlier_one_s_requests_or_answers(trainer, tmp_path):
    """An orchestrator that crashed left answers nobody read. A new orchestrator numbers its requests under its own
    id, and its first transfer gets the current step, not an old answer (it used to "succeed" in 3 ms with an old
    step). A crash is not a finish: the trainer keeps waiting for its policy to be taken."""
    receiver = Receiver("r", tmp_path, trainer.settings)
    old, new = BroadcastClient(trainer.config, ack_timeout=TIMEOUT), BroadcastClient(trainer.config, TIMEOUT)

    async def scenario():
        trainer.sender.publish(1)
        while old.published() != 1:
            await asyncio.sleep(0.05)
        step, _ = await old.transfer([("r", 1)], lambda url, body: receiver.receive(body))
        assert step == 1
        # The old orchestrator's leftovers: answers to a request it never read (as if it died waiting).
        trainer.sender.table.set(f"ack/{old.id}-1", json.dumps({"step": 1}))
        trainer.sender.table.set(f"served/{old.id}-1", json.dumps({"step": 1, "error": None}))
        with torch.no_grad():
            for p in trainer.model.parameters():
                p.add_(2.0)
        trainer.sender.publish(2)
        old.close()  # a crash: no finish
        assert not trainer.sender.taken_or_unwanted(2)
        while new.published() != 2:
            await asyncio.sleep(0.05)
        assert new.id != old.id
        step, results = await new.transfer([("r", 1)], lambda url, body: receiver.receive(body))
        assert step == 2 and results[0]["step"] == 2
        for name, tensor in expected(trainer.model).items():
            assert torch.equal(results[0]["tensors"][name], tensor), name
        assert trainer.sender.taken_or_unwanted(2)

    try:
        asyncio.run(scenario())
    finally:
        new.close()
        receiver.close()


def test_a_malformed_request_is_dropped_and_never_stops_the_trainer(trainer, tmp_path):
    """Only a holder of the run secret can write a request, but a careless one (a version skew, a bug) used to kill
    rank 0 outside its `try` while the other ranks waited in a collective."""
    receiver = Receiver("r", tmp_path, trainer.settings)
    client = BroadcastClient(trainer.config, ack_timeout=TIMEOUT)
    garbage = [
        b"not json",
        b"[1, 2]",
        b'{"id": "x", "group": "y", "world_size": 2}',
        json.dumps({"id": "a" * 32 + "-1", "group": "b" * 32, "world_size": 10**30}).encode(),
    ]

    async def scenario():
        trainer.sender.publish(1)
        while client.published() != 1:
            await asyncio.sleep(0.05)
        for value in garbage:
            trainer.sender.table.set("request", value)
            deadline = time.monotonic() + 10
            while trainer.sender.table.check(["request"]):
                assert time.monotonic() < deadline, "the trainer never took the request"
                await asyncio.sleep(0.01)
        assert not trainer.errors
        step, results = await client.transfer([("r", 1)], lambda url, body: receiver.receive(body))
        assert step == 1 and results[0]["step"] == 1

    try:
        asyncio.run(scenario())
    finally:
        client.close()
        receiver.close()


def test_the_trainer_waits_for_its_policy_to_be_taken_then_moves_on(trainer):
    """`taken_or_unwanted` is what `publish` waits on: false until a transfer of the step (or a newer one) succeeded,
    or the orchestrator said it is done."""
    sender = trainer.sender
    sender.publish(4)
    assert not sender.taken_or_unwanted(4)
    sender.taken = 4
    assert sender.taken_or_unwanted(4) and sender.taken_or_unwanted(3) and not sender.taken_or_unwanted(5)
    client = BroadcastClient(trainer.config, ack_timeout=TIMEOUT)
    while not client._connected():
        time.sleep(0.05)
    client.finish()
    client.close()
    assert sender.taken_or_unwanted(5)


def test_a_checkpoint_step_is_offered_by_broadcast_before_its_directory_is_stable(tmp_path, monkeypatch, one_rank):
    """At a checkpoint step the trainer writes `broadcasts/step_n` and offers step n by broadcast, then waits until
    it is taken. An orchestrator that found the directory's STABLE while the store still named the older step loaded
    it from disk and never asked for the broadcast, and the two waited for each other (found in CI). So when STABLE
    appears, the store names the step already (the orchestrator then takes it by broadcast)."""
    monkeypatch.setenv(SECRET_VAR, TEST_SECRET)
    config = WeightBroadcastConfig(type="gloo", port=free_port(), timeout=TIMEOUT)
    sender = WeightSender(config, one_rank)
    client = BroadcastClient(config, ack_timeout=TIMEOUT)
    seen = []

    def save_then_look(*args, **kwargs) -> Path:
        target = save_hf_dir(*args, **kwargs)
        seen.append(((target / STABLE).exists(), client.published()))
        sender.table.set(ORCHESTRATOR_DONE, "test")  # the orchestrator wants nothing more: `publish` stops waiting
        return target

    monkeypatch.setattr(train, "save_hf_dir", save_then_look)
    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(TinyModelConfig(output=tmp_path / "model")))
    run = SimpleNamespace(
        model=model, export_dtype=torch.bfloat16, ckpt=SimpleNamespace(config=CheckpointConfig(interval=2))
    )
    trainer_config = SimpleNamespace(output_dir=tmp_path / "out", batch_timeout=TIMEOUT)
    try:
        train.publish(run, None, 2, 10, trainer_config, one_rank, sender)
    finally:
        client.close()
        sender.close()
    assert seen == [(True, 2)]
