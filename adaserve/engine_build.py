"""Assemble an Engine from settings: the one place that decides what runs in-process.

`generate`, `up --all-in-one` and the verifier service all build their engine here, so
the same engine code runs every way. The core has no transport code: a drafter or
scheduler reached over the network (`services.drafter`, `services.scheduler` set to an
address) comes from the client factory the caller passes in;
`services/verifier/wiring.py` passes the gRPC ones.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from adaserve import cpu_load, metrics
from adaserve.calibration import Baseline, Remeasure
from adaserve.config import SchedulerSettings, Settings
from adaserve.drafter import Drafter
from adaserve.engine import Engine
from adaserve.ngram import NgramDrafter, NgramParams
from adaserve.runner_target import RunnerTarget
from adaserve.scheduler import LocalScheduler, Scheduler
from adaserve.speculate import BeamDrafter

log = logging.getLogger("adaserve.engine")

# (address, timeout_s) -> a Drafter served by another process
DrafterClient = Callable[[str, float], Drafter]
# (address, settings, timeout_s) -> a Scheduler served by another process
SchedulerClient = Callable[[str, SchedulerSettings, float], Scheduler]


def build_engine(
    settings: Settings,
    *,
    drafter_client: DrafterClient | None = None,
    scheduler_client: SchedulerClient | None = None,
) -> Engine:
    from adaserve.model.embedded import resolve_model
    from adaserve.model.loader import load_runner, load_tokenizer

    ms = settings.model
    target_dir = resolve_model(ms.target)
    runner = load_runner(
        target_dir,
        device=ms.device,
        dtype=ms.dtype,
        tp=ms.tp,
        kv_memory_gb=settings.engine.kv_memory_gb,
        kv_blocks=settings.engine.kv_blocks,
        kv_block_size=settings.engine.kv_block_size,
        max_model_len=settings.engine.max_model_len,
        quantization=ms.quantization,
        stored_activations=ms.stored_activations,
        cpu_kernel=ms.cpu_kernel,
        prefix_caching=settings.engine.prefix_caching,
        attention_backend=ms.attention_backend,
    )
    report_backend("target", runner)
    quantization = report_quantization("target", runner)
    tokenizer = load_tokenizer(target_dir)
    baseline, remeasure = None, None
    if settings.slo.baseline_tpot_ms == "auto":
        baseline, remeasure = _measure(runner, curve=settings.engine.latency_curve is None)
        slo = settings.slo.model_copy(update={"baseline_tpot_ms": baseline.tpot_ms})
        settings = settings.model_copy(update={"slo": slo})
        if remeasure.curve is not None:
            engine = settings.engine.model_copy(update={"latency_curve": remeasure.curve()})
            settings = settings.model_copy(update={"engine": engine})
    target = RunnerTarget(runner, eos_token_ids(tokenizer, runner))
    speculate = settings.engine.speculation
    return Engine(
        target=target,
        drafter=build_drafter(settings, drafter_client) if speculate else None,
        scheduler=build_scheduler(settings, scheduler_client),
        settings=settings,
        tokenizer=tokenizer,
        model_name=served_name(settings, target_dir),
        quantization=quantization,
        ngram=build_ngram(settings) if speculate else None,
        baseline=baseline,
        remeasure=remeasure,
    )


def _measure(runner: Any, curve: bool) -> tuple[Baseline, Remeasure]:
    """`slo.baseline_tpot_ms: auto`: the baseline timed on `runner` now, and how the
    engine times it (and, with `curve`, the forward latency curve) again while a
    baseline measured on a busy host is unsettled (adaserve/calibration.py)."""
    from adaserve.config import LatencyCurve
    from adaserve.timing import measure_baseline_ms, measure_forward_curve

    def forward_curve() -> LatencyCurve:
        tokens, ms, context_ms = measure_forward_curve(runner)
        log.info(
            "forward latency measured: %s; +%.3f ms per 1k pairs of prompt context",
            ", ".join(f"{t:g} tokens {m:.1f} ms" for t, m in zip(tokens, ms, strict=True)),
            context_ms,
        )
        return LatencyCurve(tokens=tokens, ms=ms, context_ms=context_ms)

    def baseline_ms() -> float:
        return round(measure_baseline_ms(runner), 2)

    baseline = Baseline.measured(baseline_ms(), cpu_load.current())
    log.info(
        "baseline TPOT (plain decoding, batch 8) measured: %.2f ms (load %.1f on %d cores); "
        "measured again once idle, and a faster result replaces it",
        baseline.tpot_ms,
        baseline.load_1m,
        baseline.cores,
    )
    return baseline, Remeasure(baseline_ms, forward_curve if curve else None)


def build_ngram(settings: Settings) -> NgramDrafter | None:
    """The n-gram drafter (in the verifier's process, always), unless switched off."""
    ng = settings.speculation.ngram
    if not ng.enabled:
        return None
    return NgramDrafter(
        NgramParams(
            min_n=ng.min_n,
            max_n=ng.max_n,
            max_matches=ng.max_matches,
            prior_count=ng.prior_count,
            length_power=ng.length_power,
        )
    )


def build_drafter(
    settings: Settings, drafter_client: DrafterClient | None = None
) -> Drafter | None:
    """The drafter service at `services.drafter` (through `drafter_client`), else an
    in-process BeamDrafter over `model.drafter`, else None (no speculation)."""
    address = settings.services.drafter
    if address:
        if drafter_client is None:
            raise ValueError(_no_transport("drafter", address))
        return drafter_client(address, settings.engine.speculation_timeout_ms / 1000.0)
    ms = settings.model
    if not ms.drafter or ms.drafter == "none":
        return None
    from adaserve.model.eagle import is_eagle_dir
    from adaserve.model.embedded import resolve_model
    from adaserve.model.loader import load_runner

    path = resolve_model(ms.drafter, role="drafter")
    if is_eagle_dir(path):
        return build_eagle_drafter(settings, path)
    runner = load_runner(
        path,
        device=ms.device,
        dtype=ms.dtype,
        role="drafter",
        tp=1,
        kv_memory_gb=max(settings.engine.kv_memory_gb / 4, 0.25),
        kv_block_size=settings.engine.kv_block_size,
        max_model_len=settings.engine.max_model_len,
        quantization=ms.drafter_quantization,
        stored_activations=ms.stored_activations,
        cpu_kernel=ms.cpu_kernel,
        prefix_caching=settings.engine.prefix_caching,
        attention_backend=ms.attention_backend,
    )
    report_backend("drafter", runner)
    report_quantization("drafter", runner)
    return BeamDrafter(runner)


def build_eagle_drafter(settings: Settings, path: Path) -> Drafter:
    """An in-process EagleDrafter over the head in `path` (adaserve/model/eagle.py)."""
    from adaserve.eagle_drafter import EagleDrafter
    from adaserve.model.build import resolve_device, resolve_dtype
    from adaserve.model.eagle import load_eagle_runner

    ms = settings.model
    device = resolve_device(ms.device)
    runner = load_eagle_runner(
        path,
        device,
        resolve_dtype(ms.dtype, device),
        kv_memory_gb=max(settings.engine.kv_memory_gb / 4, 0.25),
        kv_block_size=settings.engine.kv_block_size,
        max_model_len=settings.engine.max_model_len,
        cpu_kernel=ms.cpu_kernel,
        prefix_caching=settings.engine.prefix_caching,
        attention_backend=ms.attention_backend,
    )
    report_backend("drafter", runner)
    return EagleDrafter(runner)


def report_backend(role: str, runner) -> str:
    """Log the attention backend `runner` runs and export it as
    adaserve_attention_backend{role, backend} = 1; returns its name."""
    name = runner.backend.name
    log.info("%s attention backend: %s", role, name)
    metrics.attention_backend.labels(role=role, backend=name).set(1)
    return name


def report_quantization(role: str, runner) -> str:
    """Log what `runner`'s weights run as (model.quantization, decided) and export it as
    adaserve_model_quantization{role, quantization} = 1; returns it."""
    name = getattr(runner, "quantization", "none")  # a TPRunner: none (stored is tp 1)
    formats = getattr(runner, "weight_formats", {})
    detail = (
        f" ({', '.join(f'{n} {f}' for f, n in sorted(formats.items()))} layers)" if formats else ""
    )
    log.info("%s weights: %s%s", role, name, detail)
    metrics.model_quantization.labels(role=role, quantization=name).set(1)
    return name


def build_scheduler(
    settings: Settings, scheduler_client: SchedulerClient | None = None
) -> Scheduler:
    """The scheduler service at `services.scheduler` (through `scheduler_client`), else
    in-process selection."""
    address = settings.services.scheduler
    if address:
        if scheduler_client is None:
            raise ValueError(_no_transport("scheduler", address))
        return scheduler_client(
            address, settings.scheduler, settings.engine.scheduler_timeout_ms / 1000.0
        )
    return LocalScheduler(settings.scheduler)


def _no_transport(service: str, address: str) -> str:
    return (
        f"services.{service} is {address!r} but this entry point has no transport for it: "
        "build the engine through services.verifier.wiring (the gRPC clients)"
    )


def eos_token_ids(tokenizer, runner) -> tuple[int, ...]:
    ids: set[int] = set(getattr(runner.config, "eos_token_ids", ()) or ())
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(ids))


def served_name(settings: Settings, target_dir: Path) -> str:
    if settings.model.served_name:
        return settings.model.served_name
    if settings.model.target == "embedded":
        return "SmolLM2-135M-Instruct"
    return Path(target_dir).name
