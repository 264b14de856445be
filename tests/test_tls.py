"""Optional mutual TLS between services, with certificates from scripts/dev-ca.sh.

In-process: a scheduler server under mTLS answers a client holding a certificate from
the same CA, and refuses plaintext, a client without a certificate and one whose
certificate another CA signed. As processes: `adaserve up` with the TLS settings in
the environment runs every internal hop under mTLS and still serves the OpenAI API.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from adaserve.config import SchedulerSettings, TLSSettings
from adaserve.rpc.v1 import scheduler_pb2, scheduler_pb2_grpc
from adaserve.scheduler import LocalScheduler
from services.common import tls
from services.common.options import CLIENT_OPTIONS, channel
from services.common.server import BackgroundServer
from services.scheduler.client import GrpcScheduler
from services.scheduler.server import build_server
from tests._serving import REPO, TEST_CONFIG, Proc, free_port, make_served_model


def make_ca(out: Path, *names: str) -> Path:
    subprocess.run(
        ["bash", str(REPO / "scripts" / "dev-ca.sh"), str(out), *names],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return out


def settings_for(ca_dir: Path, name: str) -> TLSSettings:
    return TLSSettings(
        ca_file=str(ca_dir / "ca.crt"),
        cert_file=str(ca_dir / f"{name}.crt"),
        key_file=str(ca_dir / f"{name}.key"),
    )


@pytest.fixture(scope="module")
def cas(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tls")
    return make_ca(root / "ours", "scheduler", "verifier"), make_ca(root / "theirs", "verifier")


@pytest.fixture
def mtls_scheduler(cas: tuple[Path, Path]) -> Iterator[str]:
    ours, _ = cas
    tls.configure(settings_for(ours, "scheduler"))
    try:
        with BackgroundServer(lambda: build_server(SchedulerSettings(), "127.0.0.1", 0)) as s:
            yield s.address
    finally:
        tls.configure(None)


def _plan(ch: grpc.Channel) -> grpc.StatusCode:
    try:
        scheduler_pb2_grpc.SchedulerStub(ch).Plan(scheduler_pb2.PlanRequest(n=2), timeout=5)
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def test_mutual_tls_admits_only_certificates_from_the_ca(
    mtls_scheduler: str, cas: tuple[Path, Path]
) -> None:
    ours, theirs = cas
    tls.configure(settings_for(ours, "verifier"))  # the client side of this process
    with GrpcScheduler(mtls_scheduler) as client:
        assert client.plan(4) == LocalScheduler(SchedulerSettings()).plan(4)
    with channel(mtls_scheduler) as ch:
        assert _plan(ch) == grpc.StatusCode.OK
    with grpc.insecure_channel(mtls_scheduler) as ch:  # plaintext
        assert _plan(ch) == grpc.StatusCode.UNAVAILABLE
    ca = (ours / "ca.crt").read_bytes()
    no_cert = grpc.ssl_channel_credentials(root_certificates=ca)
    with grpc.secure_channel(mtls_scheduler, no_cert, options=CLIENT_OPTIONS) as ch:
        assert _plan(ch) == grpc.StatusCode.UNAVAILABLE
    foreign = grpc.ssl_channel_credentials(
        root_certificates=ca,
        private_key=(theirs / "verifier.key").read_bytes(),
        certificate_chain=(theirs / "verifier.crt").read_bytes(),
    )
    with grpc.secure_channel(mtls_scheduler, foreign, options=CLIENT_OPTIONS) as ch:
        assert _plan(ch) == grpc.StatusCode.UNAVAILABLE
    # A client that trusts another CA refuses our server.
    tls.configure(settings_for(theirs, "verifier"))
    with channel(mtls_scheduler) as ch:
        assert _plan(ch) == grpc.StatusCode.UNAVAILABLE


def test_incomplete_or_missing_files_fail_at_start_up(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="all of ca_file, cert_file and key_file"):
        TLSSettings(ca_file="ca.crt")
    with pytest.raises(FileNotFoundError, match=r"tls\.cert_file"):
        tls.configure(
            TLSSettings(ca_file=__file__, cert_file=str(tmp_path / "none.crt"), key_file=__file__)
        )
    assert tls.current() is None


@pytest.mark.slow  # four service processes
def test_adaserve_up_with_mutual_tls(cas: tuple[Path, Path], tmp_path: Path) -> None:
    ours, theirs = cas
    make_ca(ours, "adaserve")
    target = make_served_model(tmp_path / "target")
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(TEST_CONFIG)
    env = {
        "ADASERVE_TLS__CA_FILE": str(ours / "ca.crt"),
        "ADASERVE_TLS__CERT_FILE": str(ours / "adaserve.crt"),
        "ADASERVE_TLS__KEY_FILE": str(ours / "adaserve.key"),
    }
    port = free_port()
    args = f"up --port {port} --config {cfg} --log-dir {tmp_path / 'logs'}"
    args += f" --target {target} --drafter {target} --startup-timeout 240"
    proc = Proc(args.split(), tmp_path / "up.log", env)
    try:
        deadline = time.monotonic() + 240
        while "adaserve is up" not in proc.log_path.read_text(errors="replace"):
            proc.check_alive()
            assert time.monotonic() < deadline, proc.log()
            time.sleep(0.25)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        out = client.completions.create(model="target", prompt="abc", max_tokens=8)
        assert out.usage.completion_tokens >= 1
        logs = "".join(p.read_text() for p in (tmp_path / "logs").glob("*.log"))
        assert len(re.findall(r"on port \d+ \(mutual TLS\)", logs)) == 3  # all but the gateway
        assert re.search(r"Gateway on port \d+ \(plaintext\)", logs)  # the public front
        # The verifier refuses a plaintext peer and one from another CA.
        found = re.search(r"Verifier on port (\d+)", logs)
        assert found is not None, logs[-2000:]
        address = f"127.0.0.1:{found.group(1)}"
        for creds in (None, settings_for(theirs, "verifier")):
            ch = (
                grpc.insecure_channel(address)
                if creds is None
                else grpc.secure_channel(address, tls.channel_credentials(creds))
            )
            with ch, pytest.raises(grpc.RpcError) as info:
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        proc.stop()


def test_container_healthcheck_speaks_mutual_tls(
    mtls_scheduler: str, cas: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """docker/healthcheck.py (the images' HEALTHCHECK, and the exec probe to use under
    mTLS) reads the same TLS environment as the services."""
    sys.path.insert(0, str(REPO / "docker"))
    import healthcheck

    ours, _ = cas
    port = mtls_scheduler.rsplit(":", 1)[1]
    argv = ["--cmdline", f"adaserve scheduler --host 127.0.0.1 --port {port}"]
    assert healthcheck.main(argv) == 1  # plaintext is refused
    for key, value in {
        "CA_FILE": ours / "ca.crt",
        "CERT_FILE": ours / "verifier.crt",
        "KEY_FILE": ours / "verifier.key",
    }.items():
        monkeypatch.setenv(f"ADASERVE_TLS__{key}", str(value))
    assert healthcheck.main(argv) == 0
