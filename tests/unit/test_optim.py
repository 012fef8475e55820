import copy
import math

import pytest
import torch
from pydantic import TypeAdapter, ValidationError

from prime_rl.trainer.optim import (
    AdamWConfig,
    ConstantSchedulerConfig,
    CosineSchedulerConfig,
    LinearSchedulerConfig,
    OptimizerConfig,
    SchedulerConfig,
    SGDConfig,
    build_optimizer,
    build_scheduler,
    clip_grad_norm,
    lr_at,
)


def schedule(config, base_lr, max_steps, n):
    return [lr_at(s, base_lr, config, max_steps) for s in range(n)]


def test_constant_without_warmup_is_flat_and_needs_no_max_steps():
    assert schedule(ConstantSchedulerConfig(), 0.5, None, 4) == [0.5] * 4


def test_constant_with_warmup():
    # (s + 1) / 4 for s < 4, then 1: the first step is not at lr 0 and step 3 is already at full lr.
    assert schedule(ConstantSchedulerConfig(warmup_steps=4), 1.0, None, 6) == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_linear_warmup_plateau_decay():
    # lr 1, warmup 2, decay 3, max 10: warmup 1/2, 2/2; plateau steps 2..6; decay steps 7, 8, 9 use
    # 1 - 1/3, 1 - 2/3, 1 - 3/3, so the last step (9) runs at exactly min_lr. Past the end it stays there.
    config = LinearSchedulerConfig(warmup_steps=2, decay_steps=3)
    expected = [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 2 / 3, 1 / 3, 0.0, 0.0]
    assert schedule(config, 1.0, 10, 11) == pytest.approx(expected, abs=1e-12)


def test_linear_decay_ends_at_min_lr():
    # lr 2, min 0.5, decay 2 of max 4, no warmup: 2, 2, 2 - 1.5/2 = 1.25, 0.5.
    config = LinearSchedulerConfig(warmup_steps=0, decay_steps=2, min_lr=0.5)
    assert schedule(config, 2.0, 4, 4) == pytest.approx([2.0, 2.0, 1.25, 0.5])


def test_cosine_values():
    # lr 1, min 0.2, warmup 2, max 10: cosine over steps 2..9 with p = (s - 1) / 8.
    config = CosineSchedulerConfig(warmup_steps=2, min_lr=0.2)
    lrs = schedule(config, 1.0, 10, 11)
    assert lrs[:2] == [0.5, 1.0]
    # s = 2: p = 1/8 -> 0.2 + 0.8 * (1 + cos(pi/8)) / 2 = 0.2 + 0.4 * 1.9238795 = 0.9695518
    assert lrs[2] == pytest.approx(0.9695518, abs=1e-7)
    # s = 5: p = 1/2 -> midpoint (lr + min_lr) / 2 = 0.6
    assert lrs[5] == pytest.approx(0.6)
    # s = 9 (last step): p = 1 -> min_lr; s = 10 stays there.
    assert lrs[9] == pytest.approx(0.2) and lrs[10] == pytest.approx(0.2)
    assert all(a >= b for a, b in zip(lrs[1:], lrs[2:], strict=False))


def test_cosine_without_warmup_starts_below_lr():
    # max 4: p = (s + 1) / 4; s = 1 -> p = 1/2 -> 0.5 with min 0.
    assert schedule(CosineSchedulerConfig(warmup_steps=0), 1.0, 4, 4)[1] == pytest.approx(0.5)


@pytest.mark.parametrize("config", [LinearSchedulerConfig(), CosineSchedulerConfig()])
def test_decaying_schedules_need_max_steps(config):
    with pytest.raises(ValueError, match="max_steps"):
        lr_at(0, 1.0, config, None)
    opt = build_optimizer([torch.nn.Parameter(torch.zeros(1))], AdamWConfig())
    with pytest.raises(ValueError, match="max_steps"):
        build_scheduler(opt, config, None)


