"""`rl` across hosts: which processes a host starts, how they find each other, the seed's variables."""

import json
import os
import threading
import time
from pathlib import Path

import pytest

from prime_rl.config.loader import load_config
from prime_rl.rl import RLConfig
from prime_rl.rl.config import API_KEY_VAR
from prime_rl.rl.deploy import host_tag, publish_run, seed_environment, wait_for_run
from prime_rl.rl.preflight import provide_keys
from prime_rl.rl.processes import build_processes, orchestrators, trainer_command
from prime_rl.utils.secret import SECRET_VAR

INFERENCE = '[inference]\n[inference.server]\nhost = "10.0.0.7"\nport = 8100\n'


def rl_config(tmp_path, *flags: str, toml: str = INFERENCE) -> RLConfig:
    path = tmp_path / "rl.toml"
    path.write_text(f'output_dir = "{tmp_path / "out"}"\n{toml}')
    config, _ = load_config(RLConfig, "rl", ["@", str(path), *flags])
    return config


def rl_error(tmp_path, capsys, *flags: str, toml: str = INFERENCE) -> str:
    with pytest.raises(SystemExit) as exit_:
        rl_config(tmp_path, *flags, toml=toml)
    assert exit_.value.code == 2
    return capsys.readouterr().err


def test_one_host_runs_torchrun_standalone_or_one_plain_rank(tmp_path):
    config = rl_config(tmp_path, "--trainer-gpu-ids", "[0, 1]")
    cmd = trainer_command(config, tmp_path / "t.toml")
    assert cmd[1:6] == ["-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone", "-m"]
    assert host_tag(config) == ""
    # One rank on one node: no rendezvous, so no torchrun agent; the rank builds its own one-process group.
    single = trainer_command(rl_config(tmp_path, "--trainer-gpu-ids", "[0]"), tmp_path / "t.toml")
    assert single[1:] == ["-u", "-m", "prime_rl.trainer.rl.train", "@", str(tmp_path / "t.toml")]


def test_a_trainer_node_joins_node_zeros_rendezvous(tmp_path):
    flags = ["--deployment.roles", "[trainer]", "--deployment.trainer-nodes", "3", "--deployment.trainer-node-rank"]
    config = rl_config(tmp_path, *flags, "2", "--deployment.master-addr", "10.0.0.1", "--deployment.run-id", "j7")
    cmd = trainer_command(config, tmp_path / "t.toml")
    assert cmd[3:8] == [
        "--nproc-per-node=1",
        "--nnodes=3",
        "--node-rank=2",
        "--master-addr=10.0.0.1",
        "--master-port=29500",
    ]
    assert cmd[-4:] == ["-m", "prime_rl.trainer.rl.train", "@", str(tmp_path / "t.toml")]
    assert host_tag(config).endswith("-node2")


def test_an_inference_host_names_its_files_by_address_and_port(tmp_path):
    config = rl_config(tmp_path, "--deployment.roles", "[inference]")
    assert host_tag(config) == ".10.0.0.7-8100"


def test_the_orchestrator_finds_servers_started_elsewhere(tmp_path, capsys, monkeypatch):
    err = rl_error(tmp_path, capsys, "--deployment.roles", "[orchestrator]")
    assert "name the servers in deployment.inference_hosts (or INFERENCE_SERVER_IP)" in err

    env = {"INFERENCE_SERVER_IP": "10.0.0.2, 10.0.0.3:9000", "INFERENCE_SERVER_API_KEY": "k-123"}
    for key, value in seed_environment_of(env | {"OUTPUT_DIR": "/shared/run"}).items():
        monkeypatch.setenv(key, value)
    path = tmp_path / "rl.toml"
    path.write_text(INFERENCE)  # no output_dir in the file: OUTPUT_DIR sets it
    config, _ = load_config(RLConfig, "rl", ["@", str(path), "--deployment.roles", "[orchestrator]"])
    assert str(config.output_dir) == "/shared/run" == str(config.orchestrator.output_dir)
    assert config.orchestrator.client.base_url == ["http://10.0.0.2:8100/v1", "http://10.0.0.3:9000/v1"]
    assert config.inference.server.api_key.get_secret_value() == "k-123" == config.api_key()
    assert config.orchestrator.client.api_key_var == API_KEY_VAR


def seed_environment_of(env: dict[str, str]) -> dict[str, str]:
    seed_environment(env)
    return env


def test_seed_variables_do_not_override_our_own():
    env = {"OUTPUT_DIR": "/a", "PRIME_OUTPUT_DIR": "/b", "INFERENCE_SERVER_IP": "h"}
    seed_environment(env)
    assert env["PRIME_OUTPUT_DIR"] == "/b" and env["PRIME_DEPLOYMENT__INFERENCE_HOSTS"] == '["h"]'


