"""One run over five simulated hosts: 2 inference servers, 1 orchestrator, a trainer over 2 nodes; new weights go
from trainer node 0 to both servers by the in-memory broadcast (gloo), across the simulated network.

Every host is an `rl` process with the same config and its own `deployment.roles`, sharing one output directory
as hosts share a filesystem, on an address of its own: a network namespace per host joined by veth pairs to a
bridge where the machine allows it, else 127.0.0.2, .3, ... (chosen at run time; the test prints which ran). The
API key is on. One inference server's vLLM is killed mid-run: its host's rl exits naming it, the run goes on with
the other server (requests it lost are sampled again), and the restarted host is given the current policy before
it gets work. Every batch is trained once, and no batch uses a policy older than k. (A step takes about a second here and
vLLM a minute or two to restart, so the run is stopped once the server is back and three more steps are trained,
rather than waiting for a fixed max_steps.) Last, the other inference host's rl is killed alone, as when a machine
dies: its vLLM must die with it.
"""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
from conftest import requests_running
from rl_run import run_metrics, started_pid, write_rl_config

from prime_rl.models.tiny import TinyModelConfig, build_tiny_model
from prime_rl.utils.net import free_port
from prime_rl.utils.processes import die_with_parent
from prime_rl.utils.secret import SECRET_VAR

RL = str(Path(sys.executable).parent / "rl")
STEPS, K = 500, 1  # a bound: the test stops the run once the restarted server has rejoined and served
NAMES = ["inference-a", "inference-b", "orchestrator", "node0", "node1"]
KEY = "multi-host-key"


def write_config(path: Path, model: Path, out: Path, port: int, broadcast_port: int, node0: str) -> Path:
    top = "inference_timeout = 600\n[inference.model]\nmax_model_len = 512\nenforce_eager = true\n"
    top += f"[inference.server]\nport = {port}\n"
    # Every host knows trainer node 0 (as the SLURM template and the chart say it): the in-memory broadcast's store is
    # there (weight_broadcast.host defaults to deployment.master_addr on several hosts).
    top += f'[deployment]\nmaster_addr = "{node0}"\n[weight_broadcast]\ntype = "gloo"\nport = {broadcast_port}\n'
    return write_rl_config(path, model, out, K, STEPS, top=top, bottom='[[orchestrator.env]]\nid = "reverse-text"\n')


class Network:
    """Addresses for the simulated hosts. Network namespaces joined by veth pairs to a bridge where the machine
    allows it (root with CAP_NET_ADMIN, and the bridge forwards), else distinct loopback addresses: Linux routes
    all of 127/8 to `lo`. `kind` says which; `prefix(host)` runs a command on that host."""

    SUBNET = "10.231.{}.{}"

    def __init__(self, names: list[str]):
        self.names, self.kind, self.addr, self.links = names, "loopback", {}, []
        tag = f"{os.getpid() % 250}"
        self.bridge, self.namespaces = f"prl{tag}br", {n: f"prl{tag}-{n}" for n in names}
        try:
            self._build(tag)
            self.kind = "netns"
        except (subprocess.CalledProcessError, OSError, AssertionError) as e:
            self.teardown()
            self.reason = str(e)[:200]
            self.addr = {n: f"127.0.0.{i + 2}" for i, n in enumerate(names)}

    def _ip(self, *args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)

    def _build(self, tag: str) -> None:
        subnet = int(tag)
        self._ip("link", "add", self.bridge, "type", "bridge")
        self.links.append(self.bridge)
        self._ip("addr", "add", self.SUBNET.format(subnet, 1) + "/24", "dev", self.bridge)
        self._ip("link", "set", self.bridge, "up")
        for i, name in enumerate(self.names):
            ns, outer = self.namespaces[name], f"prl{tag}v{i}"
            self._ip("netns", "add", ns)
            self._ip("link", "add", outer, "type", "veth", "peer", "name", "eth0", "netns", ns)
            self.links.append(outer)
            self._ip("link", "set", outer, "master", self.bridge, "up")
            self.addr[name] = self.SUBNET.format(subnet, 10 + i)
            for args in (
                ("addr", "add", self.addr[name] + "/24", "dev", "eth0"),
                ("link", "set", "eth0", "up"),
                ("link", "set", "lo", "up"),
            ):
                self._ip("netns", "exec", ns, "ip", *args)
        # The bridge must actually forward (a firewall may drop bridged traffic): one namespace reaches another.
        first, second = self.names[0], self.names[1]
        probe = subprocess.run(
            [
                *self.prefix(first),
                "python3",
                "-c",
                f"import socket; socket.create_connection(('{self.addr[second]}', 9), 2)",
            ],
            capture_output=True,
            text=True,
            timeout=10,
        )
        assert "refused" in probe.stderr.lower(), f"no route between namespaces: {probe.stderr[-200:]}"

    def prefix(self, name: str) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[name]] if self.kind == "netns" else []

    def teardown(self) -> None:
        for ns in self.namespaces.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
        for link in self.links:
            subprocess.run(["ip", "link", "del", link], capture_output=True, timeout=10)