def test_schedule_validation():
    with pytest.raises(ValueError, match="exceed max_steps"):
        lr_at(0, 1.0, ConstantSchedulerConfig(warmup_steps=5), 4)
    with pytest.raises(ValueError, match="exceed max_steps"):
        lr_at(0, 1.0, LinearSchedulerConfig(warmup_steps=5, decay_steps=6), 10)
    with pytest.raises(ValueError, match="min_lr"):
        lr_at(0, 1.0, CosineSchedulerConfig(min_lr=2.0), 20)
    with pytest.raises(ValueError, match="step"):
        lr_at(-1, 1.0, ConstantSchedulerConfig(), None)
    # warmup + decay == max_steps is allowed: no plateau.
    assert schedule(LinearSchedulerConfig(warmup_steps=1, decay_steps=1), 1.0, 2, 2) == [1.0, 0.0]


def test_config_validation():
    for bad in [{"lr": -1e-3}, {"lr": 0.0}, {"weight_decay": -0.1}, {"max_norm": -1}, {"betas": (0.9, 1.0)}]:
        with pytest.raises(ValidationError):
            AdamWConfig(**bad)
    with pytest.raises(ValidationError, match="nesterov"):
        SGDConfig(momentum=0.0)
    assert SGDConfig(momentum=0.0, nesterov=False).momentum == 0.0
    with pytest.raises(ValidationError):
        LinearSchedulerConfig(warmup_steps=-1)
    with pytest.raises(ValidationError):
        CosineSchedulerConfig(min_lr=-1.0)
    with pytest.raises(ValidationError):
        AdamWConfig(lr_typo=1.0)


def test_discriminated_unions_and_docstrings():
    assert isinstance(TypeAdapter(OptimizerConfig).validate_python({"type": "sgd", "lr": 0.1}), SGDConfig)
    assert isinstance(TypeAdapter(SchedulerConfig).validate_python({"type": "cosine"}), CosineSchedulerConfig)
    configs = [AdamWConfig, SGDConfig, ConstantSchedulerConfig, LinearSchedulerConfig, CosineSchedulerConfig]
    for cls in configs:
        for name, field in cls.model_fields.items():
            assert field.description, f"{cls.__name__}.{name} has no docstring"


def test_optimizers_get_configured_hyperparameters():
    params = [torch.nn.Parameter(torch.zeros(2))]
    group = build_optimizer(params, AdamWConfig(lr=3e-4, weight_decay=0.1, betas=(0.8, 0.95))).param_groups[0]
    assert isinstance(group, dict) and (group["lr"], group["weight_decay"], group["betas"]) == (3e-4, 0.1, (0.8, 0.95))
    opt = build_optimizer(params, SGDConfig(lr=0.2, momentum=0.5, nesterov=False, weight_decay=0.01))
    assert isinstance(opt, torch.optim.SGD)
    group = opt.param_groups[0]
    assert (group["lr"], group["momentum"], group["nesterov"], group["weight_decay"]) == (0.2, 0.5, False, 0.01)


def quadratic_params():
    # loss = x^2 + 3 y^2 at (x, y) = (1, -2): grads (2x, 6y) = (2, -12).
    x = torch.nn.Parameter(torch.tensor(1.0, dtype=torch.float64))
    y = torch.nn.Parameter(torch.tensor(-2.0, dtype=torch.float64))
    return x, y


def test_sgd_nesterov_steps_by_hand():
    x, y = quadratic_params()
    opt = build_optimizer([x, y], SGDConfig(lr=0.1, momentum=0.9, nesterov=True))
    # Step 1: buf = g; update g + 0.9 * buf = 1.9 g. x = 1 - 0.1*1.9*2 = 0.62; y = -2 + 0.1*1.9*12 = 0.28.
    (x**2 + 3 * y**2).backward()
    opt.step()
    opt.zero_grad()
    assert (x.item(), y.item()) == pytest.approx((0.62, 0.28))
    # Step 2 (x only): g = 1.24; buf = 0.9*2 + 1.24 = 3.04; update 1.24 + 0.9*3.04 = 3.976; x = 0.62 - 0.3976.
    (x**2 + 3 * y**2).backward()
    opt.step()
    assert x.item() == pytest.approx(0.2224)


