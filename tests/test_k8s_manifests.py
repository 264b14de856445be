"""The Kubernetes manifests, rendered by `kubectl kustomize` for every overlay: schema
validity (kubernetes-validate, strict, offline) and the project's own rules: probes and
limits on every container, Service ports that reach container ports, GPU counts equal
to the TP degree, the NetworkPolicy's exact set of admitted paths, no root anywhere,
and settings and command lines that follow adaserve/config.py and ARCHITECTURE.md."""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.k8s_local_run import (
    OVERLAYS,
    REPO,
    all_containers,
    argv,
    by_kind,
    config_yaml,
    find,
    flag,
    kubectl,
    parse_cpu,
    parse_quantity,
    pod_labels,
    pod_spec,
    render,
    resolve_target_port,
    workloads,
)

pytestmark = pytest.mark.skipif(
    kubectl() is None, reason="kubectl (with built-in kustomize) is not installed"
)

NAMESPACE = "adaserve"
SERVICES = ("gateway", "scheduler", "drafter", "verifier")
# Oldest Kubernetes the manifests support (native gRPC probes are GA since 1.27,
# policy/v1 and autoscaling/v2 are older) and the newest schema the validator ships.
MIN_K8S = "1.30.0"


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> str:
    return request.param


_CACHE: dict[str, list[dict[str, Any]]] = {}


@pytest.fixture(scope="module")
def docs(overlay: str) -> list[dict[str, Any]]:
    if overlay not in _CACHE:
        _CACHE[overlay] = render(overlay)
    return _CACHE[overlay]


