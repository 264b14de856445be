"""`adaserve verifier`: one serving unit (the target model and the engine loop).

    adaserve verifier --host H --port P --target PATH [--tp N]
                      [--drafter PATH | --drafter-address H:P] [--scheduler-address H:P]

No drafter address: an in-process drafter from `--drafter PATH` (or from the settings
file), otherwise no speculation. No scheduler address: in-process selection.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from adaserve.config import ATTENTION_BACKEND_CHOICES, Settings, load_settings
from services.common import logs

# The engine's Prometheus port. Fixed, so a scrape config can name it; `adaserve up`
# gives unit k DEFAULT_METRICS_PORT + k.
DEFAULT_METRICS_PORT = 9400

log = logging.getLogger("adaserve.verifier")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="0.0.0.0", help="interface to listen on")
    parser.add_argument("--port", type=int, default=50053, help="0 picks a free port")
    parser.add_argument("--target", help="target model: HF directory, .gguf or 'embedded'")
    parser.add_argument(
        "--drafter",
        help="in-process drafter: a draft model or an EAGLE head (PATH, 'embedded', "
        "'embedded-eagle' or 'none')",
    )
    parser.add_argument("--drafter-address", metavar="H:P", help="drafter service")
    parser.add_argument("--scheduler-address", metavar="H:P", help="scheduler service")
    parser.add_argument("--tp", type=int, help="tensor-parallel degree (ranks started here)")
    parser.add_argument("--served-model-name", help="the `model` clients send")
    parser.add_argument(
        "--attention-backend",
        choices=ATTENTION_BACKEND_CHOICES,
        help="model.attention_backend for target and in-process drafter (default: settings)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=DEFAULT_METRICS_PORT,
        help="the engine's Prometheus endpoint (http://HOST:PORT/metrics); 0 turns it off",
    )
    parser.add_argument("--config", help="YAML settings file")
    logs.add_arguments(parser)


def settings_from_args(args: argparse.Namespace) -> Settings:
    base = load_settings(args.config)
    model: dict[str, Any] = {}
    if args.target:
        model["target"] = args.target
        # A drafter must share the target's vocabulary: the embedded default only fits
        # the embedded target, so a custom target without --drafter runs without one.
        if "drafter" not in base.model.model_fields_set and args.target != "embedded":
            model["drafter"] = None
    if args.drafter:
        model["drafter"] = None if args.drafter == "none" else args.drafter
    if args.tp:
        model["tp"] = args.tp
    if args.served_model_name:
        model["served_name"] = args.served_model_name
    if args.attention_backend:
        model["attention_backend"] = args.attention_backend
    services: dict[str, Any] = {}
    if args.drafter_address:
        services["drafter"] = args.drafter_address
    if args.scheduler_address:
        services["scheduler"] = args.scheduler_address
    return load_settings(args.config, model=model, services=services)


def run(args: argparse.Namespace) -> int:
    # Before torch and transformers are imported: progress bars are decided at import.
    logs.configure(args.log_level, args.log_format)
    from services.common.ports import PortInUse, check_free

    # Before the model loads (seconds to minutes): a clash is reported at once.
    metrics_port = max(args.metrics_port, 0)  # -1 (off) from older scripts still works
    try:
        check_free(args.host, args.port, "--port N")
        if metrics_port:
            check_free(args.host, metrics_port, "--metrics-port N (0 turns metrics off)")
    except PortInUse as exc:
        print(f"adaserve verifier: {exc}", file=sys.stderr)
        return 2
    from adaserve.cpu_load import current, oversubscription

    # Before loading: the load average should not count our own model loading.
    for warning in oversubscription(current(), computing_processes=args.tp or 1):
        log.warning(warning)
    # Imported here so `adaserve verifier --help` never pays for torch.
    from adaserve.model.config import UnsupportedModelError
    from adaserve.model.embedded import ModelNotFoundError, resolve_model
    from adaserve.model.loader import load_tokenizer
    from adaserve.torch_thread import torch_thread
    from services.common import tls
    from services.common.server import run_until_signal
    from services.verifier.server import build_server, log_slos
    from services.verifier.wiring import build_engine

    # Models are loaded, warmed up and run on this one thread (adaserve/torch_thread.py).
    worker = torch_thread("adaserve-engine")
    try:
        settings = settings_from_args(args)
        tls.configure(settings.tls)  # before the engine dials the drafter and scheduler
        engine = worker.submit(build_engine, settings).result()
    except (ModelNotFoundError, UnsupportedModelError, FileNotFoundError, ValueError) as exc:
        # A bad path or config is the user's to fix: say what, without a traceback.
        print(f"adaserve verifier: {exc}", file=sys.stderr)
        worker.shutdown(wait=False)
        return 1
    if metrics_port:
        from prometheus_client import start_http_server

        from adaserve.metrics import export_vllm_names

        export_vllm_names(engine.info().model)  # vLLM dashboards find the shared series
        try:
            start_http_server(metrics_port, addr=args.host)
        except OSError as exc:  # taken while the model loaded
            print(f"adaserve verifier: metrics port {metrics_port}: {exc}", file=sys.stderr)
            engine.stop()
            worker.shutdown(wait=False)
            return 2
        shown = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
        log.info(f"engine metrics on http://{shown}:{metrics_port}/metrics")
    try:
        tokenizer = load_tokenizer(resolve_model(settings.model.target))
    except Exception as exc:  # token-id prompts still work without one
        print(f"verifier: no tokenizer ({exc}); only token-id prompts", file=sys.stderr)
        tokenizer = None
    log_slos(engine, settings)
    engine.start(worker)
    try:
        return run_until_signal(
            lambda: build_server(engine, settings, args.host, args.port, tokenizer)
        )
    finally:
        engine.stop()
        worker.shutdown(wait=False)


if __name__ == "__main__":
    from adaserve.cli import main

    raise SystemExit(main(["verifier", *sys.argv[1:]]))