def test_bad_deployments_are_refused_naming_the_field(tmp_path, capsys):
    assert "trainer_node_rank 2 >= trainer_nodes 2" in rl_error(
        tmp_path, capsys, "--deployment.trainer-nodes", "2", "--deployment.trainer-node-rank", "2"
    )
    assert "needs deployment.run_id" in rl_error(tmp_path, capsys, "--deployment.roles", "[trainer]")
    assert "roles is empty" in rl_error(tmp_path, capsys, "--deployment.roles", "[]")
    assert "deployment.roles" in rl_error(tmp_path, capsys, "--deployment.roles", "[learner]")


def test_a_trainer_host_waits_for_its_run_and_gives_up_naming_it(tmp_path, capsys):
    flags = ["--deployment.roles", "[trainer]", "--deployment.run-id", "job-2", "--deployment.start-timeout", "3"]
    config = rl_config(tmp_path, *flags)
    config.output_dir.mkdir(parents=True)
    (config.output_dir / "run.json").write_text(json.dumps({"run_id": "job-1"}))  # an earlier launch's
    started = time.monotonic()
    with pytest.raises(SystemExit) as exit_:
        wait_for_run(config)
    assert exit_.value.code == 2 and time.monotonic() - started >= 3
    assert "no orchestrator prepared run 'job-2'" in capsys.readouterr().err

    orchestrator_host = rl_config(
        tmp_path,
        "--deployment.roles",
        "[orchestrator]",
        "--deployment.run-id",
        "job-2",
        "--deployment.inference-hosts",
        "10.0.0.7",
    )
    threading.Timer(1.0, publish_run, args=(orchestrator_host, None)).start()
    started = time.monotonic()
    wait_for_run(config)  # returns once the marker names job-2
    assert 0.9 < time.monotonic() - started < 3


def test_a_started_server_gets_its_key_on_stdin_not_as_a_masked_file_value(tmp_path, monkeypatch):
    """The launch config of `inference` is written with secrets masked; a masked key in the file would beat the
    environment and the server would require the literal mask (every orchestrator request then gets 401). The key
    reaches the server and the orchestrator as their HTTP token on stdin, in no environment."""
    from prime_rl.rl.processes import build_processes, orchestrators

    monkeypatch.setenv("PRIME_DEPLOYMENT__INFERENCE_API_KEY", "k-9")
    config = rl_config(tmp_path)
    processes = build_processes(config, orchestrators(config), tmp_path / "logs", "", provide_keys(config))
    inference_toml = Path(processes["inference"].cmd[2]).read_text()
    assert "api_key" not in inference_toml and "*****" not in inference_toml
    assert processes["inference"].keys.http == processes["orchestrator"].keys.http == "k-9"
    assert processes["trainer"].keys.http is None  # it calls no server
    assert not any("k-9" in p.env.values() for p in processes.values())


def test_every_process_prints_its_python_stacks_on_a_fatal_signal_unless_told_otherwise(tmp_path, monkeypatch):
    """`rl` gives its processes `PYTHONFAULTHANDLER=1`, so a segfault in a C extension (a trainer rank in CI, once)
    leaves every thread's Python stack in the process's log; a value of the user's own is passed on unchanged."""
    from prime_rl.rl.processes import build_processes, orchestrators

    monkeypatch.delenv("PYTHONFAULTHANDLER", raising=False)
    config = rl_config(tmp_path)
    processes = build_processes(config, orchestrators(config), tmp_path / "logs", "")
    assert sorted(processes) == ["inference", "orchestrator", "trainer"]
    assert {p.env["PYTHONFAULTHANDLER"] for p in processes.values()} == {"1"}
    monkeypatch.setenv("PYTHONFAULTHANDLER", "")
    processes = build_processes(config, orchestrators(config), tmp_path / "logs", "")
    assert {p.env["PYTHONFAULTHANDLER"] for p in processes.values()} == {""}


def test_rollout_workers_close_before_they_started(tmp_path):
    """A run failing before its workers were needed (a server refusing the first weights) reports that failure,
    not `can only join a started process` from closing workers that never started."""
    import asyncio

    from prime_rl.orchestrator.config import OrchestratorConfig
    from prime_rl.orchestrator.worker import RolloutWorkers

    workers = RolloutWorkers(OrchestratorConfig(output_dir=tmp_path), tmp_path, "info")
    asyncio.run(workers.close(grace=0.1))