def containers_of(docs: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    return [(wl, c) for wl in workloads(docs) for c in all_containers(wl)]


def service_of(container: dict[str, Any]) -> str:
    command = argv(container)
    assert command[:1] == ["adaserve"] and len(command) > 1, command
    return command[1]


# --- rendering and schemas --------------------------------------------------------------


def test_overlay_renders_the_whole_deployment(docs: list[dict[str, Any]]) -> None:
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for expected in [
        ("Deployment", "adaserve-gateway"),
        ("Deployment", "adaserve-scheduler"),
        ("StatefulSet", "adaserve-unit"),
        ("Service", "adaserve-gateway"),
        ("Service", "adaserve-scheduler"),
        ("Service", "adaserve-unit-headless"),
        ("HorizontalPodAutoscaler", "adaserve-gateway"),
        ("HorizontalPodAutoscaler", "adaserve-scheduler"),
        ("ServiceAccount", "adaserve"),
        ("Namespace", NAMESPACE),
    ]:
        assert expected in kinds, f"{expected} missing from the rendered overlay"
    assert by_kind(docs, "PodDisruptionBudget") and by_kind(docs, "NetworkPolicy")
    for d in docs:
        if d["kind"] != "Namespace":
            assert d["metadata"].get("namespace") == NAMESPACE, d["metadata"]["name"]


def test_every_document_passes_strict_schema_validation(docs: list[dict[str, Any]]) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    latest = kubernetes_validate.latest_version()
    for version in (MIN_K8S, latest):
        for d in docs:
            try:
                kubernetes_validate.validate(d, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{d['kind']}/{d['metadata']['name']} invalid for {version}: {exc}")


def test_strict_validation_catches_a_misspelled_field(docs: list[dict[str, Any]]) -> None:
    # Guards the guard: a typo'd probe must fail, or the test above proves nothing.
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    wl = yaml.safe_load(yaml.safe_dump(find(docs, "Deployment", "adaserve-gateway")))
    c = pod_spec(wl)["containers"][0]
    c["readinesProbe"] = c.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wl, kubernetes_validate.latest_version(), strict=True)


# --- containers: probes, resources, images, security ------------------------------------


def test_every_container_has_probes(docs: list[dict[str, Any]]) -> None:
    for wl, c in containers_of(docs):
        where = f"{wl['metadata']['name']}/{c['name']}"
        for probe in ("readinessProbe", "livenessProbe"):
            assert probe in c, f"{where} has no {probe}"
            p = c[probe]
            if service_of(c) == "gateway":
                assert "httpGet" in p, f"{where}: the gateway is probed over HTTP"
            else:
                assert "grpc" in p, f"{where}: gRPC services use native grpc probes"
                port = p["grpc"]["port"]
                assert port in [cp["containerPort"] for cp in c["ports"]], where
        http = {
            c[p]["httpGet"]["path"]
            for p in ("readinessProbe", "livenessProbe")
            if "httpGet" in c[p]
        }
        if service_of(c) == "gateway":
            assert http == {"/ready", "/health"}, f"{where}: readiness /ready, liveness /health"


def test_every_container_has_requests_and_limits(docs: list[dict[str, Any]]) -> None:
    for wl, c in containers_of(docs):
        where = f"{wl['metadata']['name']}/{c['name']}"
        res = c.get("resources", {})
        for kind in ("requests", "limits"):
            for resource in ("cpu", "memory"):
                assert resource in res.get(kind, {}), f"{where}: no {kind}.{resource}"
        assert parse_cpu(res["requests"]["cpu"]) <= parse_cpu(res["limits"]["cpu"]), where
        assert parse_quantity(res["requests"]["memory"]) <= parse_quantity(
            res["limits"]["memory"]
        ), where


def test_images_are_pinned(docs: list[dict[str, Any]]) -> None:
    for wl, c in containers_of(docs):
        image = c["image"]
        name, _, tag = image.rpartition(":") if "@" not in image else (image, "", "digest")
        assert name and tag and tag != "latest", f"{wl['metadata']['name']}/{c['name']}: {image}"
        assert c.get("imagePullPolicy") == "IfNotPresent"


def test_nothing_runs_as_root(docs: list[dict[str, Any]]) -> None:
    for wl in workloads(docs):
        spec = pod_spec(wl)
        name = wl["metadata"]["name"]
        psc = spec.get("securityContext", {})
        assert psc.get("runAsNonRoot") is True, name
        assert psc.get("runAsUser", 0) != 0 and psc.get("runAsGroup", 0) != 0, name
        assert psc.get("seccompProfile", {}).get("type") == "RuntimeDefault", name
        assert spec.get("automountServiceAccountToken") is False, name
        assert spec.get("serviceAccountName") == "adaserve", name
        # Service links would put ADASERVE_*_PORT variables in the settings' env prefix.
        assert spec.get("enableServiceLinks") is False, name
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for c in all_containers(wl):
            where = f"{name}/{c['name']}"
            sc = c.get("securityContext", {})
            assert sc.get("runAsUser", psc["runAsUser"]) != 0, where
            assert sc.get("runAsNonRoot", True) is True, where
            assert sc.get("allowPrivilegeEscalation") is False, where
            assert sc.get("readOnlyRootFilesystem") is True, where
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], where
            assert not sc.get("capabilities", {}).get("add"), where
            assert "privileged" not in sc or sc["privileged"] is False, where
            # A read-only root needs a writable /tmp (Python, torch and grpc use it).
            tmp = [m for m in c.get("volumeMounts", []) if m["mountPath"] == "/tmp"]
            assert tmp and "emptyDir" in volumes[tmp[0]["name"]], f"{where}: no emptyDir /tmp"
        for v in volumes.values():
            assert "hostPath" not in v, f"{name}: hostPath breaks the restricted policy"


def test_service_account_has_no_token(docs: list[dict[str, Any]]) -> None:
    sa = find(docs, "ServiceAccount", "adaserve")
    assert sa.get("automountServiceAccountToken") is False
    ns = find(docs, "Namespace", NAMESPACE)
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


# --- services, discovery and scaling ----------------------------------------------------


def test_every_service_port_reaches_a_container_port(docs: list[dict[str, Any]]) -> None:
    for svc in by_kind(docs, "Service"):
        name = svc["metadata"]["name"]
        selector = svc["spec"]["selector"]
        targets = [wl for wl in workloads(docs) if selector.items() <= pod_labels(wl).items()]
        assert targets, f"Service {name} selects no workload"
        for port in svc["spec"]["ports"]:
            for wl in targets:
                assert resolve_target_port(wl, port) is not None, (
                    f"Service {name} port {port} matches no container port of "
                    f"{wl['metadata']['name']}"
                )


