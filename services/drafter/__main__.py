"""`adaserve drafter --host H --port P --model PATH [--device D] [--config FILE]`:
the draft model behind the Drafter gRPC service."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from adaserve.config import ATTENTION_BACKEND_CHOICES
from services.common import logs

if TYPE_CHECKING:
    from adaserve.config import Settings
    from adaserve.drafter import Drafter


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="0.0.0.0", help="interface to listen on")
    parser.add_argument("--port", type=int, default=50052, help="0 picks a free port")
    parser.add_argument(
        "--model",
        help="drafter: a draft model or an EAGLE head (HF directory, .gguf, 'embedded' or "
        "'embedded-eagle'; default: settings)",
    )
    parser.add_argument("--device", help="cpu, cuda, cuda:N or auto (default: settings)")
    parser.add_argument("--dtype", help="auto, float32, bfloat16 or float16 (default: settings)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument(
        "--attention-backend",
        choices=ATTENTION_BACKEND_CHOICES,
        help="model.attention_backend (default: settings)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="Prometheus endpoint (http://HOST:PORT/metrics: the attention backend); 0: none",
    )
    parser.add_argument("--config", default=None, help="YAML settings file")
    logs.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    # Before torch and transformers are imported: progress bars are decided at import.
    logs.configure(args.log_level, args.log_format)
    from services.common.ports import PortInUse, check_free

    try:  # before the model loads: a clash is reported at once
        check_free(args.host, args.port, "--port N")
        if args.metrics_port > 0:
            check_free(args.host, args.metrics_port, "--metrics-port N (0: none)")
    except PortInUse as exc:
        print(f"adaserve drafter: {exc}", file=sys.stderr)
        return 2
    # Imported here so `adaserve drafter --help` never pays for torch.
    from adaserve.config import load_settings
    from adaserve.model.eagle import is_eagle_dir
    from adaserve.model.embedded import resolve_model
    from adaserve.torch_thread import torch_thread
    from services.common import tls
    from services.common.server import run_until_signal
    from services.drafter.server import build_server

    try:  # a bad settings file or ADASERVE_* value is the user's to fix: no traceback
        settings = load_settings(args.config)
        tls.configure(settings.tls)
    except (OSError, ValueError) as exc:
        print(f"adaserve drafter: {exc}", file=sys.stderr)
        return 2
    model = args.model or settings.model.drafter
    if not model:
        print("adaserve drafter: no model (pass --model PATH)", file=sys.stderr)
        return 2
    # Load, warm up and compute on one thread (adaserve/torch_thread.py).
    worker = torch_thread("drafter")
    try:
        if is_eagle_dir(resolve_model(model, role="drafter")):
            drafter = worker.submit(_eagle, model, args, settings).result()
        else:
            drafter = worker.submit(_beam, model, args, settings).result()
    except (OSError, ValueError) as exc:  # missing or unsupported model: say so, no traceback
        print(f"adaserve drafter: {exc}", file=sys.stderr)
        worker.shutdown(wait=False)
        return 2
    if args.metrics_port > 0:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port, addr=args.host)
    drain_s = settings.fleet.drain_timeout_s
    return run_until_signal(
        lambda: build_server(drafter, args.host, args.port, worker=worker, drain_timeout_s=drain_s)
    )


def _eagle(model: str, args: argparse.Namespace, settings: Settings) -> Drafter:
    """An EAGLE head (adaserve/model/eagle.py), with the flags over the settings."""
    import torch

    from adaserve.engine_build import build_eagle_drafter
    from adaserve.model.embedded import resolve_model

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    flags = {
        "device": args.device,
        "dtype": args.dtype,
        "attention_backend": args.attention_backend,
    }
    ms = settings.model.model_copy(update={k: v for k, v in flags.items() if v})
    settings = settings.model_copy(update={"model": ms})
    return build_eagle_drafter(settings, resolve_model(model, role="drafter"))


def _beam(model: str, args: argparse.Namespace, settings: Settings) -> Drafter:
    """A draft model behind beam search."""
    from adaserve.engine_build import report_backend, report_quantization
    from adaserve.model.loader import load_runner
    from adaserve.speculate import BeamDrafter

    ms = settings.model
    runner = load_runner(
        model,
        device=args.device or ms.device,
        dtype=args.dtype or ms.dtype,
        role="drafter",
        kv_block_size=settings.engine.kv_block_size,
        # The draft model is small and keeps only committed KV: a quarter of the
        # target's KV memory holds as many tokens.
        kv_memory_gb=max(settings.engine.kv_memory_gb / 4, 0.25),
        max_model_len=settings.engine.max_model_len,
        threads=args.threads,
        quantization=ms.drafter_quantization,
        stored_activations=ms.stored_activations,
        cpu_kernel=ms.cpu_kernel,
        prefix_caching=settings.engine.prefix_caching,
        attention_backend=args.attention_backend or ms.attention_backend,
    )
    report_backend("drafter", runner)
    report_quantization("drafter", runner)  # the separate layout's drafter exports it too
    return BeamDrafter(runner)


if __name__ == "__main__":
    from adaserve.cli import main

    raise SystemExit(main(["drafter", *sys.argv[1:]]))
