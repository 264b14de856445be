"""Helpers for tests that run real adaserve processes on loopback.

`make_served_model` writes a tiny random Llama with a real (character-level) tokenizer
and chat template, so text and chat prompts work end to end without the embedded model;
every token decodes to printable text, so outputs compare as strings.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
import string
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.conftest import make_tiny_model

CHARS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]  # 96
IM_START, IM_END = len(CHARS), len(CHARS) + 1
VOCAB = len(CHARS) + 2
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
REPO = Path(__file__).resolve().parent.parent


def make_served_model(
    path: Path, seed: int = 0, chat_template: str = CHAT_TEMPLATE, **overrides: object
) -> Path:
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    make_tiny_model(
        path,
        "llama",
        seed=seed,
        vocab_size=VOCAB,
        bos_token_id=IM_START,
        eos_token_id=IM_END,
        pad_token_id=None,
        **overrides,
    )
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(CHARS)}, merges=[]))
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>"
    )
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    assert (fast.convert_tokens_to_ids("<|im_start|>"), fast.eos_token_id) == (IM_START, IM_END)
    fast.chat_template = chat_template
    fast.save_pretrained(path)
    return path


def greedy_reference(
    model_dir: Path, prompt_ids: list[int], max_tokens: int, eos: tuple[int, ...] = (IM_END,)
) -> list[int]:
    """The target's own greedy continuation (Hugging Face, no adaserve code), ending
    with eos if it was generated (the engine streams and counts eos too, as vLLM)."""
    import torch

    model = _hf_model(str(model_dir))
    ids = list(prompt_ids)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1]
            tok = int(torch.argmax(logits))
            out.append(tok)
            ids.append(tok)
            if tok in eos:
                break
    return out


@functools.cache
def _hf_model(model_dir: str):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """An `adaserve` subcommand in its own process group, output in a log file."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None):
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        self.p = subprocess.Popen(
            [sys.executable, "-m", "adaserve.cli", *args],
            cwd=REPO,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=full_env,
            start_new_session=True,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def check_alive(self) -> None:
        if self.p.poll() is not None:
            raise RuntimeError(f"process exited with {self.p.returncode}:\n{self.log()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        if self.p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.p.pid, sig)
            try:
                self.p.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait()
        self._log.close()
        return self.p.returncode


def wait_grpc_serving(addr: str, proc: Proc | None = None, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(addr) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            if proc is not None:
                proc.check_alive()
            with contextlib.suppress(grpc.RpcError):
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            time.sleep(0.2)
    raise TimeoutError(f"{addr} not serving after {timeout} s")


def wait_http(url: str, proc: Proc | None = None, timeout: float = 60.0, status: int = 200) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None:
            proc.check_alive()
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=1.0).status_code == status:
                return
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer {status} within {timeout} s")


TEST_CONFIG = """\
engine:
  kv_memory_gb: 0.05
  max_running: 8
  max_queue: 8
slo:
  baseline_tpot_ms: 20.0
"""


def start_verifier(
    workdir: Path,
    target: Path,
    drafter: Path | None,
    config: str = TEST_CONFIG,
    name: str = "verifier",
    metrics_port: int = -1,
    port: int | None = None,
    served_name: str = "tiny",
) -> tuple[Proc, str]:
    """A verifier process (on a free port unless given), serving (model loaded) when
    this returns."""
    cfg = workdir / f"{name}.yaml"
    cfg.write_text(config)
    port = port or free_port()
    args = [
        "verifier",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--target",
        str(target),
        "--served-model-name",
        served_name,
        "--config",
        str(cfg),
    ]
    args += ["--drafter", str(drafter)] if drafter is not None else ["--drafter", "none"]
    args += ["--metrics-port", str(metrics_port)]
    proc = Proc(args, workdir / f"{name}.log")
    addr = f"127.0.0.1:{port}"
    try:
        wait_grpc_serving(addr, proc)
    except BaseException:
        proc.stop()
        raise
    return proc, addr


def start_gateway(
    workdir: Path,
    *args: str,
    grpc_port: int = -1,
    name: str = "gateway",
    env: dict[str, str] | None = None,
    wait_path: str = "/health",
) -> tuple[Proc, str]:
    """A gateway process (`args` after the host/port options); returns its base URL
    once `wait_path` answers 200."""
    port = free_port()
    argv = ["gateway", "--host", "127.0.0.1", "--port", str(port), "--grpc-port", str(grpc_port)]
    proc = Proc([*argv, *args], workdir / f"{name}.log", env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + wait_path, proc)
    except BaseException:
        proc.stop()
        raise
    return proc, url
