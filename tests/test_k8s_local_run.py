"""Run the rendered cpu-demo deployment as local processes and serve a chat completion.

Every container of the rendered overlay is started with its own command, args and
environment (plus the image's ENV), Service DNS names mapped to loopback ports, the
ConfigMap written to a file. Readiness is judged by the manifests' own probes, memory
by the containers' own limits, shutdown by their grace periods, and the image's
read-only root by checking that nothing is written to the image's directories. What
the cluster runs is what this test ran.
"""

from __future__ import annotations

import importlib.util
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.k8s_local_run import (
    REPO,
    LocalContainer,
    LocalDeployment,
    config_yaml,
    image_env,
    kubectl,
    make_workdir,
    render,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(kubectl() is None, reason="kubectl (with built-in kustomize) missing"),
]

SERVICE_MODULES = {
    "gateway": "gateway.__main__",
    "scheduler": "services.scheduler.__main__",
    "drafter": "services.drafter.__main__",
    "verifier": "services.verifier.__main__",
}
IMAGE_CACHE = "/var/cache/adaserve"  # ADASERVE_CACHE_DIR in docker/Dockerfile.cpu
IMAGE_HOME = "/home/adaserve"


def _missing_pieces(dep: LocalDeployment) -> list[str]:
    """What the deployment needs from other parts of the project and cannot find."""
    missing = []
    for c in dep.containers:
        service = c.argv[1]
        if importlib.util.find_spec(SERVICE_MODULES[service]) is None:
            missing.append(f"`adaserve {service}` ({SERVICE_MODULES[service]})")
    from adaserve.model.embedded import DRAFTER_ASSET

    if not (DRAFTER_ASSET / "config.json").is_file():
        missing.append(f"the embedded drafter ({DRAFTER_ASSET})")
    return missing


def _tree(root: Path) -> dict[str, int]:
    """Every path under root with its mtime: a change means something wrote there."""
    return {str(p.relative_to(root)): p.lstat().st_mtime_ns for p in root.rglob("*")}


def _probe_ok(c: LocalContainer, probe: dict[str, Any], timeout: float = 3.0) -> bool:
    """One probe of the rendered container, as the kubelet would send it."""
    if "grpc" in probe:
        address = f"127.0.0.1:{c.ports[probe['grpc']['port']]}"
        with grpc.insecure_channel(address) as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=probe["grpc"].get("service", "")),
                    timeout=timeout,
                )
            except grpc.RpcError:
                return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING
    if "httpGet" in probe:
        port = probe["httpGet"]["port"]
        if isinstance(port, str):
            [port] = [p["containerPort"] for p in c.spec["ports"] if p.get("name") == port]
        url = f"http://127.0.0.1:{c.ports[port]}{probe['httpGet']['path']}"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as resp:
                return 200 <= resp.status < 400  # the kubelet's success range
        except OSError:
            return False
    raise AssertionError(f"unsupported probe {probe}")


