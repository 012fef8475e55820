"""A server that outlives runs (`inference --server.attachable`, the session's shared server): `eval --attach` and
`rl --attach` reset it to the base weights (a greedy completion's log-probs are a fresh server's again), train and
evaluate on it, refuse it when it serves another model, and leave it running, after Ctrl-C too, with nothing else
behind; a run that starts its own server stops it on Ctrl-C."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import greedy, make_adapter
from rl_run import run_metrics, started_pid, write_rl_config

from prime_rl.inference.attach import card_path, hold, read_card
from prime_rl.utils.net import free_port

BIN = Path(sys.executable).parent
REVERSE_TEXT = '[[orchestrator.env]]\nid = "reverse-text"\n'


def attach_config(path: Path, srv, out: Path, steps: int, model: Path | None = None, envs: str = REVERSE_TEXT) -> Path:
    """The tests' rl config, with `[inference]` naming the shared server (its port, context length) to attach to."""
    inference = f"[inference.server]\nport = {srv.port}\n[inference.model]\nmax_model_len = 512\n"
    return write_rl_config(path, model or srv.base, out, 0, steps, top=inference, bottom=envs)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_gone(pids: list[int], timeout: float = 30) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if alive(p)]


def interrupt_after_step_1(proc: subprocess.Popen, out: Path, log: Path, names: tuple[str, ...]) -> list[int]:
    """Ctrl-C to `rl` once its trainer finished step 1: it must exit 130; returns the pids of `names` (the processes
    it started) still alive 30 s later."""
    pids = [started_pid(out / "logs" / "rl.log", name) for name in names]
    deadline = time.monotonic() + 600
    while not run_metrics(out, "trainer") and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert run_metrics(out, "trainer"), log.read_text()[-3000:]
    proc.send_signal(signal.SIGINT)
    assert proc.wait(120) == 130, log.read_text()[-3000:]
    return wait_gone(pids)