class Host:
    """One simulated host: `rl` with some roles, its console in `<name>.console`."""

    def __init__(self, name: str, config: Path, flags: list[str], env: dict[str, str], prefix: list[str]):
        self.name, self.config, self.flags, self.env, self.prefix = name, config, flags, env, prefix
        self.console = config.parent / f"{name}.console"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [*self.prefix, RL, "@", str(self.config), *self.flags],
            stdout=open(self.console, "a"),
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,
            preexec_fn=die_with_parent,  # if pytest itself is killed, every simulated host goes with it
        )

    def kill(self) -> None:
        """SIGKILL to `rl` alone, as when a machine dies: what it started must die with it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


def wait_until(condition, timeout: float, what: str, hosts: list[Host]) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        for host in hosts:
            if host.proc is not None and host.proc.poll() not in (None, 0):
                pytest.fail(f"{host.name} exited {host.proc.returncode} while waiting for {what}:\n" + tail(host))
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {timeout:.0f}s:\n" + "\n".join(tail(h) for h in hosts))
        time.sleep(1)


def tail(host: Host, chars: int = 3000) -> str:
    text = host.console.read_text(errors="replace") if host.console.exists() else ""
    return f"--- {host.name} ---\n{text[-chars:]}"


@pytest.mark.slow
def test_rl_over_five_hosts_survives_losing_an_inference_server(tmp_path, capsys):
    network = Network(NAMES)
    try:
        with capsys.disabled():
            why = "" if network.kind == "netns" else f" (network namespaces unavailable: {network.reason})"
            print(f"\nsimulated hosts: {network.kind}{why}: {network.addr}")
        run_five_hosts(tmp_path, network)
    finally:
        network.teardown()


def run_five_hosts(tmp_path: Path, network: Network) -> None:
    addr = network.addr
    model = build_tiny_model(TinyModelConfig(output=tmp_path / "model", tie_word_embeddings=True))
    out = tmp_path / "shared" / "run"
    port, master_port = free_port(), free_port()
    config = write_config(tmp_path / "rl.toml", model, out, port, free_port(), addr["node0"])
    ifname = "eth0" if network.kind == "netns" else "lo"
    # The same run secret on every host (the SLURM script and the chart provide it): the trainer's store refuses
    # anyone without it.
    base = {
        **os.environ,
        "INFERENCE_SERVER_API_KEY": KEY,
        "GLOO_SOCKET_IFNAME": ifname,
        SECRET_VAR: "7f" * 32,
    }
    trainer = ["--deployment.roles", "[trainer]", "--deployment.trainer-nodes", "2", "--deployment.run-id", "t1"]
    trainer += ["--deployment.master-port", str(master_port)]

    def host(name: str, flags: list[str], env: dict[str, str]) -> Host:
        return Host(name, config, flags, env, network.prefix(name))

    def inference(name: str, core: int) -> Host:
        flags = ["--deployment.roles", "[inference]", "--inference.server.host", addr[name]]
        flags += ["--inference.log.level", "debug"]  # logs every request: the order of swap and work, below
        return host(name, flags, {**base, "VLLM_CPU_OMP_THREADS_BIND": str(core)})

    server_a, server_b = inference("inference-a", 0), inference("inference-b", 1)
    servers = f"{addr['inference-a']},{addr['inference-b']}"
    orchestrator_flags = ["--deployment.roles", "[orchestrator]", "--deployment.run-id", "t1"]
    orchestrator = host("orchestrator", orchestrator_flags, {**base, "INFERENCE_SERVER_IP": servers})
    nodes = [host(f"node{r}", [*trainer, "--deployment.trainer-node-rank", str(r)], base) for r in (0, 1)]
    hosts = [server_a, server_b, orchestrator, *nodes]
    b_log = out / "logs" / f"inference.{addr['inference-b']}-{port}.log"
    try:
        for host in [*nodes, server_a, server_b, orchestrator]:  # trainer nodes first: they wait for the run
            host.start()
        wait_until(lambda: len(run_metrics(out, "trainer")) >= 2, 900, "trainer step 2", hosts)

        # inference-b's vLLM dies while serving, as under the OOM killer: its rl exits within 30 s naming it and
        # leaves nothing behind. (The kill waits for requests running on b; they may still finish first.)
        b_tree = [psutil.Process(server_b.proc.pid), *psutil.Process(server_b.proc.pid).children(recursive=True)]
        b_url = f"http://{addr['inference-b']}:{port}"
        wait_until(lambda: requests_running(b_url, KEY) > 0, 120, "requests in flight on inference-b", hosts)
        psutil.Process(started_pid(server_b.console, "inference")).kill()
        killed_at = time.monotonic()
        code = server_b.proc.wait(60)
        elapsed = time.monotonic() - killed_at
        assert code != 0 and elapsed < 30, (code, elapsed, tail(server_b))
        assert re.search(r"inference failed with exit code", server_b.console.read_text()), tail(server_b)
        time.sleep(1)
        alive = [p for p in b_tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not alive, [(p.pid, p.cmdline()) for p in alive]
        before = b_log.stat().st_size
        steps_without_b = len(run_metrics(out, "trainer"))
        server_b.start()
        back = f"inference server {b_url}/v1 back, serving policy step"  # (inference-a may recover too: see below)
        wait_until(lambda: back in orchestrator_log(out), 600, "inference-b back in rotation", hosts)
        back_at = len(run_metrics(out, "trainer"))
        wait_until(lambda: len(run_metrics(out, "trainer")) >= back_at + 3, 300, "3 steps with both servers", hosts)
        server_a.kill()
        assert wait_gone(f"http://{addr['inference-a']}:{port}"), "inference-a's vLLM outlived its rl"
    finally:
        for host in hosts:
            host.stop()

    assert back_at > steps_without_b, "the run did not go on while inference-b was down"
    # How the orchestrator saw b die depends on what it was doing at that instant (requests are ~0.1 s long): a
    # generation request failed (its group must be sampled again), or the next weight swap failed (nothing lost).
    # A broadcast that b's death broke fails on inference-a too, which then rejoins at once in a new group.
    seen = re.search(
        rf"server http://{re.escape(addr['inference-b'])}:\d+/v1 failing \((.*)\); pausing", orchestrator_log(out)
    )
    assert seen, orchestrator_log(out)[-3000:]
    if "weight swap" not in seen.group(1):
        assert sum(m["retries"] for m in run_metrics(out, "orchestrator")) > 0, seen.group(1)
    trained = run_metrics(out, "trainer")
    assert [m["step"] for m in trained] == list(range(1, len(trained) + 1))  # every batch once, in order
    for m in trained:
        assert m["policy_version/min"] >= m["step"] - 1 - K and m["policy_version/max"] <= m["step"] - 1, m
    # The restarted server was given the current policy (by broadcast, in a new group) before it generated anything.
    after = b_log.read_bytes()[before:].decode(errors="replace")
    requests = re.findall(r'"POST (/update_weights|/inference/v1/generate|/v1/chat/completions) HTTP', after)
    assert requests and requests[0] == "/update_weights", requests[:5]
    assert "joined weight-broadcast group" in after and "from a broadcast" in after, after[-3000:]
    assert "/inference/v1/generate" in requests or "/v1/chat/completions" in requests  # and then got work
    # Per-host files in the shared dir: one log per server, one console per trainer node.
    logs = {p.name for p in (out / "logs").iterdir()}
    assert {f"inference.{addr['inference-a']}-{port}.log", b_log.name, "orchestrator.log", "trainer.log"} <= logs


def orchestrator_log(out: Path) -> str:
    path = out / "logs" / "orchestrator.log"
    return path.read_text(errors="replace") if path.exists() else ""


def wait_gone(url: str, timeout: float = 60) -> bool:
    """The server's port stops answering."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            httpx.get(f"{url}/health", timeout=2)
        except httpx.TransportError:
            return True
        time.sleep(1)
    return False
