"""Stop strings end the output exactly where plain decoding ends it, when a speculative
step accepts several tokens at once: the same token ids, text, number of logprobs and
finish reason, for a stop string inside one token, one that spans token boundaries,
and one far into a run of accepted tokens. The embedded SmolLM2 target drafts for
itself (almost every draft accepted), so most steps emit 3-5 tokens."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest

from adaserve.config import load_settings
from adaserve.engine import Engine
from adaserve.engine_build import eos_token_ids
from adaserve.model.loader import load_runner, load_tokenizer
from adaserve.request import GenerationRequest, SamplingParams
from adaserve.runner_target import RunnerTarget
from adaserve.scheduler import LocalScheduler
from adaserve.speculate import BeamDrafter
from tests._stats import single_thread

pytestmark = pytest.mark.slow

MAX_TOKENS = 40
MESSAGES = [{"role": "user", "content": "Tell me about colours."}]


@dataclass
class Out:
    ids: list[int]
    text: str
    finish: str | None
    logprobs: list[float]
    step_sizes: list[int]


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[Engine, Engine, list[int], object]]:
    with single_thread():
        tok = load_tokenizer("embedded")

        def runner():
            return load_runner("embedded", device="cpu", dtype="float32", kv_blocks=128)

        settings = load_settings(
            None,
            slo={"baseline_tpot_ms": 50.0},
            # Deep chains, always drafted: many accepted tokens per step.
            scheduler={"budget": 16, "adaptive": {"d_min": 4, "d_max": 4, "w_max": 1}},
        )
        made = []
        for drafter in (BeamDrafter(runner()), None):
            target = runner()
            made.append(
                Engine(
                    RunnerTarget(target, eos_token_ids(tok, target)),
                    drafter,
                    LocalScheduler(settings.scheduler),
                    settings,
                    tokenizer=tok,
                )
            )
        text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
        prompt = tok.encode(text, add_special_tokens=False)
        yield made[0], made[1], prompt, tok


def _run(engine: Engine, prompt: list[int], stop: tuple[str, ...], name: str) -> Out:
    sp = SamplingParams(max_tokens=MAX_TOKENS, stop=stop, logprobs=0, ignore_eos=True)
    stream = engine.submit(GenerationRequest(name, tuple(prompt), sp, tpot_slo_ms=1000.0))
    out = Out([], "", None, [], [])
    for _ in range(500):
        engine.step()
        while (d := stream.get(timeout=0)) is not None:
            out.ids.extend(d.token_ids)
            out.text += d.text
            if d.logprobs is not None:
                out.logprobs.extend(float(v) for v in d.logprobs.logprobs)
            out.step_sizes.append(len(d.token_ids))
            out.finish = d.finish_reason or out.finish
        if not engine.has_work():
            return out
    raise AssertionError("the request did not finish")


def _stops(tok, ids: list[int]) -> list[tuple[str, ...]]:
    """Stop strings drawn from the plain output: one inside a token, one spanning a
    token boundary (its last character and the next token's first two), one late."""
    full = tok.decode(ids, skip_special_tokens=True)
    cut = len(tok.decode(ids[:6], skip_special_tokens=True))
    late = len(tok.decode(ids[:25], skip_special_tokens=True))
    return [(".",), (full[cut - 1 : cut + 2],), (full[late - 2 : late + 1], "zzzz")]


def test_stop_strings_cut_where_plain_decoding_stops(engines) -> None:
    spec, plain, prompt, tok = engines
    free = _run(plain, prompt, (), "free")
    assert free.finish == "length" and len(free.ids) == MAX_TOKENS
    for k, stop in enumerate(_stops(tok, free.ids)):
        want = _run(plain, prompt, stop, f"plain-{k}")
        got = _run(spec, prompt, stop, f"spec-{k}")
        assert want.finish == "stop", (stop, want)
        # Plain decoding stops at the first token whose text completes the stop string.
        n = len(want.ids)
        assert want.ids == free.ids[:n]
        head = tok.decode(free.ids[:n], skip_special_tokens=True)
        assert any(s in head for s in stop)
        assert not any(s in tok.decode(free.ids[: n - 1], skip_special_tokens=True) for s in stop)
        assert (got.ids, got.text, got.finish) == (want.ids, want.text, want.finish), stop
        # One logprob per kept token; values within float32 noise of a tree-shaped
        # forward against a one-token one (the same tolerance as the OpenAI tests).
        assert len(got.logprobs) == len(want.logprobs) == len(got.ids)
        np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-4)
        assert max(got.step_sizes) > 1  # speculation really emitted several tokens a step