def admin(srv, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{srv.url}/{route}", json=body, headers=srv.headers, timeout=120)


def rl(*args: str, log: Path) -> subprocess.Popen:
    """`rl` as a user starts it: no run secret, no key in its environment (attaching, it takes the card's)."""
    env = {k: v for k, v in os.environ.items() if k != "PRIME_RL_SECRET"}
    return subprocess.Popen([str(BIN / "rl"), *args], stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)


@pytest.mark.slow
def test_eval_and_rl_attach_reset_train_and_leave_the_server_running(tied_server, tmp_path):
    srv = tied_server
    card = read_card("127.0.0.1", srv.port)
    assert card.pid == srv.proc.pid and card.model == str(srv.base) and card.weight_broadcast["type"] == "gloo"
    assert oct(card_path("127.0.0.1", srv.port).stat().st_mode & 0o777) == "0o600"

    # Leave the server as an earlier run might: other weights and an adapter loaded.
    assert admin(srv, "update_weights", {"weight_dir": str(srv.step_1), "version": "step-1"}).status_code == 200
    adapter, _ = make_adapter(srv.base, srv.root / "adapters" / "left-behind", seed=5)
    loaded = admin(srv, "load_lora_adapter", {"lora_name": "left-behind", "lora_path": str(adapter)})
    assert loaded.status_code == 200, loaded.text
    assert greedy(srv)["logprobs"] != srv.fresh_greedy["logprobs"]

    # eval attaches: reset to the base weights, evaluated, still running after; its answers are a fresh server's.
    (tmp_path / "eval.toml").write_text(
        f'output_dir = "{tmp_path / "eval"}"\nseq_len = 512\n[model]\nname = "{srv.base}"\n'
        'renderer = { name = "qwen3", enable_thinking = false }\n'
        f"[inference.server]\nport = {srv.port}\n[inference.model]\nmax_model_len = 512\n"
        '[sampling]\nmax_tokens = 8\n[[env]]\nid = "reverse-text"\nargs = { num_tasks = 4 }\n'
    )
    done = subprocess.run([str(BIN / "eval"), "@", str(tmp_path / "eval.toml"), "--attach"], capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    said = (tmp_path / "eval" / "logs" / "eval.log").read_text()
    assert "it served policy step-1, adapters left-behind, now the base" in said
    assert httpx.get(f"{srv.url}/weights", headers=srv.headers, timeout=30).json()["adapters"] == {}
    assert (tmp_path / "eval" / "summary.json").exists()
    assert greedy(srv) == srv.fresh_greedy  # bit-exact tokens and log-probs: reset to what the server started with

    # rl attaches: two steps trained in memory with the server's own keys; the server serves the policy batch 2
    # was sampled on (k = 0: step 1's).
    out = srv.root / "rl" / "attached"
    proc = rl("@", str(attach_config(tmp_path / "rl.toml", srv, out, 2)), "--attach", log=tmp_path / "rl.out")
    assert proc.wait(600) == 0, (tmp_path / "rl.out").read_text()[-3000:]
    assert [m["step"] for m in run_metrics(out, "trainer")] == [1, 2]
    assert "attached to the inference server" in (out / "logs" / "rl.log").read_text()
    state = httpx.get(f"{srv.url}/weights", headers=srv.headers, timeout=30).json()
    assert alive(srv.proc.pid) and state["version"] == "step_1"

    # Another model: refused before anything changes (exit 2, one line naming both models).
    other = tmp_path / "other-model"
    other.mkdir()
    (other / "config.json").write_text("{}")
    refused = rl("@", str(attach_config(tmp_path / "rl2.toml", srv, out / "x", 2, model=other)), "--attach",
                 log=tmp_path / "refused.out")  # fmt: skip
    assert refused.wait(120) == 2
    message = (tmp_path / "refused.out").read_text()
    assert f"the server serves '{srv.base}', this run's model is '{other}'" in message, message
    # opsd prefills on the policy's server, which vLLM crashes when it serves LoRA, as this one does: refused too.
    opsd = REVERSE_TEXT + 'algo = { type = "opsd", demo_key = "answer" }\n'
    refused = rl("@", str(attach_config(tmp_path / "rl4.toml", srv, out / "y", 2, envs=opsd)), "--attach",
                 log=tmp_path / "opsd.out")  # fmt: skip
    assert refused.wait(120) == 2
    assert "run opsd, whose scoring prefills on the policy's server" in (tmp_path / "opsd.out").read_text()
    assert httpx.get(f"{srv.url}/weights", headers=srv.headers, timeout=30).json()["version"] == "step_1"

    # Ctrl-C: rl, its orchestrator and trainer go; the server stays, and the next run may attach at once.
    out = srv.root / "rl" / "attached-interrupted"
    log = tmp_path / "interrupted.out"
    proc = rl("@", str(attach_config(tmp_path / "rl3.toml", srv, out, 500)), "--attach", log=log)
    assert interrupt_after_step_1(proc, out, log, ("orchestrator", "trainer")) == []
    assert alive(srv.proc.pid) and httpx.get(f"{srv.url}/health", timeout=10).status_code == 200
    hold(read_card("127.0.0.1", srv.port), "127.0.0.1", srv.port).close()  # the attachment was let go
    assert admin(srv, "reload_weights", {}).status_code == 200  # the next test finds the base weights


@pytest.mark.slow
def test_a_run_stops_the_server_it_started_on_ctrl_c(tied_server, tmp_path):
    """Without --attach, rl's own server is part of the run: Ctrl-C stops it with the rest, its port is free after.
    The run trains reverse-text under opsd (demonstration: the task's `answer`), which needs a policy server without
    LoRA (vLLM's prompt log-probs crash a LoRA-enabled one, as the shared server is): at step 1 the trainer's policy is
    the one that sampled and scored, so its reverse KL over the opsd tokens equals the orchestrator's within 1e-3."""
    srv = tied_server
    port = free_port()
    out = tmp_path / "run"
    inference = f"[inference.server]\nport = {port}\n[inference.model]\nmax_model_len = 512\nenforce_eager = true\n"
    envs = REVERSE_TEXT + 'algo = { type = "opsd", demo_key = "answer" }\n'
    config = write_rl_config(tmp_path / "rl.toml", srv.base, out, 0, 500, top=inference, bottom=envs)
    log = tmp_path / "rl.out"
    proc = rl("@", str(config), log=log)
    assert interrupt_after_step_1(proc, out, log, ("inference", "orchestrator", "trainer")) == []
    orch, trained = run_metrics(out, "orchestrator")[0], run_metrics(out, "trainer")[0]
    assert trained["ref_kl_tokens"] > 0 and orch["time/self_distill"] > 0 and trained["mismatch_kl"] < 1e-6
    assert abs(orch["teacher_kl/sampler"]) < float("inf")  # finite, NaN fails too (the hint's effect: its own test)
    assert trained["ref_kl_stream"] == pytest.approx(orch["teacher_kl/sampler"], abs=1e-3)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