def test_the_rollout_workers_socket_takes_nothing_from_a_local_stranger(tmp_path):
    """The orchestrator's socket to its workers listens on loopback, which the code a model writes reaches too: a
    finished group of a stranger's making would be trained on, a stranger's `Failed` would end the run, a message
    that does not parse crashed it. Only a connection whose first message carries the orchestrator's channel token
    (its workers get it at spawn) is heard; here two DEALERs stand in for a stranger and a worker, on the real socket."""
    import asyncio

    import msgspec
    import zmq
    import zmq.asyncio

    from prime_rl.orchestrator.config import OrchestratorConfig
    from prime_rl.orchestrator.messages import Failed, GroupDone, Ready, RolloutResult
    from prime_rl.orchestrator.worker import RolloutWorkers

    workers = RolloutWorkers(OrchestratorConfig(output_dir=tmp_path, workers=1), tmp_path, "info")
    address = workers.processes[0]._args[2]
    encode = msgspec.msgpack.Encoder().encode
    dropped: list[str] = []
    drop = workers._stranger
    workers._stranger = lambda what: dropped.append(what) or drop(what)

    async def scenario() -> None:
        context = zmq.asyncio.Context()
        stranger, worker = context.socket(zmq.DEALER), context.socket(zmq.DEALER)
        for sock in (stranger, worker):
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
        try:
            # Each batch of the stranger's is read to the end before the worker speaks: the socket takes turns
            # between connections, so a queued stranger's message could otherwise come after the worker's.
            for message in (b"\x00not msgpack", encode(Failed(worker=0, message="stop", proof=b"")),
                            encode(Ready(worker=0, proof=bytes(32)))):  # fmt: skip
                await stranger.send(message)
            assert [await workers.receive(5) for _ in range(3)] == [None, None, None]  # the Failed ended nothing
            assert len(dropped) == 3
            await worker.send(encode(Ready(worker=0, proof=workers.proof)))
            await workers.ready(timeout=10)
            assert list(workers.identities) == [0] and len(workers.workers) == 1
            workers.owner[7], workers.pending[0] = 0, 1  # group 7 is in flight on worker 0
            await stranger.send(encode(GroupDone(id=7, rollouts=[RolloutResult(reward=1.0, samples=[])])))
            await stranger.send(encode(Ready(worker=0, proof=workers.proof)))  # a stolen token: the seat is taken
            await stranger.send(encode(GroupDone(id=7, rollouts=[RolloutResult(reward=1.0, samples=[])])))
            assert [await workers.receive(5) for _ in range(3)] == [None, None, None]
            assert len(dropped) == 6
            assert workers.owner == {7: 0} and list(workers.workers.values()) == [0]
            await worker.send(encode(GroupDone(id=7, rollouts=[RolloutResult(reward=0.25, samples=[])])))
            done = await workers.receive(5)
            assert done.rollouts[0].reward == 0.25 and workers.pending[0] == 0 and workers.owner == {}
        finally:
            stranger.close()
            worker.close()
            context.term()
            await workers.close(grace=0.1)

    asyncio.run(scenario())


def test_a_request_refused_while_the_in_process_worker_closes_logs_no_warning_and_one_after_does(tmp_path, caplog):
    """A group cancelled at the end of a run ends its rollouts' sessions while a request their harness already sent is
    still on its way: the interception server refuses it and would warn once per rollout (8 warnings at the end of
    most k = 1 demo runs). While the worker closes that warning is dropped; before and after, it is logged."""
    import asyncio
    import logging

    from prime_rl.orchestrator.config import OrchestratorConfig
    from prime_rl.orchestrator.worker import INTERCEPTION_LOGGER, InProcessWorker

    interception = logging.getLogger(INTERCEPTION_LOGGER)
    worker = InProcessWorker(OrchestratorConfig(output_dir=tmp_path, workers=0), "info")

    async def group_refused_as_it_is_cancelled():
        try:
            await asyncio.sleep(60)
        finally:
            interception.warning("interception: unauthorized request")  # the late request of a cancelled rollout

    async def run() -> asyncio.Task:
        group = asyncio.create_task(group_refused_as_it_is_cancelled())
        worker.running.add(group)
        await asyncio.sleep(0)  # the group runs
        await worker.close()
        return group

    with caplog.at_level(logging.WARNING, logger=INTERCEPTION_LOGGER):
        interception.warning("interception: unauthorized request")
        assert asyncio.run(run()).cancelled()
        interception.warning("interception: unauthorized request")
    refused = [r for r in caplog.records if r.name == INTERCEPTION_LOGGER]
    assert len(refused) == 2  # the one before and the one after close; the one during it was dropped


