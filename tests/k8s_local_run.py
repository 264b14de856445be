"""Render the Kubernetes overlays and run a rendered deployment as local processes.

`render(overlay)` is `kubectl kustomize k8s/overlays/<overlay>` parsed into documents.
`LocalDeployment` takes the rendered workloads' containers and starts each one's exact
command, args and environment on localhost: Service DNS names become 127.0.0.1, every
container port gets a free loopback port, mounted ConfigMaps become files. What the
cluster would run is what the test runs; only addresses and paths are translated.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "k8s"
OVERLAYS = ("cpu-demo", "gpu", "gpu-autoscale")
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet", "Job")


class RenderError(RuntimeError):
    pass


def kubectl() -> str | None:
    return shutil.which("kubectl")


def render(overlay: str) -> list[dict[str, Any]]:
    """The overlay's rendered documents (kubectl's built-in kustomize)."""
    exe = kubectl()
    if exe is None:
        raise RenderError("kubectl not found on PATH")
    result = subprocess.run(
        [exe, "kustomize", str(K8S / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if result.returncode != 0:
        raise RenderError(f"kubectl kustomize {overlay} failed:\n{result.stderr}")
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    for doc in docs:
        if doc["kind"] == kind and doc["metadata"]["name"] == name:
            return doc
    raise KeyError(f"no {kind}/{name} in the rendered documents")


def workloads(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] in WORKLOAD_KINDS]


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


def pod_labels(workload: dict[str, Any]) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"].get("labels", {})


def all_containers(workload: dict[str, Any]) -> list[dict[str, Any]]:
    spec = pod_spec(workload)
    return list(spec.get("initContainers", [])) + list(spec["containers"])


def argv(container: dict[str, Any]) -> list[str]:
    return list(container.get("command", [])) + list(container.get("args", []))


def flag(args: list[str], name: str) -> str | None:
    """The value of `--name=value` or `--name value` (last one wins, as argparse)."""
    value = None
    for i, arg in enumerate(args):
        if arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
        elif arg == name and i + 1 < len(args):
            value = args[i + 1]
    return value


def config_yaml(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """The settings file carried by the adaserve-config ConfigMap."""
    maps = [
        d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].startswith("adaserve-config")
    ]
    if len(maps) != 1:
        raise KeyError(f"expected one adaserve-config ConfigMap, found {len(maps)}")
    return yaml.safe_load(maps[0]["data"]["adaserve.yaml"])


# ---------------------------------------------------------------------------------------
# Dockerfiles (the image half of what a container runs)


@dataclass(frozen=True)
class Instruction:
    stage: int  # index of the FROM it belongs to
    keyword: str
    args: str
    line: int


def parse_dockerfile(path: Path) -> list[Instruction]:
    """Instructions with line continuations joined and comments dropped."""
    out: list[Instruction] = []
    stage = -1
    pending, start = "", 0
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # comment lines inside a continued instruction
        if not pending:
            start = number
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        text = pending + line
        pending = ""
        keyword, _, args = text.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            stage += 1
        out.append(Instruction(stage, keyword, args.strip(), start))
    assert not pending, f"{path}: dangling line continuation"
    return out


def final_stage(instrs: list[Instruction]) -> list[Instruction]:
    last = max(i.stage for i in instrs)
    return [i for i in instrs if i.stage == last]


def image_env(dockerfile: Path) -> dict[str, str]:
    """The ENV the final stage sets (as the container starts with it), $VARs unexpanded."""
    env: dict[str, str] = {}
    for i in final_stage(parse_dockerfile(dockerfile)):
        if i.keyword == "ENV":
            for word in shlex.split(i.args):
                key, _, value = word.partition("=")
                env[key] = value
    return env


# ---------------------------------------------------------------------------------------
# Running a rendered deployment as local processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LocalContainer:
    """One rendered container, translated to a local process."""

    workload: str
    name: str
    argv: list[str]
    env: dict[str, str]
    ports: dict[int, int]  # container port -> local port
    memory_limit_bytes: int | None
    spec: dict[str, Any] = field(default_factory=dict)  # the rendered container
    grace_s: float = 30.0  # the pod's terminationGracePeriodSeconds
    proc: subprocess.Popen | None = None
    log_path: Path | None = None
    peak_rss_bytes: int = 0

    def log_tail(self, n: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])


@dataclass
class LocalDeployment:
    """The rendered workloads of an overlay as processes on 127.0.0.1.

    Translation rules, and nothing else changes:
    - the container command's `adaserve` runs as `python -m adaserve.cli` of this
      interpreter (the image's entry point is the same console script);
    - every containerPort gets a free local port, in the process's own flags and in any
      other container's `<service-dns-name>:<port>` or `127.0.0.1:<port>` argument
      (Service names resolve to the local port of the container behind the Service);
    - the environment is the image's ENV plus the container's env; paths in it that
      point into volume mounts or into `image_paths` (the image's own directories, e.g.
      its model cache and HOME) are redirected to local directories: mounted ConfigMaps
      are written out, emptyDirs become empty directories.
    """

    docs: list[dict[str, Any]]
    workdir: Path
    image_env: dict[str, str] = field(default_factory=dict)
    image_paths: dict[str, Path] = field(default_factory=dict)  # image dir -> local dir
    extra_env: dict[str, str] = field(default_factory=dict)
    containers: list[LocalContainer] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._plan()

    # -- planning -------------------------------------------------------------------

    def _plan(self) -> None:
        port_map: dict[tuple[str, int], int] = {}  # (workload, container port) -> local
        for wl in workloads(self.docs):
            for c in all_containers(wl):
                for p in c.get("ports", []):
                    port_map[(wl["metadata"]["name"], p["containerPort"])] = free_port()
        dns = self._service_dns(port_map)
        for wl in workloads(self.docs):
            wl_name = wl["metadata"]["name"]
            mounts = self._materialize_volumes(wl)
            for c in all_containers(wl):
                local_ports = {
                    p["containerPort"]: port_map[(wl_name, p["containerPort"])]
                    for p in c.get("ports", [])
                }
                own = {
                    port: local
                    for (name, port), local in port_map.items()
                    if name == wl_name  # same pod: loopback reaches every container
                }
                args = [self._translate(a, own, dns) for a in argv(c)]
                env = self._env(c, mounts)
                self.containers.append(
                    LocalContainer(
                        workload=wl_name,
                        name=c["name"],
                        argv=args,
                        env=env,
                        ports=local_ports,
                        memory_limit_bytes=parse_quantity(
                            c.get("resources", {}).get("limits", {}).get("memory")
                        ),
                        spec=c,
                        grace_s=float(pod_spec(wl).get("terminationGracePeriodSeconds", 30)),
                    )
                )

    def _service_dns(self, port_map: dict[tuple[str, int], int]) -> dict[str, int]:
        """`<service>:<port>` -> local port of the container the Service targets."""
        out: dict[str, int] = {}
        for svc in by_kind(self.docs, "Service"):
            selector = svc["spec"].get("selector", {})
            targets = [
                wl
                for wl in workloads(self.docs)
                if selector and selector.items() <= pod_labels(wl).items()
            ]
            for port in svc["spec"]["ports"]:
                for wl in targets:
                    container_port = resolve_target_port(wl, port)
                    if container_port is None:
                        continue
                    local = port_map[(wl["metadata"]["name"], container_port)]
                    name = svc["metadata"]["name"]
                    ns = svc["metadata"].get("namespace", "default")
                    for host in (name, f"{name}.{ns}", f"{name}.{ns}.svc.cluster.local"):
                        out[f"{host}:{port['port']}"] = local
        return out

    @staticmethod
    def _translate(arg: str, own: dict[int, int], dns: dict[str, int]) -> str:
        # `--flag=host:port`, `host:port`, `--port=N` and bare port numbers after a
        # port flag are the only address forms the manifests use.
        prefix, sep, value = arg.partition("=") if arg.startswith("--") else ("", "", arg)
        if value in dns:
            value = f"127.0.0.1:{dns[value]}"
        else:
            m = re.fullmatch(r"(127\.0\.0\.1|localhost):(\d+)", value)
            if m and int(m.group(2)) in own:
                value = f"127.0.0.1:{own[int(m.group(2))]}"
            elif prefix.endswith("port") and value.isdigit() and int(value) in own:
                value = str(own[int(value)])
            elif prefix == "--host" and value in ("0.0.0.0", "::"):
                value = "127.0.0.1"  # never listen on the test machine's network
        return f"{prefix}{sep}{value}" if sep else value

    def _materialize_volumes(self, wl: dict[str, Any]) -> dict[str, Path]:
        """Container mount path -> local directory holding the volume's content."""
        volumes = {v["name"]: v for v in pod_spec(wl).get("volumes", [])}
        mounts: dict[str, Path] = {}
        for c in all_containers(wl):
            for m in c.get("volumeMounts", []):
                vol = volumes[m["name"]]
                local = self.workdir / wl["metadata"]["name"] / m["name"]
                if not local.exists():
                    local.mkdir(parents=True)
                    if "configMap" in vol:
                        cm = find(self.docs, "ConfigMap", vol["configMap"]["name"])
                        for key, text in cm.get("data", {}).items():
                            (local / key).write_text(text)
                mounts[m["mountPath"]] = local
        return mounts

    def _env(self, c: dict[str, Any], mounts: dict[str, Path]) -> dict[str, str]:
        """Host basics, then the image's ENV, then the container's env, with every
        container path translated to its local stand-in."""
        paths = {**self.image_paths, **mounts}  # volume mounts shadow image directories

        def local(value: str) -> str:
            for prefix in sorted(paths, key=len, reverse=True):
                root = prefix.rstrip("/")
                if value == root or value.startswith(root + "/"):
                    return str(paths[prefix]) + value[len(root) :]
            return value

        keep = ("PATH", "LANG", "LC_ALL", "SYSTEMROOT")
        env = {k: v for k, v in os.environ.items() if k in keep}
        for key, value in self.image_env.items():
            if key not in ("PATH", "VIRTUAL_ENV"):  # the venv is this interpreter's
                env[key] = local(value)
        for item in c.get("env", []):
            if "value" in item:
                env[item["name"]] = local(item["value"])
            # valueFrom (optional Secrets) stays unset, as in a cluster without them.
        if "/tmp" in mounts:
            env["TMPDIR"] = str(mounts["/tmp"])  # the container's /tmp is an emptyDir
        env.update(self.extra_env)
        return env

    # -- running --------------------------------------------------------------------

    def local_port(self, workload: str, container_port: int) -> int:
        for c in self.containers:
            if c.workload == workload and container_port in c.ports:
                return c.ports[container_port]
        raise KeyError(f"{workload} has no container port {container_port}")

    def start(self) -> None:
        for c in self.containers:
            if c.argv[:1] != ["adaserve"]:
                raise ValueError(f"{c.workload}/{c.name}: command is not adaserve: {c.argv}")
            c.log_path = self.workdir / f"{c.workload}-{c.name}.log"
            with open(c.log_path, "wb") as log:
                c.proc = subprocess.Popen(
                    [sys.executable, "-m", "adaserve.cli", *c.argv[1:]],
                    env=c.env,
                    cwd=self.workdir,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )

    def sample_rss(self) -> None:
        for c in self.containers:
            if c.proc is not None and c.proc.poll() is None:
                c.peak_rss_bytes = max(c.peak_rss_bytes, tree_rss_bytes(c.proc.pid))

    def dead(self) -> list[LocalContainer]:
        return [c for c in self.containers if c.proc is not None and c.proc.poll() is not None]

    def stop(self) -> dict[str, tuple[int | None, float, bool]]:
        """SIGTERM every process, as the kubelet does, then SIGKILL whatever outlives its
        pod's grace period. Returns name -> (exit code, seconds to exit, was killed)."""
        t0 = time.monotonic()
        for c in self.containers:
            if c.proc is not None and c.proc.poll() is None:
                c.proc.terminate()
        out: dict[str, tuple[int | None, float, bool]] = {}
        for c in self.containers:
            if c.proc is None:
                continue
            killed = False
            try:
                c.proc.wait(timeout=max(0.1, c.grace_s - (time.monotonic() - t0)))
            except subprocess.TimeoutExpired:
                killed = True
            took = time.monotonic() - t0
            with contextlib.suppress(ProcessLookupError):
                os.killpg(c.proc.pid, signal.SIGKILL)  # and any children (TP ranks)
            c.proc.wait(timeout=10)
            out[f"{c.workload}/{c.name}"] = (c.proc.returncode, took, killed)
        return out


def resolve_target_port(wl: dict[str, Any], svc_port: dict[str, Any]) -> int | None:
    """The container port a Service port reaches on `wl`'s pods (by name or number)."""
    target = svc_port.get("targetPort", svc_port["port"])
    for c in all_containers(wl):
        for p in c.get("ports", []):
            if target in (p.get("name"), p["containerPort"]):
                return p["containerPort"]
    return None


_UNITS = {
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
}


def parse_quantity(q: str | int | None) -> int | None:
    """Kubernetes memory quantity -> bytes (`512Mi`, `2Gi`, `1G`, `1000`)."""
    if q is None:
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT]i?|k)?", str(q))
    if not m:
        raise ValueError(f"unsupported quantity {q!r}")
    return int(float(m.group(1)) * _UNITS.get(m.group(2) or "", 1))


def parse_cpu(q: str | int | float) -> float:
    """Kubernetes CPU quantity -> cores (`250m`, `2`, `0.5`)."""
    text = str(q)
    return int(text[:-1]) / 1000 if text.endswith("m") else float(text)


def tree_rss_bytes(pid: int) -> int:
    """Peak resident memory of a process and its live descendants, summed: an upper
    bound of what the container's cgroup saw."""
    total = 0
    for p in [pid, *_descendants(pid)]:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):  # peak resident set size
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


def _descendants(pid: int) -> Iterator[int]:
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return
    for child in map(int, children):
        yield child
        yield from _descendants(child)


def make_workdir() -> Path:
    return Path(tempfile.mkdtemp(prefix="adaserve-k8s-local-"))
