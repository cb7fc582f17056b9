"""The container image and the Kubernetes manifests, checked offline.

Linters (pinned, installed into .venv-deploy by scripts/install_deploy_tools.sh): hadolint on the
Dockerfile, kubernetes-validate (strict, pinned Kubernetes version) and checkov on k8s/. Then
the rules that matter to specdec, over the parsed YAML: probes, ports, GPU, security contexts,
network policies, selectors, and settings that the services really accept.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from coordinator.settings import CoordinatorSettings
from coordinator.turn import cut_off_cleanup_s
from draft_worker.settings import DraftSettings
from specdec.serving.server import _CANCEL_WAIT_S, _STOP_GRACE_S, LIVENESS, READINESS, STARTUP
from specdec.serving.settings import ServiceSettings
from target_worker.settings import TargetSettings
from tests.forkserver import run_command

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "k8s"
TOOLS = ROOT / ".venv-deploy" / "bin"
KUBERNETES_VERSION = "1.33.0"  # the oldest release we support; grpc probes are GA since 1.27
WORKLOADS = ("Deployment", "StatefulSet")
SETTINGS: dict[str, type[ServiceSettings]] = {
    "coordinator": CoordinatorSettings,
    "draft": DraftSettings,
    "target": TargetSettings,
}


def _tool(name: str) -> str:
    path = TOOLS / name
    if not path.exists():
        pytest.fail(f"{path} is missing: run scripts/install_deploy_tools.sh (scripts/test.sh does)")
    return str(path)


def _docs() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return docs


DOCS = _docs()


def _kind(kind: str) -> list[dict[str, Any]]:
    return [doc for doc in DOCS if doc["kind"] == kind]


def _one(kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in _kind(kind) if d["metadata"]["name"] == name]
    return doc


def _workloads() -> list[dict[str, Any]]:
    return [doc for doc in DOCS if doc["kind"] in WORKLOADS]


def _specdec_containers() -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(role, container, pod spec) of every container that runs `specdec serve <role>`."""
    for workload in _workloads():
        pod = workload["spec"]["template"]["spec"]
        for container in pod["containers"]:
            if container.get("args", [])[:1] == ["serve"]:
                yield container["args"][1], container, pod


CONFIG = _one("ConfigMap", "specdec-config")["data"]


