"""Stand-ins for vLLM's engine client and name table, so our admin routes' state machines run in-process (importing
vLLM alone takes ~10 s; the real engine is the integration tests'), and the tiny PEFT adapters they load."""

import json
from argparse import Namespace
from dataclasses import dataclass
from pathlib import Path

import torch
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient
from safetensors.torch import save_file

from prime_rl.inference.access import AccessGuard, server_tokens
from prime_rl.inference.adapters import Adapters
from prime_rl.inference.admin import router
from prime_rl.inference.swapper import WeightsUnknownGate, WeightSwapper

SHAPES = {"embed.weight": (10, 4), "norm.weight": (4,)}
LORA_SHAPES = {**SHAPES, "layers.0.q_proj.weight": (6, 4), "layers.0.o_proj.weight": (4, 6)}
"""A base model with two linear layers LoRA can target."""
BASE_NAME = "base-model"


def make_dir(path: Path, shapes: dict, dtype=torch.float32) -> Path:
    path.mkdir(parents=True)
    save_file({k: torch.zeros(v, dtype=dtype) for k, v in shapes.items()}, str(path / "model.safetensors"))
    return path


def write_adapter(path: Path, tensors: dict, rank: int = 2, **config) -> Path:
    """A PEFT adapter directory: `tensors` under `adapter_model.safetensors`, an adapter_config.json (r = `rank`)."""
    path.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "adapter_model.safetensors"))
    body = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj"], "bias": "none"}
    (path / "adapter_config.json").write_text(json.dumps({**body, **config}))
    return path


def lora_tensors(layer: str = "layers.0.q_proj", out: int = 6, inner: int = 4, rank: int = 2, fill: float = 0.5):
    prefix = f"base_model.model.{layer}"
    return {
        f"{prefix}.lora_A.weight": torch.full((rank, inner), float(fill)),
        f"{prefix}.lora_B.weight": torch.full((out, rank), float(fill)),
    }


class FakeEngine:
    """Stands in for vLLM's engine client in the swapper's and the adapters' state machines."""

    def __init__(self, failing: set[str] = frozenset(), lora: bool = True, max_cpu_loras: int = 2):
        parallel = Namespace(world_size=1, data_parallel_size=1)
        lora_config = Namespace(max_lora_rank=8, max_loras=2, max_cpu_loras=max_cpu_loras) if lora else None
        self.vllm_config = Namespace(parallel_config=parallel, lora_config=lora_config)
        self.failing = set(failing)
        self.calls: list[tuple] = []
        self.paused = False
        self.receive: dict | Exception = {"step": 1}
        """What a worker's `prime_broadcast_join` returns (or raises)."""
        self.load_error: Exception | None = None
        """What a worker's `prime_broadcast_load` raises (None: the weights arrive)."""
        self.cache_resets = 0
        self.loras: list = []
        """Every `add_lora` request."""
        self.lora_failure: Exception | None = None
        """What `add_lora` raises (None: it succeeds)."""

    async def collective_rpc(self, method, args=()):
        if method == "prime_lora_modules":
            return [["o_proj", "q_proj"]]
        if method == "prime_broadcast_join":
            self.calls.append((method, args[1]["group"]))
            assert not self.paused, "joining must not pause generation"
            self.polls = 0
            return [None]
        if method == "prime_broadcast_joined":
            self.polls += 1
            if self.polls < 3:
                return [None]  # still joining: the swapper polls
            if isinstance(self.receive, Exception):
                raise self.receive
            return [self.receive]
        if method == "prime_broadcast_load":
            self.calls.append((method,))
            assert self.paused, "weights must only change while generation is paused"
            if self.load_error is not None:
                raise self.load_error
            return [None]
        self.calls.append((method, *args))
        if args[0] in self.failing:
            raise RuntimeError(f"cannot load {args[0]}")

    async def add_lora(self, request):
        self.loras.append(request)
        if self.lora_failure is not None:
            raise self.lora_failure
        return True

    @property
    def engine_core(self):  # AsyncLLM's client of its engine process, which holds the scheduler
        return self

    async def pause_scheduler_async(self, mode, clear_cache):
        assert mode == "keep" and not clear_cache, "a swap keeps the requests in flight and the KV cache"
        self.paused = True

    async def resume_generation(self):
        self.paused = False

    async def reset_prefix_cache(self, reset_running_requests):
        self.cache_resets += 1

    async def update_weight_version(self, version):
        self.calls.append(("version", version))


class Counter:
    def __init__(self):
        self.value = 0

    def inc(self, n: int) -> int:
        self.value += n
        return self.value


class FakeModels:
    """vLLM's `OpenAIServingModels` as our adapters use it: the name table the serving routes read."""

    def __init__(self):
        self.lora_requests: dict = {}
        self.lora_id_counter = Counter()

    def is_base_model(self, name: str) -> bool:
        return name == BASE_NAME


@dataclass
class FakeLoRARequest:
    """vLLM's `LoRARequest` fields that our code sets and reads."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    load_inplace: bool = False


def admin_app(
    tmp_path: Path, engine=None, api_key=None, shapes=SHAPES, broadcast: dict | None = None
) -> tuple[TestClient, WeightSwapper]:
    """Our router, gate and access guard on a bare FastAPI app, with a swapper and the adapters over a real base
    directory; `broadcast`: the server's weight_broadcast settings (None: it receives no broadcasts)."""
    base = make_dir(tmp_path / "base", shapes)
    engine = engine or FakeEngine()
    app = FastAPI()
    app.include_router(router)
    app.add_middleware(WeightsUnknownGate)
    app.add_middleware(AccessGuard)
    app.add_api_route("/health", lambda: JSONResponse({}), methods=["GET"])
    app.add_api_route("/v1/completions", lambda: JSONResponse({"ok": 1}), methods=["POST"])
    app.state.args = Namespace(api_key=[api_key] if api_key else None)
    app.state.prime_tokens = server_tokens(app.state.args)
    app.state.prime_swapper = WeightSwapper(engine, base, [tmp_path], broadcast)
    app.state.prime_adapters = Adapters(
        engine, FakeModels(), [tmp_path], app.state.prime_swapper.expected, FakeLoRARequest
    )
    client = TestClient(app)
    if api_key is None and app.state.prime_tokens:  # the run secret is the token: send it like the orchestrator
        client.headers["Authorization"] = f"Bearer {app.state.prime_tokens[0]}"
    return client, app.state.prime_swapper