def _wait_ready(dep: LocalDeployment, timeout: float) -> None:
    pending = {id(c): c for c in dep.containers}
    deadline = time.monotonic() + timeout
    while pending:
        dead = dep.dead()
        if dead:
            c = dead[0]
            pytest.fail(f"{c.workload}/{c.name} exited {c.proc.returncode}:\n{c.log_tail()}")
        for key, c in list(pending.items()):
            if _probe_ok(c, c.spec["readinessProbe"]):
                del pending[key]
        dep.sample_rss()
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {c.workload}/{c.name}\n{c.log_tail()}" for c in pending.values())
            pytest.fail(f"not ready after {timeout:.0f}s:\n{logs}")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def deployment() -> Iterator[LocalDeployment]:
    from adaserve.model.cpu_gemm import ISA_FLAGS, KernelUnavailable, build
    from adaserve.model.embedded import cache_root, resolve_model

    docs = render("cpu-demo")
    workdir = make_workdir()
    # The image ships the converted embedded model in its cache (Dockerfile.cpu RUN
    # resolve_model); here the same conversion, in this machine's cache, stands in.
    converted = resolve_model("embedded")
    image_cache = workdir / "image" / "var-cache-adaserve"
    image_cache.mkdir(parents=True)
    (image_cache / "gguf").symlink_to(converted.parent, target_is_directory=True)
    assert converted.parent == cache_root() / "gguf"
    # ... and the packed CPU kernel its builder stage compiled (cpu_gemm.build).
    try:
        kernel_libs = [build(isa) for isa in ISA_FLAGS]  # the image builds both
    except KernelUnavailable:
        pass  # no compiler here: the services run on MKL, as they would without the file
    else:
        (image_cache / "kernels").symlink_to(kernel_libs[0].parent, target_is_directory=True)
    image_home = workdir / "image" / "home-adaserve"
    image_home.mkdir(parents=True)
    dep = LocalDeployment(
        docs,
        workdir,
        image_env=image_env(REPO / "docker" / "Dockerfile.cpu"),
        image_paths={IMAGE_CACHE: image_cache, IMAGE_HOME: image_home},
    )
    missing = _missing_pieces(dep)
    if missing:
        pytest.skip("the deployment's services are not all built yet: " + ", ".join(missing))
    before = {"cache": _tree(image_cache), "converted": _tree(converted), "home": _tree(image_home)}
    dep.start()
    try:
        startup = max(
            c.spec.get("startupProbe", {}).get("failureThreshold", 30)
            * c.spec.get("startupProbe", {}).get("periodSeconds", 10)
            for c in dep.containers
        )
        _wait_ready(dep, timeout=min(startup, 600))
        yield dep
    finally:
        dep.stop()  # idempotent: the last test has normally stopped it already
    # The pods run with a read-only root: the image's own directories must not change.
    after = {"cache": _tree(image_cache), "converted": _tree(converted), "home": _tree(image_home)}
    assert after == before, "a service wrote into the image's read-only directories"


@pytest.fixture(scope="module")
def gateway_url(deployment: LocalDeployment) -> str:
    return f"http://127.0.0.1:{deployment.local_port('adaserve-gateway', 8000)}"


def test_liveness_probes_pass(deployment: LocalDeployment) -> None:
    for c in deployment.containers:
        assert _probe_ok(c, c.spec["livenessProbe"]), f"{c.workload}/{c.name} liveness"
        if "startupProbe" in c.spec:
            assert _probe_ok(c, c.spec["startupProbe"]), f"{c.workload}/{c.name} startup"


def test_chat_completion_through_the_gateway(deployment: LocalDeployment, gateway_url: str) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0, timeout=300)
    [model] = [m.id for m in client.models.list().data]
    messages = [{"role": "user", "content": "Name three colors."}]
    reply = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=12,
        temperature=0,
        extra_body={"slo_class": "chat"},
    )
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert 0 < reply.usage.completion_tokens <= 12 and reply.usage.prompt_tokens > 0
    # Streaming through the same path delivers the same greedy text.
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=12, temperature=0, stream=True
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == choice.message.content
    deployment.sample_rss()


def test_processes_fit_their_memory_limits(deployment: LocalDeployment) -> None:
    """Peak RSS plus the KV cache a full load would still touch stays under each
    container's limit (the KV tensors are allocated lazily, so a short run under-counts
    them; adaserve/engine_build.py gives the drafter a quarter, at least 0.25 GB)."""
    from adaserve.config import EngineSettings

    deployment.sample_rss()
    engine = config_yaml(deployment.docs).get("engine", {})
    kv_gb = engine.get("kv_memory_gb", EngineSettings().kv_memory_gb)
    kv_allowance = {"verifier": kv_gb, "drafter": max(kv_gb / 4, 0.25)}
    report = []
    for c in deployment.containers:
        where = f"{c.workload}/{c.name}"
        assert c.peak_rss_bytes > 0, f"{where}: no memory sample"
        need = c.peak_rss_bytes + int(kv_allowance.get(c.name, 0.0) * 2**30)
        report.append(
            f"{c.name} peak {c.peak_rss_bytes / 2**20:.0f} MiB + KV -> {need / 2**20:.0f} MiB"
            f" of {c.memory_limit_bytes / 2**20:.0f} MiB"
        )
        assert need < c.memory_limit_bytes, f"{where} would outgrow its limit: {report[-1]}"
    print("memory: " + "; ".join(report))


def test_services_stop_within_their_grace_period(deployment: LocalDeployment) -> None:
    # Runs last in this module (pytest keeps file order): stops the deployment.
    results = deployment.stop()
    for name, (code, took, killed) in results.items():
        assert not killed, f"{name} ignored SIGTERM for its whole grace period"
        assert code in (0, -15), f"{name} exited {code} on SIGTERM"
        print(f"{name}: exit {code} after {took:.1f}s")