def test_the_weight_broadcast_is_one_config_for_trainer_and_orchestrator(tmp_path, capsys):
    # One host: `rl` picks a free port for the trainer's store, the same in both sections; the store is local.
    config = rl_config(tmp_path, "--weight-broadcast.type", "gloo")
    trainer, orch = config.trainer.weight_broadcast, config.orchestrator.weight_broadcast
    assert trainer == orch and trainer.type == "gloo" and trainer.host == "127.0.0.1" and trainer.port is not None
    assert config.inference.weight_broadcast == trainer  # the server takes the store's address from its own config
    # Several hosts: the store is on trainer node 0 (deployment.master_addr and master_port + 1) unless set.
    split = [
        "--deployment.roles",
        "[orchestrator]",
        "--deployment.inference-hosts",
        "10.0.0.7",
        "--deployment.run-id",
        "r1",
        "--deployment.master-addr",
        "10.0.0.9",
    ]
    config = rl_config(tmp_path, *split, "--weight-broadcast.type", "gloo", "--weight-broadcast.port", "29511")
    assert (config.orchestrator.weight_broadcast.host, config.orchestrator.weight_broadcast.port) == ("10.0.0.9", 29511)
    config = rl_config(tmp_path, *split, "--weight-broadcast.type", "gloo", "--deployment.master-port", "29600")
    assert config.orchestrator.weight_broadcast.port == 29601  # every host derives the same port
    # A section that disagrees with the shared value is a contradiction, named.
    err = rl_error(tmp_path, capsys, "--weight-broadcast.type", "gloo", "--trainer.weight-broadcast.type", "nccl")
    assert "weight_broadcast.type = 'gloo' contradicts trainer.weight_broadcast.type = 'nccl'" in err
    err = rl_error(tmp_path, capsys, "--trainer.weight-broadcast.type", "gloo")  # set in one section only
    assert "trainer.weight_broadcast and orchestrator.weight_broadcast disagree" in err


def test_every_process_gets_only_the_keys_it_needs_on_stdin(tmp_path, monkeypatch, capsys):
    """One host: `rl` makes a secret and derives the run's keys; each process gets what it needs on stdin, none by
    environment, file or command line: the trainer the store key, the orchestrator and the server the store key and
    the HTTP token (what the servers take when they have no API key). Several hosts: the secret must be given, and
    a weak one is refused with the format named (issue 52, finding 5)."""
    from prime_rl.utils.secret import derive_keys, forget_keys

    monkeypatch.delenv(SECRET_VAR, raising=False)
    config = rl_config(tmp_path, "--weight-broadcast.type", "gloo")
    keys = provide_keys(config)
    assert len(keys.store) == 32 and len(keys.http) == 64 and keys.http != keys.store.hex()
    assert SECRET_VAR not in os.environ and config.orchestrator.client.api_key_var == API_KEY_VAR
    processes = build_processes(config, {"orchestrator": config.orchestrator}, tmp_path / "logs", "", keys)
    assert {role: (p.keys.store, p.keys.http) for role, p in processes.items()} == {
        "inference": (keys.store, keys.http),
        "orchestrator": (keys.store, keys.http),
        "trainer": (keys.store, None),
    }
    values = [keys.store.hex(), keys.http]
    written = [p.read_text() for p in (config.output_dir / "configs").rglob("*.toml")]
    assert written and not any(v in text for v in values for text in written)
    assert not any(v in " ".join(p.cmd) or v in str(p.env) for v in values for p in processes.values())
    filesystem = rl_config(tmp_path)  # weights through the file system: nobody needs the store key
    processes = build_processes(filesystem, orchestrators(filesystem), tmp_path / "logs", "", keys)
    assert {p.keys.store for p in processes.values()} == {None}
    # With an API key the orchestrator sends the key; the servers take the key as their token.
    keyed = rl_config(tmp_path, "--inference.server.api-key", "k")
    assert keyed.orchestrator.client.api_key_var == API_KEY_VAR and provide_keys(keyed).http == "k"

    split = ["--deployment.roles", "[inference]"]
    with pytest.raises(SystemExit) as exit_:
        provide_keys(rl_config(tmp_path, *split))
    assert exit_.value.code == 2 and f"set {SECRET_VAR}" in capsys.readouterr().err
    for weak in ("short", "passwordpassword", "x" * 40, "0123456789abcdef" + "g" * 16, "ab" * 15):
        monkeypatch.setenv(SECRET_VAR, weak)
        forget_keys()
        with pytest.raises(SystemExit) as exit_:
            provide_keys(rl_config(tmp_path, *split))
        assert exit_.value.code == 2 and "hexadecimal, at least 32 digits (128 bits)" in capsys.readouterr().err
    given = "0f" * 16  # 128 bits: the least that is taken
    monkeypatch.setenv(SECRET_VAR, given)
    forget_keys()
    assert provide_keys(rl_config(tmp_path, *split)) == derive_keys(given)
    assert SECRET_VAR not in os.environ  # taken out of the environment once read