def test_adamw_first_step_by_hand():
    x, y = quadratic_params()
    opt = build_optimizer([x, y], AdamWConfig(lr=0.1, weight_decay=0.01))
    (x**2 + 3 * y**2).backward()
    opt.step()
    # First Adam step moves by lr * sign(g) (bias-corrected m/sqrt(v) = g/|g|) after decoupled decay
    # p *= 1 - lr*wd = 0.999: x = 0.999 - 0.1 = 0.899; y = -1.998 + 0.1 = -1.898.
    assert (x.item(), y.item()) == pytest.approx((0.899, -1.898), abs=1e-7)


def test_clip_grad_norm():
    x, y = quadratic_params()
    (x**2 + 3 * y**2).backward()
    # Global norm of (2, -12) = sqrt(148).
    assert clip_grad_norm([x, y], 0.0) == pytest.approx(math.sqrt(148))
    assert (x.grad.item(), y.grad.item()) == (2.0, -12.0)  # 0 disables clipping
    assert clip_grad_norm([x, y], 1.0) == pytest.approx(math.sqrt(148))
    assert math.hypot(x.grad.item(), y.grad.item()) == pytest.approx(1.0, abs=1e-5)
    assert clip_grad_norm([torch.nn.Parameter(torch.zeros(1))], 1.0) == 0.0  # no grads yet


def make_run(config, max_steps, lr=1.0):
    model = torch.nn.Linear(2, 1)
    opt = build_optimizer(model.parameters(), SGDConfig(lr=lr))
    return model, opt, build_scheduler(opt, config, max_steps)


def step(model, opt, sched):
    lr = opt.param_groups[0]["lr"]
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    opt.zero_grad()
    sched.step()
    return lr


def test_scheduler_reproduces_lr_at():
    config = LinearSchedulerConfig(warmup_steps=2, decay_steps=3, min_lr=0.1)
    model, opt, sched = make_run(config, 10)
    used = [step(model, opt, sched) for _ in range(10)]
    assert used == pytest.approx(schedule(config, 1.0, 10, 10), abs=1e-12)
    assert sched.get_last_lr()[0] == pytest.approx(0.1)  # evaluated at step 10 (past the end) without error


def test_scheduler_resumes_from_state_dict():
    config = CosineSchedulerConfig(warmup_steps=3, min_lr=0.01)
    model, opt, sched = make_run(config, 12, lr=0.5)
    for _ in range(5):
        step(model, opt, sched)
    # Deep copies, as a checkpoint on disk would be: state_dict() shares the live momentum buffers.
    opt_state, sched_state = copy.deepcopy(opt.state_dict()), copy.deepcopy(sched.state_dict())
    model2 = torch.nn.Linear(2, 1)
    model2.load_state_dict(model.state_dict())
    opt2 = build_optimizer(model2.parameters(), SGDConfig(lr=0.5))
    sched2 = build_scheduler(opt2, config, 12)
    opt2.load_state_dict(opt_state)
    sched2.load_state_dict(sched_state)
    original = [step(model, opt, sched) for _ in range(7)]
    resumed = [step(model2, opt2, sched2) for _ in range(7)]
    assert resumed == original
    assert resumed == pytest.approx([lr_at(s, 0.5, config, 12) for s in range(5, 12)], abs=1e-12)
    assert torch.equal(model.weight, model2.weight)


