"""Engine test helpers shared by the engine's test modules: a tiny target, the
Hugging Face greedy oracle, an in-process engine and a loop that steps it to the end."""

from __future__ import annotations

import pytest
import torch

from adaserve.config import load_settings
from adaserve.engine import Engine
from adaserve.model.loader import load_runner
from adaserve.ngram import NgramDrafter
from adaserve.request import GenerationRequest, SamplingParams
from adaserve.runner_target import RunnerTarget
from adaserve.scheduler import LocalScheduler
from adaserve.speculate import BeamDrafter
from tests.conftest import make_tiny_model


def hf_greedy(model_dir, prompt: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = _HF.get(str(model_dir))
    if model is None:
        model = _HF[str(model_dir)] = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


_HF: dict = {}


def make_engine(target_dir, drafter_dir=None, ngram: bool = False, **overrides) -> Engine:
    settings = load_settings(
        None,
        engine={
            "kv_blocks": 512,
            "kv_block_size": 16,
            "max_queue": 64,
            **overrides.pop("engine", {}),
        },
        scheduler={"budget": 12, **overrides.pop("scheduler", {})},
        **overrides,
    )
    eng, ms = settings.engine, settings.model
    kv = {
        "kv_blocks": eng.kv_blocks,
        "prefix_caching": eng.prefix_caching,
        "stored_activations": ms.stored_activations,
    }
    runner = load_runner(
        target_dir, device="cpu", dtype="float32", quantization=ms.quantization, **kv
    )
    drafter = None
    if drafter_dir is not None:
        drafter = BeamDrafter(
            load_runner(
                drafter_dir,
                device="cpu",
                dtype="float32",
                role="drafter",
                quantization=ms.drafter_quantization,
                **kv,
            )
        )
    return Engine(
        target=RunnerTarget(runner, eos_token_ids=()),
        drafter=drafter,
        scheduler=LocalScheduler(settings.scheduler),
        settings=settings,
        ngram=NgramDrafter() if ngram else None,
    )


def run_to_completion(
    engine: Engine, streams, max_steps: int = 2000, on_step=None, reports=None
) -> dict:
    """Steps until every stream ends: tokens and finish reason per request id. Each
    forward's IterationReport is appended to `reports` where given."""
    out = {s.request_id: [] for s in streams}
    done: dict[str, str] = {}
    for step in range(max_steps):
        if len(done) == len(streams):
            break
        if on_step is not None:
            on_step(step)
        if (report := engine.step()) is not None and reports is not None:
            reports.append(report)
        for s in streams:
            while (d := s.get(timeout=0)) is not None:
                out[s.request_id].extend(d.token_ids)
                if d.finish_reason is not None:
                    done[s.request_id] = d.finish_reason
    assert len(done) == len(streams), f"unfinished after {max_steps} steps: {done}"
    return {"tokens": out, "finish": done}


def req(i: int, prompt, max_tokens: int, slo: float, **sp) -> GenerationRequest:
    return GenerationRequest(
        id=f"r{i}",
        prompt_token_ids=tuple(prompt),
        sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sp),
        tpot_slo_ms=slo,
    )


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("engine-target"), "llama", seed=0)


@pytest.fixture(scope="module")
def random_drafter_dir(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("engine-drafter"), "llama", seed=7, num_hidden_layers=1
    )


PROMPTS = [
    [1, 5, 9, 200, 31],
    [7],
    [3, 3, 3, 3, 3, 3, 3, 3, 40, 41],
    [100, 101, 102],
    [250, 17, 4, 9],
]


LONG = [list(range(1 + i, 90 + 7 * i)) for i in range(4)]  # 89..110-token prompts