def test_container_ports_match_the_service_flags(docs: list[dict[str, Any]]) -> None:
    for wl, c in containers_of(docs):
        args = argv(c)
        ports = {p["containerPort"] for p in c["ports"]}
        listen = {int(flag(args, "--port"))}
        for extra in ("--grpc-port", "--metrics-port"):
            if flag(args, extra) and int(flag(args, extra)) > 0:
                listen.add(int(flag(args, extra)))
        assert listen == ports, f"{wl['metadata']['name']}/{c['name']}: {listen} vs {ports}"
        assert flag(args, "--host") == "0.0.0.0", "probes reach the pod IP, not loopback"


def _architecture_flags() -> dict[str, set[str]]:
    """Flags each service takes, from docs/ARCHITECTURE.md's "Services and ports"."""
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    common = set(re.findall(r"--[a-z][a-z-]*", re.search(r"Every service: `([^`]*)`", text)[1]))
    out: dict[str, set[str]] = {}
    for service, line in re.findall(r"^- `adaserve (\w+) ([^`]*)`", text, re.MULTILINE):
        out[service] = common | set(re.findall(r"--[a-z][a-z-]*", line))
    return out


def test_command_lines_follow_the_architecture_contract(docs: list[dict[str, Any]]) -> None:
    allowed = _architecture_flags()
    assert set(SERVICES) <= allowed.keys()
    seen = set()
    for _, c in containers_of(docs):
        service = service_of(c)
        assert service in SERVICES and c["name"] == service
        seen.add(service)
        used = {a.split("=", 1)[0] for a in argv(c)[2:] if a.startswith("--")}
        assert used <= allowed[service], f"{service}: {used - allowed[service]} not in the contract"
    assert seen == set(SERVICES)


def _container(docs: list[dict[str, Any]], service: str) -> tuple[dict[str, Any], dict[str, Any]]:
    [(wl, c)] = [(wl, c) for wl, c in containers_of(docs) if service_of(c) == service]
    return wl, c


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def test_drafter_is_paired_with_its_verifier_in_one_pod(docs: list[dict[str, Any]]) -> None:
    v_wl, verifier = _container(docs, "verifier")
    d_wl, drafter = _container(docs, "drafter")
    assert v_wl is d_wl and v_wl["kind"] == "StatefulSet"
    host, port = _split(flag(argv(verifier), "--drafter-address"))
    assert host == "127.0.0.1" and port == int(flag(argv(drafter), "--port"))


def test_gateway_discovers_units_through_the_headless_service(
    docs: list[dict[str, Any]],
) -> None:
    _, gateway = _container(docs, "gateway")
    unit_wl, verifier = _container(docs, "verifier")
    name, port = _split(flag(argv(gateway), "--verifier-dns"))
    svc = find(docs, "Service", name)
    assert svc["spec"]["clusterIP"] == "None", "unit discovery needs a headless Service"
    assert unit_wl["spec"]["serviceName"] == name
    [svc_port] = [p for p in svc["spec"]["ports"] if p["port"] == port]
    assert resolve_target_port(unit_wl, svc_port) == int(flag(argv(verifier), "--port"))
    assert flag(argv(gateway), "--verifier") is None, "units come from DNS, not a fixed list"


def test_verifier_reaches_the_scheduler_service(docs: list[dict[str, Any]]) -> None:
    _, verifier = _container(docs, "verifier")
    sched_wl, scheduler = _container(docs, "scheduler")
    name, port = _split(flag(argv(verifier), "--scheduler-address"))
    svc = find(docs, "Service", name)
    [svc_port] = [p for p in svc["spec"]["ports"] if p["port"] == port]
    assert resolve_target_port(sched_wl, svc_port) == int(flag(argv(scheduler), "--port"))


