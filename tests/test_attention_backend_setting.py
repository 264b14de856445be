"""`model.attention_backend` (issue 23): what `auto` picks where, the startup errors for
a GPU backend that cannot run, the setting and its CLI flags, and the served path
passing it to the loader, logging it and exporting adaserve_attention_backend."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from prometheus_client import REGISTRY
from pydantic import ValidationError

from adaserve.config import ATTENTION_BACKEND_CHOICES, Settings, load_settings
from adaserve.model.attention_setting import (
    ATTENTION_BACKENDS,
    BackendUnavailable,
    make_backend,
    resolve_backend,
)

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
ROOT = Path(__file__).resolve().parents[1]


def importable(*modules: str):
    return lambda name: name in modules


@pytest.mark.parametrize(
    ("device", "present", "want"),
    [
        (CUDA, ("flashinfer", "triton"), "flashinfer"),
        (CUDA, ("triton",), "triton"),
        (CUDA, (), "reference"),
        (CPU, ("flashinfer", "triton"), "reference"),  # GPU kernels never run on a CPU
        (CPU, (), "reference"),
    ],
)
def test_auto_picks_flashinfer_then_triton_on_cuda_else_reference(device, present, want) -> None:
    assert resolve_backend("auto", device, importable(*present)) == want


def test_explicit_backends_are_kept_where_they_can_run() -> None:
    both = importable("flashinfer", "triton")
    assert resolve_backend("triton", CUDA, both) == "triton"
    assert resolve_backend("flashinfer", CUDA, both) == "flashinfer"
    assert resolve_backend("reference", CUDA, both) == "reference"
    assert resolve_backend("reference", CPU, both) == "reference"


@pytest.mark.parametrize(
    ("name", "device", "present", "says"),
    [
        ("triton", CPU, ("triton",), "needs a CUDA device"),
        ("flashinfer", CPU, ("flashinfer",), "needs a CUDA device"),
        ("triton", CUDA, (), "triton package does not import"),
        ("flashinfer", CUDA, ("triton",), "flashinfer package does not import"),
        ("xformers", CUDA, (), "unknown attention backend"),
    ],
)
def test_a_backend_that_cannot_run_is_a_clear_error_naming_the_setting(
    name, device, present, says, monkeypatch
) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(BackendUnavailable, match=says) as err:
        resolve_backend(name, device, importable(*present))
    assert "model.attention_backend" in str(err.value)
    assert isinstance(err.value, ValueError)  # the services print ValueErrors, no traceback


def test_make_backend_on_cpu() -> None:
    assert make_backend("auto", 4, 2, 8, CPU).name == "reference"
    with pytest.raises(BackendUnavailable, match=r"model\.attention_backend"):
        make_backend("flashinfer", 4, 2, 8, CPU)


def test_setting_is_validated_and_read_from_yaml_and_env(tmp_path, monkeypatch) -> None:
    assert Settings().model.attention_backend == "auto"
    assert ATTENTION_BACKEND_CHOICES == ATTENTION_BACKENDS
    with pytest.raises(ValidationError, match="attention_backend"):
        Settings(model={"attention_backend": "xformers"})  # pyright: ignore[reportArgumentType]
    cfg = tmp_path / "s.yaml"
    cfg.write_text("model:\n  attention_backend: reference\n")
    assert load_settings(cfg).model.attention_backend == "reference"
    monkeypatch.setenv("ADASERVE_MODEL__ATTENTION_BACKEND", "triton")
    assert load_settings(cfg).model.attention_backend == "triton"


def test_gpu_overlay_sets_it() -> None:
    import yaml

    data = yaml.safe_load((ROOT / "k8s/overlays/gpu/adaserve.yaml").read_text())
    assert data["model"]["attention_backend"] == "auto"
    assert Settings(**data).model.attention_backend == "auto"


def test_loader_refuses_before_loading_weights(tmp_path) -> None:
    from adaserve.model.loader import load_runner

    # No model directory at all: the backend check comes first, so that is not what fails.
    with pytest.raises(BackendUnavailable, match=r"model\.attention_backend is 'triton'"):
        load_runner(tmp_path / "missing", device="cpu", attention_backend="triton")


def _backend_gauge(role: str) -> dict[str, float]:
    out = {}
    for metric in REGISTRY.collect():
        if metric.name == "adaserve_attention_backend":
            for s in metric.samples:
                if s.labels["role"] == role:
                    out[s.labels["backend"]] = s.value
    return out


def test_served_path_passes_the_setting_logs_and_exports_it(tmp_path, caplog) -> None:
    """build_engine (the verifier's, `generate`'s and `up --all-in-one`'s path) loads
    target and in-process drafter with the setting, logs the choice and sets the gauge."""
    from adaserve.engine_build import build_engine
    from tests._serving import make_served_model

    tiny_llama_dir = make_served_model(tmp_path / "served")

    settings = load_settings(
        None,
        model={
            "target": str(tiny_llama_dir),
            "drafter": str(tiny_llama_dir),
            "device": "cpu",
            "attention_backend": "reference",
        },
        engine={"kv_memory_gb": 0.01},
    )
    with caplog.at_level("INFO"):
        engine = build_engine(settings)
    assert engine.target.runner.backend.name == "reference"  # pyright: ignore[reportAttributeAccessIssue]
    assert _backend_gauge("target").get("reference") == 1.0
    assert _backend_gauge("drafter").get("reference") == 1.0
    assert "target attention backend: reference" in caplog.text
    assert "drafter attention backend: reference" in caplog.text

    bad = settings.model_copy(
        update={"model": settings.model.model_copy(update={"attention_backend": "flashinfer"})}
    )
    with pytest.raises(BackendUnavailable, match=r"model\.attention_backend is 'flashinfer'"):
        build_engine(bad)


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(
        [sys.executable, "-m", "adaserve", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
    )


@pytest.mark.parametrize("service", ["verifier", "drafter"])
def test_service_flag_for_an_unavailable_backend_fails_at_startup_without_traceback(
    service, tiny_llama_dir
) -> None:
    model = ["--target", str(tiny_llama_dir), "--drafter", "none", "--metrics-port", "0"]
    if service == "drafter":
        model = ["--model", str(tiny_llama_dir), "--device", "cpu"]
    res = _cli(service, "--port", "0", "--attention-backend", "triton", *model)
    assert res.returncode != 0
    assert "model.attention_backend is 'triton'" in res.stderr
    assert "Traceback" not in res.stderr


def test_cli_flag_rejects_an_unknown_backend() -> None:
    res = _cli("generate", "--attention-backend", "xformers", "--prompt", "hi")
    assert res.returncode == 2
    assert "invalid choice" in res.stderr


def test_up_passes_the_flag_to_model_processes_only(tmp_path) -> None:
    import argparse

    from adaserve.commands import up

    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    args = parser.parse_args(["--attention-backend", "reference"])
    services = up.plan(args, tmp_path)
    for s in services:
        has = "--attention-backend" in s.args
        assert has == s.name.startswith(("verifier", "drafter")), s.name
    assert any(s.name.startswith("drafter") for s in services)


def test_flashinfer_is_built_for_the_cache_block_size_and_dtype(monkeypatch) -> None:
    """FlashInfer reads the cache as pages: it must get the cache's page size and dtype
    (it used to assume 16 and bf16 whatever the KV cache was)."""
    import adaserve.model.attention_flashinfer as fi
    import adaserve.model.attention_setting as attention_setting

    built = {}

    class Fake:
        name = "flashinfer"

        def __init__(self, heads, kv_heads, head_dim, device, block_size, dtype) -> None:
            built.update(block_size=block_size, dtype=dtype)

    monkeypatch.setattr(attention_setting, "resolve_backend", lambda name, device: "flashinfer")
    monkeypatch.setattr(fi, "FlashInferBackend", Fake)
    make_backend("auto", 4, 2, 8, CUDA, block_size=32, dtype=torch.float16)
    assert built == {"block_size": 32, "dtype": torch.float16}


def test_drafter_service_reports_a_bad_setting_without_traceback(tmp_path) -> None:
    cfg = tmp_path / "s.yaml"
    cfg.write_text("model:\n  attention_backend: xformers\n")
    res = _cli("drafter", "--port", "0", "--model", str(tmp_path), "--config", str(cfg))
    assert res.returncode == 2
    assert "attention_backend" in res.stderr
    assert "Traceback" not in res.stderr
