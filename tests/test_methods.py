"""Speculation methods per request (adaserve/methods.py) in the engine: every method
and the merged trees stay lossless (greedy against Hugging Face, seeded sampling
identical with speculation off), the method comes from the request, its SLO class or
the default, `auto` follows the load and the SLO, and bad or unavailable methods are
refused naming the field."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from adaserve import metrics
from adaserve.config import Settings, load_settings
from adaserve.engine import Engine
from adaserve.engine.admission import method_of
from adaserve.methods import choose_source, scale_f
from adaserve.model.loader import load_runner
from adaserve.ngram import NgramDrafter
from adaserve.request import GenerationRequest, SamplingParams
from adaserve.runner_target import RunnerTarget
from adaserve.scheduler import LocalScheduler
from adaserve.speculate import BeamDrafter
from adaserve.tree import CandidateTree
from tests._engine import hf_greedy
from tests._stats import single_thread
from tests.conftest import make_tiny_model


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with single_thread():
        yield


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("methods-target"), "llama", seed=0)


def make_engine(
    target_dir, drafter_dir=None, ngram=True, max_model_len=None, **overrides
) -> Engine:
    settings = load_settings(
        None,
        engine={"kv_blocks": 512, "kv_block_size": 16, **overrides.pop("engine", {})},
        scheduler={"budget": 12, **overrides.pop("scheduler", {})},
        **overrides,
    )
    kv = {"kv_blocks": 512}
    drafter = None
    if drafter_dir is not None:
        drafter = BeamDrafter(load_runner(drafter_dir, device="cpu", dtype="float32", **kv))
    return Engine(
        target=RunnerTarget(
            load_runner(
                target_dir, device="cpu", dtype="float32", max_model_len=max_model_len, **kv
            ),
            eos_token_ids=(),
        ),
        drafter=drafter,
        scheduler=LocalScheduler(settings.scheduler),
        settings=settings,
        ngram=NgramDrafter() if ngram else None,
    )


def _prompts(n: int = 4) -> list[list[int]]:
    """Random spans said three times: the n-gram drafter finds matches at once."""
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, 8).tolist() * 3 for _ in range(n)]


def run(engine: Engine, reqs: list[GenerationRequest]):
    """(tokens per request id, how often each source drafted each request)."""
    streams = [engine.submit(r) for r in reqs]
    out = {r.id: [] for r in reqs}
    sources: dict[str, collections.Counter] = {r.id: collections.Counter() for r in reqs}
    done = 0
    for _ in range(3000):
        if done == len(reqs):
            break
        report = engine.step()
        for rid, source in ({} if report is None else report.sources).items():
            sources[rid][source] += 1
        for s in streams:
            while (d := s.get(timeout=0)) is not None:
                out[s.request_id].extend(d.token_ids)
                done += d.finish_reason is not None
    assert done == len(reqs)
    return out, sources


def req(i: int, prompt, n: int, method: str | None, slo: float = 50.0, **sp):
    return GenerationRequest(
        f"r{i}",
        tuple(prompt),
        SamplingParams(max_tokens=n, ignore_eos=True, **sp),
        slo,
        speculation=method,
    )


# ---- the choice -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "planned", "ngram_tokens", "pays", "want"),
    [
        ("none", True, 5.0, True, "none"),
        ("ngram", False, 1.0, False, "ngram"),  # asked for: its (free) tree every time
        ("model", True, 5.0, True, "model"),
        ("model", False, 5.0, True, "none"),  # the plan says the model does not pay
        ("auto", False, 3.0, True, "ngram"),
        ("auto", False, 3.0, False, "none"),  # relaxed on a loaded server
        ("auto", True, 1.0, True, "model+ngram"),  # no match: the model's tree (+ none)
        ("auto", True, 2.0, True, "model+ngram"),  # 2.0 * 1.25 < 3.0
        ("auto", True, 2.5, True, "ngram"),  # as fast alone, without the draft steps
    ],
)
def test_choose_source(method, planned, ngram_tokens, pays, want):
    got = choose_source(method, planned, ngram_tokens, 3.0, 0.25, True, True, pays)
    assert got == want


def test_without_an_ngram_drafter_auto_is_the_model_plan():
    assert choose_source("auto", True, 9.0, 3.0, 0.25, True, False) == "model"
    assert choose_source("auto", False, 9.0, 3.0, 0.25, True, False) == "none"


def test_calibration_scales_f_below_the_root_and_keeps_the_contract():
    tree = CandidateTree.build([5, 6, 7, 8], [-1, 0, 1, 0], np.log([1.0, 0.8, 0.5, 0.1]))
    half = scale_f(tree, 0.5).path_probs()
    assert half == pytest.approx([1.0, 0.4, 0.2, 0.05])
    more = scale_f(tree, 2.0).path_probs()  # q clipped at 1: f never exceeds the parent's
    assert more == pytest.approx([1.0, 1.0, 0.5, 0.2])


# ---- lossless, every method -------------------------------------------------------


@pytest.mark.parametrize("method", ["auto", "model", "ngram", "none"])
def test_every_method_is_lossless_greedy(target_dir, method):
    """The target drafts for itself (its trees are accepted) beside the n-gram drafter;
    selection policy global verifies whatever the budget holds, so drafts are accepted
    and rejected at every depth. Output is Hugging Face's greedy continuation."""
    engine = make_engine(target_dir, target_dir, scheduler={"policy": "global"})
    prompts = _prompts()
    out, sources = run(engine, [req(i, p, 100, method) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        assert out[f"r{i}"] == hf_greedy(target_dir, p, 100), i
    used = sum(sources.values(), collections.Counter())
    allowed = {
        "none": {"none"},
        "ngram": {"ngram"},
        "model": {"model", "none"},
        "auto": {"model+ngram", "ngram", "none"},
    }[method]
    assert set(used) <= allowed and used
    if method == "auto":
        assert used["model+ngram"] > 0  # merged trees were verified
    stats = engine.method_stats
    if method in ("ngram", "auto"):
        # drafted n-gram tokens were verified, and some accepted (the output repeats)
        source = stats["ngram" if method == "ngram" else "model+ngram"]
        assert source.drafted > source.accepted > 0
    assert engine.target.kv_usage() == 0.0 and engine.stats().tracked == 0
    assert engine.ngram is not None and engine.ngram.inner.num_sequences == 0  # released


def test_methods_mix_in_one_batch_losslessly(target_dir):
    engine = make_engine(target_dir, target_dir, scheduler={"policy": "global"})
    prompts = _prompts()
    methods = ["auto", "model", "ngram", "none"]
    reqs = [req(i, p, 60, m) for i, (p, m) in enumerate(zip(prompts, methods, strict=True))]
    out, sources = run(engine, reqs)
    for i, p in enumerate(prompts):
        assert out[f"r{i}"] == hf_greedy(target_dir, p, 60), i
    assert set(sources["r2"]) == {"ngram"} and set(sources["r3"]) == {"none"}
    assert set(sources["r1"]) <= {"model", "none"}


@pytest.mark.parametrize("method", ["auto", "model", "ngram"])
def test_seeded_sampling_is_identical_for_every_method(target_dir, method):
    prompts = _prompts(3)

    def sample(engine: Engine) -> dict:
        reqs = [
            req(i, p, 40, None if engine.drafter is None else method, temperature=0.9, seed=7 + i)
            for i, p in enumerate(prompts)
        ]
        return run(engine, reqs)[0]

    plain = sample(make_engine(target_dir, None, ngram=False))
    spec = sample(make_engine(target_dir, target_dir, scheduler={"policy": "global"}))
    assert spec == plain


# ---- where the method comes from --------------------------------------------------


def test_method_from_the_request_then_its_class_then_the_default(target_dir):
    engine = make_engine(
        target_dir,
        target_dir,
        slo={"classes": {"summarize": {"tpot_ms": 150.0, "speculation": "ngram"}}},
        speculation={"default_method": "model"},
    )
    prompt = _prompts(1)[0]

    cls = GenerationRequest("a", tuple(prompt), SamplingParams(), 150.0, slo_class="summarize")
    assert method_of(engine, cls) == "ngram"
    assert method_of(engine, GenerationRequest("b", (1,), SamplingParams(), 50.0)) == "model"
    own = GenerationRequest("c", (1,), SamplingParams(), 150.0, "summarize", speculation="none")
    assert method_of(engine, own) == "none"


def test_bad_and_unavailable_methods_are_refused_naming_the_field(target_dir):
    with pytest.raises(ValueError, match=r"speculation\.method must be one of"):
        GenerationRequest("a", (1,), SamplingParams(), 50.0, speculation="fast")
    engine = make_engine(target_dir, None)  # n-gram only
    assert engine.info().speculation_methods == ("auto", "ngram", "none")
    for method in ("model", "eagle"):
        with pytest.raises(ValueError, match=r"speculation\.method .* not available"):
            engine.submit(
                GenerationRequest("a", (1, 2), SamplingParams(), 50.0, speculation=method)
            )
    engine.submit(GenerationRequest("b", (1, 2), SamplingParams(), 50.0, speculation="ngram"))
    off = make_engine(target_dir, target_dir, engine={"speculation": False})
    assert off.info().speculation_methods == ("auto", "none")


def test_eagle_configured_without_an_eagle_drafter_is_refused_at_startup(target_dir):
    # A deployment default or an SLO class naming eagle on a unit without an EAGLE
    # drafter would refuse every request it covers: the engine refuses to start.
    with pytest.raises(ValueError, match=r"default_method 'eagle' is not available"):
        make_engine(target_dir, target_dir, speculation={"default_method": "eagle"})
    with pytest.raises(ValueError, match=r"slo\.classes\.x\.speculation 'eagle'"):
        make_engine(
            target_dir, None, slo={"classes": {"x": {"tpot_ms": 50.0, "speculation": "eagle"}}}
        )
    # The settings themselves are valid: a unit with an EAGLE drafter serves them.
    Settings.model_validate({"speculation": {"default_method": "eagle"}})


# ---- auto: the load and the SLO ---------------------------------------------------

# The cost cap plans no model drafting from two requests on (test_engine.CAPPED).
CAPPED = {
    "d_min": 0,
    "d_max": 3,
    "w_max": 1,
    "acceptance": 0.9,
    "draft_cost_tokens": 0.1,
    "draft_cost_tokens_per_request": 8.0,
}


def test_auto_gives_a_loaded_servers_relaxed_requests_none_and_the_tight_one_the_best(
    target_dir,
):
    """Eight requests: the model's draft steps do not pay, and the n-gram drafter's
    acceptance (prior 0.05) does not pay for verify tokens at this load, so the relaxed
    requests decode plainly; the tight one (the slack plan) gets model + n-gram trees."""
    engine = make_engine(
        target_dir,
        target_dir,
        scheduler={"adaptive": {**CAPPED, "slack_margin": 0.8}},
        speculation={"ngram": {"acceptance": 0.05}},
    )
    prompts = _prompts(8)
    reqs = [req(0, prompts[0], 12, "auto", slo=1e4)]
    reqs += [req(i, p, 40, "auto", slo=1e6) for i, p in enumerate(prompts[1:], 1)]
    out, sources = run(engine, reqs)
    for i, p in enumerate(prompts):
        assert out[f"r{i}"] == hf_greedy(target_dir, p, reqs[i].sampling.max_tokens)
    assert sources["r0"]["model+ngram"] + sources["r0"]["ngram"] > 0
    relaxed = sum((sources[f"r{i}"] for i in range(1, 8)), collections.Counter())
    # While r0 runs, they are eight; later they are fewer and drafting pays again.
    assert relaxed["none"] >= 7 * 5


def test_per_method_metrics_count_steps_and_tokens(target_dir):
    engine = make_engine(target_dir, target_dir, scheduler={"policy": "global"})

    def value(name: str, method: str) -> float:
        return (
            metrics.spec_method_steps.labels(method)._value.get()
            if name == "steps"
            else (metrics.spec_method_emitted_tokens.labels(method)._value.get())
        )

    before = {m: (value("steps", m), value("emitted", m)) for m in ("ngram", "none")}
    prompts = _prompts(2)
    _, sources = run(engine, [req(0, prompts[0], 30, "ngram"), req(1, prompts[1], 30, "none")])
    for i, m in ((0, "ngram"), (1, "none")):
        steps = value("steps", m) - before[m][0]
        emitted = value("emitted", m) - before[m][1]
        # the first token comes from the prompt's prefill, not from a verification
        assert steps == sources[f"r{i}"][m] and emitted == 29
    assert metrics.spec_method_tokens_per_step.labels("none")._value.get() == pytest.approx(1.0)


def test_ngram_trees_near_the_end_of_the_context_are_cut_to_it(target_dir):
    """No drafter, the n-gram drafter on (the default): a repetitive prompt drafts deep
    trees; near max_model_len they are cut to the window instead of failing the forward
    (the schema fuzzer found this), and the output is plain decoding's to the end."""
    runs, drafted = {}, {}
    for method in ("ngram", "none"):
        engine = make_engine(target_dir, max_model_len=48)
        r = GenerationRequest(
            id="r0",
            prompt_token_ids=tuple(_prompts(1)[0]),  # 24 tokens
            sampling=SamplingParams(max_tokens=48 - 24, ignore_eos=True),  # the whole window
            tpot_slo_ms=1e6,
            speculation=method,
        )
        runs[method], sources = run(engine, [r])
        drafted[method] = sources["r0"]["ngram"]
    assert drafted["ngram"] > 0 and drafted["none"] == 0
    assert runs["ngram"]["r0"] == runs["none"]["r0"]
    assert len(runs["ngram"]["r0"]) == 48 - 24 - 1  # the engine keeps the last position