def test_shared_fields_have_one_definition():
    # One warmup default for every schedule kind: none unless asked for (a config that wants warmup says so).
    schedulers = [ConstantSchedulerConfig, LinearSchedulerConfig, CosineSchedulerConfig]
    assert [cls().warmup_steps for cls in schedulers] == [0, 0, 0]
    fields = [cls.model_fields["warmup_steps"] for cls in schedulers]
    assert all(f.description == fields[0].description and f.metadata == fields[0].metadata for f in fields)
    # One gradient clipping setting, `optim.max_norm`, whichever the optimizer.
    for kind in ("adamw", "sgd"):
        config = TypeAdapter(OptimizerConfig).validate_python({"type": kind, "max_norm": 0.5})
        assert config.max_norm == 0.5 and type(config).model_fields["max_norm"].default == 1.0


@pytest.mark.parametrize(
    ("model", "optim", "needle"),
    [
        ({"cpu_offload": True}, {"type": "adamw"}, "--model.cpu-offload"),
        (
            {},
            {"type": "adamw", "cpu_offload": True},
            "--optim.cpu-offload keeps optimizer state off the GPU; it needs a CUDA device",
        ),
    ],
)
def test_offloading_needs_cuda(model, optim, needle):
    from prime_rl.trainer.config import TrainerConfig
    from prime_rl.trainer.model.build import SetupError, check_device

    config = TrainerConfig(model=model, optim=optim)
    with pytest.raises(SetupError, match=needle):
        check_device(config.model, config.optim, torch.device("cpu"))
    if optim.get("cpu_offload") and torch.cuda.is_available():  # both offloads at once: one is part of the other
        both = TrainerConfig(model={"cpu_offload": True}, optim=optim)
        with pytest.raises(SetupError, match="choose one"):
            check_device(both.model, both.optim, torch.device("cuda"))


def test_optimizer_state_moves_shard_by_shard_and_leaves_step_counts():
    """On this CPU machine the move is to the same device (a no-op); the CUDA round trip is the gpu test's. What can
    be checked here: which tensors move (moments, not the 0-d step counts) and that values survive."""
    from prime_rl.trainer.optim import move_optimizer_state

    param = torch.nn.Parameter(torch.randn(4, 3))
    optimizer = torch.optim.AdamW([param], lr=0.1)
    param.grad = torch.ones_like(param)
    optimizer.step()
    before = {k: v.clone() for k, v in optimizer.state[param].items()}
    move_optimizer_state(optimizer, torch.device("cpu"))
    state = optimizer.state[param]
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"} and state["step"].dim() == 0
    for key, value in before.items():
        assert torch.equal(state[key], value), key


def test_adamw_on_cpu_runs_fused_and_matches_the_per_tensor_loop():
    """On CPU `build_optimizer` picks the fused AdamW kernel (torch's default there is a Python loop, ~8x slower at
    135M parameters). Same update, other operation order: after 3 steps with weight decay the parameters agree within
    2 float32 ulps of the largest one (|p| ~ 4: ulp 4.8e-7; measured 3e-8); a wrong hyperparameter or a skipped step
    would differ by ~lr = 1e-2."""
    torch.manual_seed(0)
    start = [torch.randn(64, 32), torch.randn(32)]
    grads = [[torch.randn_like(p) for p in start] for _ in range(3)]
    config = AdamWConfig(lr=1e-2, weight_decay=0.1, betas=(0.8, 0.95))
    fused = [torch.nn.Parameter(p.clone()) for p in start]
    loop = [torch.nn.Parameter(p.clone()) for p in start]
    ours = build_optimizer(fused, config)
    reference = torch.optim.AdamW(loop, lr=1e-2, weight_decay=0.1, betas=(0.8, 0.95), foreach=False)
    assert ours.defaults["fused"] is True
    for step in grads:
        for opt, params in ((ours, fused), (reference, loop)):
            for p, g in zip(params, step, strict=True):
                p.grad = g.clone()
            opt.step()
    for a, b, s in zip(fused, loop, start, strict=True):
        assert (a - s).abs().max() > 1e-2  # it moved
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