def test_gateway_and_scheduler_autoscale_and_units_scale_as_units(
    overlay: str, docs: list[dict[str, Any]]
) -> None:
    targets = {
        (h["spec"]["scaleTargetRef"]["kind"], h["spec"]["scaleTargetRef"]["name"])
        for h in by_kind(docs, "HorizontalPodAutoscaler")
    }
    expected = {("Deployment", "adaserve-gateway"), ("Deployment", "adaserve-scheduler")}
    if overlay == "gpu-autoscale":  # units too, on their SLO signal
        expected.add(("StatefulSet", "adaserve-unit"))
    assert targets == expected
    for h in by_kind(docs, "HorizontalPodAutoscaler"):
        ref = h["spec"]["scaleTargetRef"]
        assert 1 <= h["spec"]["minReplicas"] <= h["spec"]["maxReplicas"]
        assert "replicas" not in find(docs, ref["kind"], ref["name"])["spec"], (
            "a workload under an HPA must not pin replicas (kubectl apply would fight it)"
        )
    unit = find(docs, "StatefulSet", "adaserve-unit")
    assert unit["spec"]["podManagementPolicy"] == "Parallel"


def test_units_scale_on_metrics_the_verifier_exports(overlay: str, docs: list) -> None:
    """The unit HPA's custom metrics are series the engine really exports, and the
    adapter rules shipped beside it serve exactly those."""
    if overlay != "gpu-autoscale":
        pytest.skip("the autoscaling overlay only")
    import prometheus_client

    import adaserve.metrics  # noqa: F401 - registers the engine's series

    exported = {m.name for m in prometheus_client.REGISTRY.collect()}
    [hpa] = [
        h
        for h in by_kind(docs, "HorizontalPodAutoscaler")
        if h["spec"]["scaleTargetRef"]["name"] == "adaserve-unit"
    ]
    names = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]}
    assert names == {"adaserve_slo_pressure", "adaserve_predicted_queue_seconds"}
    assert names <= exported
    rules = yaml.safe_load(
        (
            REPO / "k8s" / "components" / "unit-autoscaling" / "prometheus-adapter-rules.yaml"
        ).read_text()
    )
    served = {r["name"]["matches"] for r in rules["rules"]["custom"]}
    assert served == names
    behavior = hpa["spec"]["behavior"]
    # Scaling down drains a unit: slower than scaling up, and never in a burst.
    assert (
        behavior["scaleDown"]["stabilizationWindowSeconds"]
        > (behavior["scaleUp"]["stabilizationWindowSeconds"])
    )


def test_every_workload_has_a_disruption_budget(docs: list[dict[str, Any]]) -> None:
    pdbs = by_kind(docs, "PodDisruptionBudget")
    for wl in workloads(docs):
        covering = [
            p
            for p in pdbs
            if p["spec"]["selector"]["matchLabels"].items() <= pod_labels(wl).items()
        ]
        assert len(covering) == 1, wl["metadata"]["name"]
        assert covering[0]["spec"].get("maxUnavailable") == 1


# --- settings --------------------------------------------------------------------------


def _unknown_keys(data: Any, model: type, path: str = "") -> list[str]:
    """Keys the settings model would silently ignore (extra="ignore"): typos."""
    from pydantic import BaseModel

    out: list[str] = []
    if not isinstance(data, dict):
        return out
    for key, value in data.items():
        if key not in model.model_fields:
            out.append(path + key)
            continue
        annotation = model.model_fields[key].annotation
        args = getattr(annotation, "__args__", ())
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            out += _unknown_keys(value, annotation, f"{path}{key}.")
        elif args and isinstance(value, dict):  # dict[str, Model] (the SLO classes)
            sub = args[-1]
            if isinstance(sub, type) and issubclass(sub, BaseModel):
                for name, item in value.items():
                    out += _unknown_keys(item, sub, f"{path}{key}.{name}.")
    return out


def test_config_map_is_valid_settings(docs: list[dict[str, Any]], tmp_path: Path) -> None:
    from adaserve.config import Settings, load_settings

    data = config_yaml(docs)
    assert _unknown_keys(data, Settings) == []
    path = tmp_path / "adaserve.yaml"
    path.write_text(yaml.safe_dump(data))
    settings = load_settings(path)
    assert {"coding", "chat", "summarize"} <= settings.slo.classes.keys()
    assert settings.slo.default_class in settings.slo.classes
    a = settings.scheduler.adaptive
    assert a.d_min <= a.d_max and a.w_max >= 1 and settings.scheduler.budget >= 1


