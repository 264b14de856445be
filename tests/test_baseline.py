"""`slo.baseline_tpot_ms: auto`: the verifier times plain decoding on its own target, so
classes defined relative to the baseline follow the hardware."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from adaserve.config import Settings
from adaserve.engine import Engine
from adaserve.engine_build import build_engine
from adaserve.model.loader import load_runner
from adaserve.timing import BASELINE_BATCH as BATCH
from adaserve.timing import measure_baseline_ms
from tests._serving import make_served_model


def test_measure_baseline_leaves_no_state(tiny_llama_dir: Path):
    runner = load_runner(tiny_llama_dir, device="cpu", dtype="float32")
    free_before = (
        runner.cache.num_free_blocks() if hasattr(runner.cache, "num_free_blocks") else None
    )
    ms = measure_baseline_ms(runner, reps=3)
    assert math.isfinite(ms) and ms > 0
    assert not any(runner.has_sequence(f"__baseline{i}") for i in range(BATCH))
    if free_before is not None:
        assert runner.cache.num_free_blocks() == free_before
    assert runner.kv_usage() == 0.0


def test_auto_baseline_resolves_classes(tmp_path: Path):
    target = make_served_model(tmp_path / "target")
    settings = Settings(
        model={"target": str(target), "drafter": None, "device": "cpu", "dtype": "float32"},
        engine={"kv_memory_gb": 0.05},
        slo={
            "baseline_tpot_ms": "auto",
            "classes": {"tight": {"baseline_scale": 1.5}},
            "default_class": "tight",
        },
    )
    with pytest.raises(ValueError, match="auto"):
        settings.slo.resolve("tight")
    engine = build_engine(settings)
    baseline = engine.info().baseline_tpot_ms
    assert isinstance(baseline, float) and baseline > 0
    assert engine.settings.slo.resolve("tight") == pytest.approx(1.5 * baseline)


def test_a_small_kv_cache_measures_what_it_holds(tmp_path: Path):
    """engine.kv_blocks below what the startup measurements use (batch 8 x 96 tokens, a
    1k-token context probe): the engine still starts, measuring at the context it holds;
    a cache that holds nothing at all is a clear error naming the settings."""
    target = make_served_model(tmp_path / "target")
    base = {"target": str(target), "drafter": None, "device": "cpu", "dtype": "float32"}
    settings = Settings(
        model=base,
        engine={"kv_blocks": 40, "kv_block_size": 16},
        slo={"baseline_tpot_ms": "auto"},
    )
    engine = build_engine(settings)
    assert engine.info().baseline_tpot_ms > 0
    assert engine.target.kv_usage() == 0.0  # the measurements left nothing behind
    assert engine.settings.engine.latency_curve is not None
    assert max(engine.settings.engine.latency_curve.tokens) < 40 * 16
    tiny = settings.model_copy(
        update={"engine": settings.engine.model_copy(update={"kv_blocks": 4})}
    )
    with pytest.raises(ValueError, match=r"slo\.baseline_tpot_ms"):
        build_engine(tiny)


def test_engine_refuses_unmeasured_auto(tiny_llama_dir: Path):
    settings = Settings(slo={"baseline_tpot_ms": "auto"})
    with pytest.raises(ValueError, match="measured"):
        Engine(target=None, drafter=None, scheduler=None, settings=settings)  # type: ignore[arg-type]


def test_bad_baseline_value():
    with pytest.raises(ValueError):
        Settings(slo={"baseline_tpot_ms": "fast"})


def test_shipped_cpu_config_is_relative_to_the_measured_baseline():
    from adaserve.config import load_settings

    s = load_settings(Path(__file__).parents[1] / "configs" / "embedded-cpu.yaml")
    assert s.slo.baseline_tpot_ms == "auto"
    scales = {name: c.baseline_scale for name, c in s.slo.classes.items()}
    assert scales["coding"] < scales["chat"] < scales["summarize"]
    assert s.slo.default_class in s.slo.classes