def _container_env(container: dict[str, Any]) -> dict[str, str]:
    """The environment the container gets from the ConfigMap and its own env list."""
    env = dict(CONFIG) if any(src["configMapRef"]["name"] == "specdec-config" for src in container["envFrom"]) else {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
        else:
            env[item["name"]] = CONFIG[item["valueFrom"]["configMapKeyRef"]["key"]]
    return env


# Linters


def test_hadolint_accepts_the_dockerfile() -> None:
    result = subprocess.run([_tool("hadolint"), str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_manifests_validate_strictly_against_the_pinned_kubernetes() -> None:
    cmd = [_tool("kubernetes-validate"), "--strict", "-k", KUBERNETES_VERSION, *map(str, sorted(K8S.glob("*.yaml")))]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("passed") == len(DOCS)


def test_checkov_passes_with_the_documented_skips() -> None:
    cmd = [_tool("checkov"), "-d", str(K8S), "--config-file", str(ROOT / ".checkov.yaml")]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:]
    assert re.search(r"Failed checks: 0\b", result.stdout), result.stdout[-4000:]


# Image entry points


@pytest.mark.parametrize("role", ["coordinator", "draft", "target"])
def test_the_image_entry_point_serves_every_role(role: str) -> None:
    # ENTRYPOINT ["specdec"] + the manifests' args ["serve", role]: the same console script.
    result = run_command(["serve", role, "--help"], 120)  # python -m specdec, forked (tests/forkserver.py)
    assert result.returncode == 0, result.stderr
    assert "--health-port" in result.stdout and "--tls-cert-file" in result.stdout


def test_dockerfile_is_multi_stage_non_root_and_pinned() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert len(re.findall(r"^FROM ", text, re.MULTILINE)) >= 2
    assert re.search(r"^ARG PYTHON_IMAGE=python:\d+\.\d+\.\d+-slim-\w+$", text, re.MULTILINE)
    assert re.search(r"^USER 10001:10001$", text, re.MULTILINE)
    assert "torch==${TORCH_VERSION}" in text and "TORCH_INDEX_URL" in text
    final = text.rsplit("FROM ", 1)[1]
    assert "pip install" not in final and "apt-get" not in final  # no build tools in the final stage


# Layout


def test_files_are_numbered_and_the_namespace_comes_first() -> None:
    names = [path.name for path in sorted(K8S.glob("*.yaml"))]
    assert all(re.match(r"^\d\d-[a-z-]+\.yaml$", name) for name in names), names
    first = next(yaml.safe_load_all((K8S / names[0]).read_text()))
    assert first["kind"] == "Namespace" and first["metadata"]["name"] == "specdec"
    assert first["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    assert all(doc["metadata"].get("namespace") == "specdec" for doc in DOCS if doc["kind"] != "Namespace")


def test_secret_templates_hold_no_secret_material() -> None:
    secrets = _kind("Secret")
    assert {s["metadata"]["name"] for s in secrets} == {"specdec-auth", "specdec-tls"}
    for secret in secrets:
        assert "data" not in secret and "stringData" not in secret


# Pods


@pytest.mark.parametrize("workload", _workloads(), ids=lambda w: w["metadata"]["name"])
def test_pods_are_restricted_and_bounded(workload: dict[str, Any]) -> None:
    spec = workload["spec"]
    pod = spec["template"]["spec"]
    assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] >= 10000
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    grace = float(CONFIG["SPECDEC_GRACE_PERIOD_S"])
    assert pod["terminationGracePeriodSeconds"] >= grace
    writable_volumes = {v["name"] for v in pod.get("volumes", []) if "emptyDir" in v or "persistentVolumeClaim" in v}
    writable_volumes |= {t["metadata"]["name"] for t in spec.get("volumeClaimTemplates", [])}
    for container in pod["containers"]:
        security = container["securityContext"]
        assert security["allowPrivilegeEscalation"] is False
        assert security["readOnlyRootFilesystem"] is True
        assert security["capabilities"]["drop"] == ["ALL"]
        resources = container["resources"]
        for key in ("cpu", "memory"):
            assert key in resources["requests"] and key in resources["limits"], (container["name"], key)
        for mount in container["volumeMounts"]:
            assert mount.get("readOnly") is True or mount["name"] in writable_volumes, mount
            if mount["name"] in writable_volumes:
                assert not mount.get("readOnly")
    assert (
        any(
            pdb["spec"]["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
            for pdb in _kind("PodDisruptionBudget")
        )
        or workload["metadata"]["name"] == "specdec-redis"
    )


@pytest.mark.parametrize("workload", _workloads(), ids=lambda w: w["metadata"]["name"])
def test_pods_take_no_service_link_variables(workload: dict[str, Any]) -> None:
    """Kubernetes gives every pod variables for each Service of its namespace; the coordinator's
    Service is named `specdec`, so they are SPECDEC_PORT=tcp://IP:PORT and a dozen more, which the
    services read as settings (one that SPECDEC_PORT did not override would end start-up) or
    report as unknown. The pods find each other by DNS name and take none."""
    assert workload["spec"]["template"]["spec"]["enableServiceLinks"] is False


@pytest.mark.parametrize("workload", _workloads(), ids=lambda w: w["metadata"]["name"])
def test_secrets_are_mounted_as_volumes_that_kubernetes_updates(workload: dict[str, Any]) -> None:
    """The services read rotated tokens and certificates from their files; Kubernetes never
    updates a Secret mounted with subPath."""
    pod = workload["spec"]["template"]["spec"]
    secret_volumes = {v["name"] for v in pod.get("volumes", []) if "secret" in v or "projected" in v}
    assert secret_volumes
    for container in pod["containers"]:
        for mount in container.get("volumeMounts", []):
            assert mount["name"] not in secret_volumes or "subPath" not in mount, (container["name"], mount)


@pytest.mark.parametrize("workload", ["specdec-coordinator", "specdec-draft", "specdec-target"])
def test_pods_are_stopped_after_their_service_has_dropped_them(workload: str) -> None:
    """On SIGTERM a service tells its clients to go and they reconnect through the Service; a
    pod's deletion and its removal from the Service's endpoints happen at once, so reconnections
    in the first moments can still be sent to the stopping pod, whose port is closed. Every
    container waits a few seconds before its SIGTERM (a preStop sleep), and the pod's grace covers
    the wait, the services' drain and the time the calls cut off at its end get to undo their work
    (the coordinator's turns roll back through the state store) before the server's last stop."""
    (doc,) = [w for w in _workloads() if w["metadata"]["name"] == workload]
    pod = doc["spec"]["template"]["spec"]
    cut_off = _CANCEL_WAIT_S
    if workload == "specdec-coordinator":
        retry = CONFIG.get("SPECDEC_STATE_RETRY_S", CoordinatorSettings.model_fields["state_retry_s"].default)
        cut_off = cut_off_cleanup_s(float(retry))
    drain = float(CONFIG["SPECDEC_GRACE_PERIOD_S"]) + cut_off + _STOP_GRACE_S
    for container in pod["containers"]:
        wait = container["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert 3 <= wait <= 10, container["name"]
        assert pod["terminationGracePeriodSeconds"] >= wait + drain, container["name"]


@pytest.mark.parametrize("role", ["coordinator", "draft", "target"])
def test_probes_use_grpc_health_on_the_plaintext_port(role: str) -> None:
    (container, _pod) = next((c, p) for r, c, p in _specdec_containers() if r == role)
    health_port = int(CONFIG["SPECDEC_HEALTH_PORT"])
    expected = {"startupProbe": STARTUP, "readinessProbe": READINESS, "livenessProbe": LIVENESS}
    for probe, service in expected.items():
        assert container[probe]["grpc"] == {"port": health_port, "service": service}, probe
    assert len(set(expected.values())) == 3
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {
        "grpc": int(CONFIG["SPECDEC_PORT"]),
        "health": health_port,
        "metrics": int(CONFIG["SPECDEC_METRICS_PORT"]),
    }


@pytest.mark.parametrize("role", ["coordinator", "draft", "target"])
def test_pod_environment_is_accepted_by_the_service_settings(
    role: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (container, _pod) = next((c, p) for r, c, p in _specdec_containers() if r == role)
    env = _container_env(container)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    settings = SETTINGS[role]()
    every_field = {name for cls in SETTINGS.values() for name in cls.model_fields}
    names = {n.removeprefix("SPECDEC_").lower() for n in env if n.startswith("SPECDEC_")}
    assert names <= every_field, f"settings no service has: {names - every_field}"  # typos
    assert settings.port == int(CONFIG["SPECDEC_PORT"]) and settings.health_port == int(CONFIG["SPECDEC_HEALTH_PORT"])
    assert settings.tls_cert_file and settings.tls_key_file  # TLS on every hop
    mounted = {m["mountPath"] for m in container["volumeMounts"]}
    for path in (settings.tls_cert_file, settings.tls_key_file, settings.auth_tokens_file):
        assert path and any(path.startswith(m + "/") for m in mounted), path
    if isinstance(settings, CoordinatorSettings):
        assert settings.worker_tls_ca_file and settings.worker_tls_cert_file and settings.worker_token_file
        assert settings.state_url.startswith("rediss://") and settings.state_password_file
        assert len(settings.target_addresses) == _one("StatefulSet", "specdec-target")["spec"]["replicas"]
        # one address per draft replica: each session drafts on one, where its draft cache is
        assert len(settings.drafts) == _one("StatefulSet", "specdec-draft")["spec"]["replicas"] >= 2
    else:
        assert settings.tls_client_ca_file and settings.tls_allowed_client_names == ["coordinator.specdec"]


def test_target_gets_a_whole_gpu_on_gpu_nodes_and_the_draft_stays_on_cpu() -> None:
    target = _one("StatefulSet", "specdec-target")["spec"]["template"]["spec"]
    resources = target["containers"][0]["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] == 1
    assert target["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in target["tolerations"]
    assert _container_env(target["containers"][0])["SPECDEC_DEVICE"] == "cuda"
    draft = _one("StatefulSet", "specdec-draft")["spec"]["template"]["spec"]
    assert "nvidia.com/gpu" not in json.dumps(draft["containers"][0]["resources"])
    term = draft["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]
    assert term["matchExpressions"] == [{"key": "nvidia.com/gpu.present", "operator": "NotIn", "values": ["true"]}]
    assert _container_env(draft["containers"][0])["SPECDEC_DEVICE"] == "cpu"


def test_services_select_pods_and_name_real_ports() -> None:
    for service in _kind("Service"):
        selector = service["spec"]["selector"]
        matches = [w for w in _workloads() if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert len(matches) == 1, service["metadata"]["name"]
        names = {p["name"] for c in matches[0]["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
        assert all(port["targetPort"] in names for port in service["spec"]["ports"])
    for workers in ("specdec-target", "specdec-draft"):  # per-pod names for routing a session to its cache
        assert _one("Service", workers)["spec"]["clusterIP"] == "None"
        assert _one("StatefulSet", workers)["spec"]["serviceName"] == workers
    address = CoordinatorSettings.model_validate(
        {
            "target_addresses": json.loads(CONFIG["SPECDEC_TARGET_ADDRESSES"]),
            "draft_addresses": json.loads(CONFIG["SPECDEC_DRAFT_ADDRESSES"]),
        }
    )
    assert address.target_addresses[0].startswith("specdec-target-0.specdec-target.specdec.svc")
    assert [a.split(".")[:2] for a in address.drafts] == [
        ["specdec-draft-0", "specdec-draft"],
        ["specdec-draft-1", "specdec-draft"],
    ]
    hpa = _one("HorizontalPodAutoscaler", "specdec-coordinator")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "specdec-coordinator" and hpa["spec"]["minReplicas"] >= 2


def _cores(quantity: str) -> float:
    return float(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def test_the_coordinator_scales_out_before_its_event_loop_is_full() -> None:
    """The coordinator runs on one asyncio event loop (its main thread did 92% of its CPU in a run
    of 600 requests): one core is all it can use. The HPA scales each container of the pod by its
    own CPU against its own request, the coordinator's at most three quarters of a core; by the
    pod's sum (the gateway's request added), a busy coordinator beside an idle gateway would not
    reach the target before its loop was full, or at all."""
    hpa = _one("HorizontalPodAutoscaler", "specdec-coordinator")
    pod = _one("Deployment", "specdec-coordinator")["spec"]["template"]["spec"]
    requests = {c["name"]: _cores(c["resources"]["requests"]["cpu"]) for c in pod["containers"]}
    scaled = {}
    for metric in hpa["spec"]["metrics"]:
        assert metric["type"] == "ContainerResource", metric  # not the pod's sum
        resource = metric["containerResource"]
        assert resource["name"] == "cpu" and resource["target"]["type"] == "Utilization"
        scaled[resource["container"]] = resource["target"]["averageUtilization"] / 100
    assert scaled.keys() == requests.keys()  # every container can call for another pod
    assert requests["coordinator"] <= 1 and requests["coordinator"] * scaled["coordinator"] <= 0.75


def test_redis_requires_auth_and_tls_and_never_evicts() -> None:
    conf = _one("ConfigMap", "specdec-redis-config")["data"]["redis.conf"]
    assert re.search(r"^maxmemory-policy noeviction$", conf, re.MULTILINE)
    assert re.search(r"^port 0$", conf, re.MULTILINE) and re.search(r"^tls-port 6379$", conf, re.MULTILINE)
    assert "requirepass" not in conf  # the password comes from the Secret at start
    container = _one("StatefulSet", "specdec-redis")["spec"]["template"]["spec"]["containers"][0]
    script = container["args"][0]
    assert "requirepass" in script and "/etc/specdec/auth/redis-password" in script and "exec redis-server" in script
    assert "env" not in container  # no password in environment variables


# Network policies


def _policy(name: str) -> dict[str, Any]:
    return _one("NetworkPolicy", name)["spec"]


def _from_coordinator_only(rules: list[dict[str, Any]], port: int) -> bool:
    coordinator = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "specdec-coordinator"}}}
    peers = [peer for rule in rules if {"port": port, "protocol": "TCP"} in rule["ports"] for peer in rule["from"]]
    return bool(peers) and all(peer == coordinator for peer in peers)


def test_default_deny_then_only_the_coordinator_reaches_workers_and_redis() -> None:
    deny = _policy("default-deny-all")
    assert deny["podSelector"] == {} and set(deny["policyTypes"]) == {"Ingress", "Egress"} and "ingress" not in deny
    workers = _policy("workers")
    assert workers["podSelector"]["matchExpressions"][0]["values"] == ["specdec-draft", "specdec-target"]
    assert _from_coordinator_only(workers["ingress"], int(CONFIG["SPECDEC_PORT"]))
    assert _from_coordinator_only(_policy("redis")["ingress"], 6379)
    coordinator = _policy("coordinator")
    client_rules = [r for r in coordinator["ingress"] if r["from"] == [{"namespaceSelector": {}}]]
    gateway_port = {"protocol": "TCP", "port": 8443}  # the OpenAI gateway sidecar
    assert [r["ports"] for r in client_rules] == [
        [{"protocol": "TCP", "port": int(CONFIG["SPECDEC_PORT"])}, gateway_port]
    ]
    egress_ports = {p["port"] for rule in coordinator["egress"] for p in rule["ports"]}
    assert egress_ports == {int(CONFIG["SPECDEC_PORT"]), 6379}


def test_the_gateway_sidecar_reaches_the_coordinator_on_the_pod_loopback() -> None:
    """The OpenAI gateway runs beside the coordinator (smg speaks plaintext gRPC without tokens to
    its workers, so the hop stays on the pod's loopback), serves HTTPS with the API certificate,
    takes its clients' key from its own Secret file, and the image installs it."""
    pod = _one("Deployment", "specdec-coordinator")["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in pod["containers"]}
    coordinator, gateway = containers["coordinator"], containers["gateway"]
    local_port = _container_env(coordinator)["SPECDEC_LOCAL_PORT"]
    script = gateway["args"][0]
    assert gateway["command"] == ["/bin/sh", "-c"] and script.startswith("exec smg launch --backend vllm")
    assert f"--worker-urls grpc://127.0.0.1:{local_port} " in script
    assert "--tls-cert-path /etc/specdec/tls/coordinator.crt" in script
    assert '--api-key "$(cat /etc/specdec/auth/gateway-api-key)"' in script
    mounts = {m["name"]: m["mountPath"] for m in gateway["volumeMounts"]}
    assert mounts["gateway-auth"] == "/etc/specdec/auth" and "auth" not in mounts
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert [i["key"] for i in volumes["gateway-auth"]["secret"]["items"]] == ["gateway-api-key"]
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/health", "port": "openai", "scheme": "HTTPS"}
    service_ports = {p["name"]: p["port"] for p in _one("Service", "specdec")["spec"]["ports"]}
    assert service_ports["openai"] == 8443
    assert '".[gateway]"' in (ROOT / "Dockerfile").read_text()
    assert 'gateway = ["smg==1.13.0"]' in (ROOT / "pyproject.toml").read_text()


def _keys_the_pods_read() -> dict[str, set[str]]:
    """Secret name -> the keys some pod mounts or reads from it."""
    keys: dict[str, set[str]] = {}
    for workload in _workloads():
        pod = workload["spec"]["template"]["spec"]
        for volume in pod.get("volumes", []):
            if "secret" in volume:
                items = volume["secret"]["items"]
                keys.setdefault(volume["secret"]["secretName"], set()).update(i["key"] for i in items)
        for container in pod["containers"] + pod.get("initContainers", []):
            for item in container.get("env", []):
                ref = item.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    keys.setdefault(ref["name"], set()).add(ref["key"])
    return keys


def _readme_secret_commands() -> dict[str, set[str]]:
    """Secret name -> the keys the README's `kubectl create secret generic` commands put in it
    (`--from-file=KEY=PATH` names KEY, `--from-file=PATH` the file's name)."""
    text = (ROOT / "README.md").read_text().replace("\\\n", " ")
    created: dict[str, set[str]] = {}
    for line in text.splitlines():
        found = re.search(r"kubectl .*create secret generic (\S+)(.*)", line)
        if found:
            sources = re.findall(r"--from-file=(\S+)", found[2])
            created[found[1]] = {source.split("=")[0] if "=" in source else Path(source).name for source in sources}
    return created


def test_the_readme_creates_every_secret_key_the_pods_read() -> None:
    """Following the README's Configure step leaves no pod waiting for a key nobody created."""
    read = _keys_the_pods_read()
    created = _readme_secret_commands()
    assert set(read) == {"specdec-auth", "specdec-tls"}
    for name, keys in read.items():
        assert keys <= created.get(name, set()), f"{name}: the README does not create {sorted(keys - created[name])}"
    annotated = _one("Secret", "specdec-auth")["metadata"]["annotations"]["specdec.dev/keys"]
    assert all(key in annotated for key in read["specdec-auth"])