def test_every_service_reads_the_mounted_config(docs: list[dict[str, Any]]) -> None:
    for wl, c in containers_of(docs):
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        path = env.get("ADASERVE_CONFIG")
        assert path, f"{c['name']}: ADASERVE_CONFIG unset"
        volumes = {v["name"]: v for v in pod_spec(wl)["volumes"]}
        [mount] = [m for m in c["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
        assert mount.get("readOnly") is True
        cm = find(docs, "ConfigMap", volumes[mount["name"]]["configMap"]["name"])
        assert path[len(mount["mountPath"]) + 1 :] in cm["data"]
        # Settings come from the file and ADASERVE_<SECTION>__<FIELD> only.
        extra = {"ADASERVE_CONFIG", "ADASERVE_API_KEYS"}
        for name in env:
            assert not name.startswith("ADASERVE_") or name in extra or "__" in name, name


def test_command_line_models_agree_with_the_config(docs: list[dict[str, Any]]) -> None:
    model = config_yaml(docs)["model"]
    _, verifier = _container(docs, "verifier")
    _, drafter = _container(docs, "drafter")
    assert flag(argv(verifier), "--target") == model["target"]
    assert int(flag(argv(verifier), "--tp") or 1) == model["tp"]
    assert flag(argv(drafter), "--model") == model["drafter"]


def _gpus(c: dict[str, Any]) -> tuple[int, int]:
    res = c.get("resources", {})
    return (
        int(res.get("requests", {}).get("nvidia.com/gpu", 0)),
        int(res.get("limits", {}).get("nvidia.com/gpu", 0)),
    )


def test_gpu_counts_match_the_tp_setting(overlay: str, docs: list[dict[str, Any]]) -> None:
    tp = config_yaml(docs)["model"]["tp"]
    _, verifier = _container(docs, "verifier")
    _, drafter = _container(docs, "drafter")
    if overlay.startswith("gpu"):
        assert tp == 4
        assert _gpus(verifier) == (tp, tp), "TP-N verifier: N GPUs (request == limit)"
        assert _gpus(drafter) == (1, 1)
    else:
        assert tp == 1
        for _, c in containers_of(docs):
            assert _gpus(c) == (0, 0), f"{overlay} must not ask for GPUs"
    for _, c in containers_of(docs):
        if service_of(c) in ("gateway", "scheduler"):
            assert _gpus(c) == (0, 0), "gateway and scheduler never hold a GPU"


def test_gpu_overlay_reads_models_from_the_shared_store(overlay: str, docs: list) -> None:
    if not overlay.startswith("gpu"):
        pytest.skip("GPU overlays only")
    unit = find(docs, "StatefulSet", "adaserve-unit")
    pvc = find(docs, "PersistentVolumeClaim", "adaserve-models")
    assert pvc["spec"]["accessModes"] == ["ReadOnlyMany"]
    [models] = [v for v in pod_spec(unit)["volumes"] if "persistentVolumeClaim" in v]
    assert models["persistentVolumeClaim"]["claimName"] == "adaserve-models"
    model = config_yaml(docs)["model"]
    for c in all_containers(unit):
        [m] = [m for m in c["volumeMounts"] if m["name"] == models["name"]]
        assert m["readOnly"] is True
        path = flag(argv(c), "--target") or flag(argv(c), "--model")
        assert path.startswith(m["mountPath"] + "/") and path in (
            model["target"],
            model["drafter"],
        )
        assert c["image"].endswith("-cuda")
    assert "Llama-3.1-70B-Instruct" in model["target"]
    assert "Llama-3.2-1B-Instruct" in model["drafter"]


def test_gpu_budget_follows_the_shipped_eurosys_profile(overlay: str, docs: list) -> None:
    if not overlay.startswith("gpu"):
        pytest.skip("GPU overlays only")
    profile_path = REPO / "adaserve" / "sim" / "profiles" / "llama-3.1-70b-tp4-a100.yaml"
    if not profile_path.is_file():
        pytest.skip(f"{profile_path} not shipped")
    profile = yaml.safe_load(profile_path.read_text())
    cfg = config_yaml(docs)
    assert cfg["scheduler"]["budget"] == profile["budget"]
    assert cfg["model"]["served_name"] == profile["target"]


# --- NetworkPolicy ----------------------------------------------------------------------

# Peers the policies are evaluated against: our three pods, cluster DNS, Prometheus in
# the monitoring namespace, a pod in some other namespace and an address outside the
# cluster.
PEERS: dict[str, dict[str, Any]] = {
    "gateway": {"ns": NAMESPACE},
    "scheduler": {"ns": NAMESPACE},
    "unit": {"ns": NAMESPACE},
    "kube-dns": {"ns": "kube-system", "labels": {"k8s-app": "kube-dns"}, "ports": [53]},
    "prometheus": {
        "ns": "monitoring",
        "labels": {"app.kubernetes.io/name": "prometheus"},
        "ports": [9090],
    },
    "other-namespace-pod": {"ns": "elsewhere", "labels": {"app": "x"}, "ports": [443]},
    "internet": {"ip": "203.0.113.7", "ports": [443]},
}
OUTSIDE = ("kube-dns", "prometheus", "other-namespace-pod", "internet")
INTENDED = {
    *((peer, "gateway", port, "TCP") for peer in OUTSIDE for port in (8000, 50050)),
    ("gateway", "unit", 50053, "TCP"),
    ("prometheus", "unit", 9400, "TCP"),  # engine metrics, from the monitoring namespace
    ("unit", "scheduler", 50051, "TCP"),
    ("gateway", "kube-dns", 53, "UDP"),
    ("gateway", "kube-dns", 53, "TCP"),
    ("unit", "kube-dns", 53, "UDP"),
    ("unit", "kube-dns", 53, "TCP"),
}


def _match_labels(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if set(selector) - {"matchLabels", "matchExpressions"}:
        raise NotImplementedError(f"selector {selector}")
    if selector.get("matchExpressions"):
        raise NotImplementedError("matchExpressions: extend the evaluator before using them")
    return selector.get("matchLabels", {}).items() <= labels.items()


def _in_block(ip: str, block: dict[str, Any]) -> bool:
    addr = ipaddress.ip_address(ip)
    return addr in ipaddress.ip_network(block["cidr"]) and not any(
        addr in ipaddress.ip_network(e) for e in block.get("except", [])
    )


def _peer_matches(rule_peers: list[dict[str, Any]] | None, peer: dict[str, Any]) -> bool:
    if not rule_peers:  # absent or empty: every source/destination
        return True
    for p in rule_peers:
        if "ipBlock" in p:
            if "ip" in peer and _in_block(peer["ip"], p["ipBlock"]):
                return True
            continue
        if "ns" not in peer:
            continue  # pod and namespace selectors never match outside addresses
        ns_labels = {"kubernetes.io/metadata.name": peer["ns"]}
        if "namespaceSelector" in p:
            ns_ok = _match_labels(p["namespaceSelector"], ns_labels)
        else:
            ns_ok = peer["ns"] == NAMESPACE  # podSelector alone: the policy's namespace
        pod_ok = _match_labels(p.get("podSelector", {}), peer["labels"])
        if ns_ok and pod_ok:
            return True
    return False


def _port_matches(
    rule_ports: list[dict[str, Any]] | None, dst: dict[str, Any], port: int, proto: str
) -> bool:
    if not rule_ports:
        return True
    for rp in rule_ports:
        if "endPort" in rp:
            raise NotImplementedError("endPort")
        if rp.get("protocol", "TCP") != proto:
            continue
        want = rp.get("port")
        if want is None or want == port or want == dst.get("port_names", {}).get(port):
            return True
    return False


def _policy_types(policy: dict[str, Any]) -> list[str]:
    spec = policy["spec"]
    return spec.get("policyTypes") or ["Ingress"] + (["Egress"] if "egress" in spec else [])


def _allowed(
    policies: list, src: dict[str, Any], dst: dict[str, Any], port: int, proto: str
) -> bool:
    def governed(peer: dict[str, Any], direction: str) -> list[dict[str, Any]]:
        if peer.get("ns") != NAMESPACE:
            return []  # our policies live in our namespace and select only our pods
        return [
            p
            for p in policies
            if direction in _policy_types(p)
            and _match_labels(p["spec"]["podSelector"], peer["labels"])
        ]

    ingress = governed(dst, "Ingress")
    if ingress and not any(
        _peer_matches(rule.get("from"), src) and _port_matches(rule.get("ports"), dst, port, proto)
        for p in ingress
        for rule in p["spec"].get("ingress", [])
    ):
        return False
    egress = governed(src, "Egress")
    return not egress or any(
        _peer_matches(rule.get("to"), dst) and _port_matches(rule.get("ports"), dst, port, proto)
        for p in egress
        for rule in p["spec"].get("egress", [])
    )


def test_network_policy_admits_exactly_the_intended_paths(docs: list[dict[str, Any]]) -> None:
    peers = {name: dict(p) for name, p in PEERS.items()}
    for wl in workloads(docs):
        component = pod_labels(wl)["app.kubernetes.io/component"]
        cports = [p for c in all_containers(wl) for p in c.get("ports", [])]
        peers[component].update(
            labels=pod_labels(wl),
            ports=[p["containerPort"] for p in cports],
            port_names={p["containerPort"]: p.get("name") for p in cports},
        )
    for p in peers.values():
        p.setdefault("labels", {})
    policies = by_kind(docs, "NetworkPolicy")
    admitted = set()
    for src_name, src in peers.items():
        for dst_name, dst in peers.items():
            if src_name == dst_name:
                continue
            for port in [*dst["ports"], 9999]:  # 9999: a port nothing listens on
                for proto in ("TCP", "UDP"):
                    if _allowed(policies, src, dst, port, proto):
                        admitted.add((src_name, dst_name, port, proto))
    # Paths between two outside peers are not ours to police.
    ours = {a for a in admitted if NAMESPACE in (peers[a[0]].get("ns"), peers[a[1]].get("ns"))}
    assert ours == INTENDED, (
        f"unintended: {sorted(ours - INTENDED)}; missing: {sorted(INTENDED - ours)}"
    )
    # The drafter port is never reachable over the network (loopback in the pod only).
    assert not any(a[2] == 50052 for a in ours)


# --- operating: metrics, drain, liveness -------------------------------------------------


def test_engine_metrics_are_exposed_and_annotated_for_scraping(docs: list[dict[str, Any]]) -> None:
    from services.verifier.__main__ import DEFAULT_METRICS_PORT

    unit_wl, verifier = _container(docs, "verifier")
    port = int(flag(argv(verifier), "--metrics-port"))
    assert port == DEFAULT_METRICS_PORT, "the fixed engine metrics port"
    assert {"name": "metrics", "containerPort": port, "protocol": "TCP"} in verifier["ports"]
    for wl, want in ((unit_wl, port), (find(docs, "Deployment", "adaserve-gateway"), 8000)):
        notes = wl["spec"]["template"]["metadata"].get("annotations", {})
        assert notes.get("prometheus.io/scrape") == "true", wl["metadata"]["name"]
        assert (
            int(notes["prometheus.io/port"]) == want and notes["prometheus.io/path"] == "/metrics"
        )
    _, gateway = _container(docs, "gateway")
    assert int(flag(argv(gateway), "--port")) == 8000


def test_drain_fits_the_grace_period_and_liveness_follows_the_engine_loop(
    docs: list[dict[str, Any]],
) -> None:
    """The unit's drain (fleet.drain_timeout_s) ends before the kubelet's SIGKILL
    (terminationGracePeriodSeconds), with room for the exit itself; liveness asks the
    verifier's `liveness` health entry (the engine loop), readiness its overall health
    (NOT_SERVING while draining)."""
    from adaserve.config import FleetSettings
    from services.verifier.server import LIVENESS

    fleet = FleetSettings(**config_yaml(docs).get("fleet", {}))
    unit_wl, verifier = _container(docs, "verifier")
    grace = pod_spec(unit_wl)["terminationGracePeriodSeconds"]
    assert fleet.drain_timeout_s + 5 <= grace, (fleet.drain_timeout_s, grace)
    assert fleet.drain_timeout_s >= 30, "streams need more than a few seconds to finish"
    assert verifier["livenessProbe"]["grpc"].get("service") == LIVENESS
    assert "service" not in verifier["readinessProbe"]["grpc"]
    # The gateway keeps serving through its preStop pause and uvicorn's 5 s shutdown.
    gw_wl, gateway = _container(docs, "gateway")
    pause = gateway["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pause + 5 < pod_spec(gw_wl)["terminationGracePeriodSeconds"]
