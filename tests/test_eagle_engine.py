"""The EAGLE path in the engine on the embedded SmolLM2 target, in process: greedy
output equals the target's own, token for token (mixed SLOs, prompts arriving
mid-stream in chunks, eagle and auto side by side), seeded sampling is identical with
and without speculation, every feature row the drafter gets is the target's feature of
the position before its token, a lost drafter state is recomputed by the verifier, and
a bad payload falls back to plain decoding for the iteration."""

from __future__ import annotations

import numpy as np
import pytest

from adaserve.config import load_settings
from adaserve.drafter import DraftUpdate
from adaserve.eagle_drafter import EagleDrafter
from adaserve.engine import Engine
from adaserve.model.eagle import load_eagle_runner
from adaserve.model.loader import load_runner, load_tokenizer
from adaserve.model.runner import SeqInput
from adaserve.request import GenerationRequest, SamplingParams
from adaserve.runner_target import RunnerTarget
from adaserve.scheduler import LocalScheduler
from adaserve.tree import CandidateTree
from tests._eagle import make_eagle_dir
from tests._spec_loop import generate
from tests._stats import single_thread

pytestmark = pytest.mark.slow

MAX_TOKENS = 24
TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "List three colours:",
]
LAYERS = (1, 15, 29)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with single_thread():
        yield


@pytest.fixture(scope="module")
def smol(embedded_dir, tmp_path_factory):
    """(target runner, eagle head dir, prompts, plain greedy outputs)."""
    tok = load_tokenizer("embedded")
    prompts = {f"p{k}": tok(t)["input_ids"] for k, t in enumerate(TEXTS)}
    target = load_runner(embedded_dir, device="cpu", dtype="float32", kv_blocks=256)
    ref, _ = generate(target, prompts, MAX_TOKENS)
    head = make_eagle_dir(tmp_path_factory.mktemp("eagle"), embedded_dir, feature_layers=LAYERS)
    return target, head, prompts, ref


class Oracle:
    """An EagleDrafter whose trees are swapped for chains that follow the reference
    output (with a wrong sibling), so whole paths are accepted and several feature
    rows arrive per iteration; it records every update it was sent. The real
    drafter still runs on every update (its KV, its checks)."""

    def __init__(self, inner: EagleDrafter, ref: dict[str, list[int]], prompts) -> None:
        self.inner, self.kind, self.spec = inner, inner.kind, inner.spec
        self.full = {k: list(prompts[k]) + ref[k] for k in ref}
        self.updates: list[DraftUpdate] = []
        self.corrupt_next = False

    def speculate(self, updates, depth, width, stop_prob=0.0):
        self.updates.extend(updates)
        if self.corrupt_next:
            self.corrupt_next = False
            u = updates[0]
            assert u.hidden is not None
            bad = DraftUpdate(u.id, u.new_tokens, u.total_len, u.ingest, u.hidden[:, :-1])
            updates = [bad, *updates[1:]]
        trees = self.inner.speculate(updates, depth, width, stop_prob)
        out = []
        for u, t in zip(updates, trees, strict=True):
            full = self.full.get(u.id.split("-")[0])
            if u.ingest or full is None or depth == 0:
                out.append(t)
                continue
            n = u.total_len
            chain = full[n : n + depth]
            toks = [int(t.tokens[0]), *chain, (chain[0] + 1) % 49152 if chain else 0]
            parents = [-1, *range(len(chain)), 0][: len(toks)]
            logq = [0.0] + [-0.1] * len(chain) + [-3.0]
            out.append(CandidateTree.build(np.array(toks), np.array(parents), np.array(logq)))
        return out

    def release(self, ids):
        self.inner.release(ids)


def _engine(target, drafter, **engine):
    settings = load_settings(
        None,
        slo={"baseline_tpot_ms": 50.0},
        engine={"kv_blocks": 256, "max_batch_tokens": 40, "min_prefill_tokens": 8, **engine},
        scheduler={"budget": 16},
    )
    return Engine(
        RunnerTarget(target, eos_token_ids=()),
        drafter,
        LocalScheduler(settings.scheduler),
        settings,
    )


def _run(engine, reqs, arrive_at=None, sources=None):
    """Steps the engine until every request ends; request i is submitted at step
    arrive_at[i]. Returns tokens per request id; adds what drafted each verified tree
    to `sources` where given."""
    arrive_at = arrive_at or [0] * len(reqs)
    streams, out = {}, {r.id: [] for r in reqs}
    for step in range(2000):
        for r, at in zip(reqs, arrive_at, strict=True):
            if at == step:
                streams[r.id] = engine.submit(r)
        report = engine.step()
        if sources is not None and report is not None:
            sources.update(report.sources.values())
        done = 0
        for rid, s in streams.items():
            while (d := s.get(timeout=0)) is not None:
                out[rid].extend(d.token_ids)
                assert d.finish_reason in (None, "length"), d
        done = sum(len(v) == reqs[0].sampling.max_tokens for v in out.values())
        if done == len(reqs) and step > max(arrive_at):
            break
    return out


def _req(rid, prompt, method, slo, **sp):
    sp = {"max_tokens": MAX_TOKENS, "ignore_eos": True, **sp}
    return GenerationRequest(rid, tuple(prompt), SamplingParams(**sp), slo, speculation=method)


def _features(target, tokens, sid="check"):
    """The target's features of every position of `tokens`, by one fresh prefill."""
    target.add_sequence(sid, tokens, use_cache=False)
    _, feats = target.forward_features([SeqInput.chain(sid, tokens)], LAYERS, [])
    target.free(sid)
    return feats.float().numpy()


def test_greedy_is_lossless_and_every_row_is_aligned(smol):
    target, head, prompts, ref = smol
    inner = EagleDrafter(load_eagle_runner(head, target.device, target.dtype, kv_blocks=256))
    oracle = Oracle(inner, ref, prompts)
    engine = _engine(target, oracle)
    assert "eagle" in engine.info().speculation_methods
    assert "model" not in engine.info().speculation_methods
    methods = ["eagle", "auto", "eagle", "none"]
    slos = [30.0, 200.0, 60.0, 400.0]
    reqs = [_req(k, prompts[k], m, s) for k, m, s in zip(prompts, methods, slos, strict=True)]
    out = _run(engine, reqs, arrive_at=[0, 0, 3, 6])  # later prompts mid-stream
    assert out == ref
    # Several rows per decoding update (accepted paths), and chunked ingests.
    assert any(not u.ingest and len(u.new_tokens) > 2 for u in oracle.updates)
    assert any(u.ingest for u in oracle.updates)
    for k in ("p0", "p2"):
        full = list(prompts[k]) + ref[k]
        feats = _features(target, full)
        covered: set[int] = set()
        for u in oracle.updates:
            if u.id != k:
                continue
            start = u.total_len - len(u.new_tokens)
            assert list(u.new_tokens) == full[start : u.total_len]
            want = np.concatenate([np.zeros((1, feats.shape[1])), feats])[start : u.total_len]
            # fp16 on the way; tree verification and a prefill round differently
            np.testing.assert_allclose(u.hidden.astype(np.float32), want, rtol=0.02, atol=0.05)
            covered.update(range(start, u.total_len))
        # Every position up to the last one sent, each with its row; the tail after the
        # last drafted iteration is never sent (how long it is depends on the plan).
        assert covered == set(range(len(covered))) and len(covered) > len(prompts[k])
    assert target.kv_usage() == 0.0 and inner.runner.kv_usage() == 0.0
    assert engine.method_stats["eagle"].steps > 0


def test_seeded_sampling_is_identical_with_and_without_speculation(smol):
    target, head, prompts, ref = smol
    inner = EagleDrafter(load_eagle_runner(head, target.device, target.dtype, kv_blocks=256))
    sp = {"temperature": 0.8, "top_p": 0.95}
    reqs = lambda: [  # noqa: E731
        _req(k, prompts[k], "eagle", 50.0, seed=7 + i, **sp) for i, k in enumerate(prompts)
    ]
    spec = _run(_engine(target, Oracle(inner, ref, prompts)), reqs(), [0, 1, 2, 3])
    plain = _run(
        _engine(target, None),
        [_req(k, prompts[k], None, 50.0, seed=7 + i, **sp) for i, k in enumerate(prompts)],
    )
    assert spec == plain


def _step_until_done(engine, reqs, before_step):
    streams = {r.id: engine.submit(r) for r in reqs}
    out = {r.id: [] for r in reqs}
    for _ in range(2000):
        before_step()
        engine.step()
        for rid, s in streams.items():
            while (d := s.get(timeout=0)) is not None:
                out[rid].extend(d.token_ids)
        if not engine.has_work():
            break
    return out


def test_lost_state_is_recomputed_by_the_verifier(smol):
    target, head, prompts, ref = smol
    inner = EagleDrafter(load_eagle_runner(head, target.device, target.dtype, kv_blocks=256))
    oracle = Oracle(inner, ref, prompts)
    engine = _engine(target, oracle)
    reqs = [_req(k, prompts[k], "eagle", 50.0) for k in prompts]
    forgotten: list[str] = []

    def forget():  # once all have drafted: the drafter forgets everyone (a restart)
        if not forgotten and sum(not u.ingest for u in oracle.updates) >= 4:
            forgotten.extend(i for i in inner._pending if i in engine.pool.running)
            inner.release(list(inner._pending))

    assert _step_until_done(engine, reqs, forget) == ref
    # Each was sent again from position 0 with its recomputed features, then drafted.
    assert forgotten
    for rid in forgotten:
        mine = [u for u in oracle.updates if u.id == rid]
        fresh = [i for i, u in enumerate(mine) if len(u.new_tokens) == u.total_len]
        assert len(fresh) >= 2, [(len(u.new_tokens), u.total_len, u.ingest) for u in mine]
        assert any(not u.ingest for u in mine[fresh[1] :])
    assert target.kv_usage() == 0.0 and inner.runner.kv_usage() == 0.0


def test_a_bad_payload_falls_back_to_plain_decoding(smol, caplog):
    target, head, prompts, ref = smol
    inner = EagleDrafter(load_eagle_runner(head, target.device, target.dtype, kv_blocks=256))
    oracle = Oracle(inner, ref, prompts)
    engine = _engine(target, oracle)
    reqs = [_req(k, prompts[k], "eagle", 50.0) for k in prompts]

    def corrupt():
        if sum(not u.ingest for u in oracle.updates) == 4:
            oracle.corrupt_next = True

    assert _step_until_done(engine, reqs, corrupt) == ref
    assert "hidden shape" in caplog.text  # the drafter refused it; plain decoding went on


def test_merged_eagle_and_ngram_trees_are_lossless(smol):
    """The n-gram drafter beside the head: eagle, ngram and auto (which may merge both
    trees) in one batch emit the target's own tokens."""
    from adaserve.ngram import NgramDrafter

    target, head, prompts, ref = smol
    inner = EagleDrafter(load_eagle_runner(head, target.device, target.dtype, kv_blocks=256))
    settings = load_settings(
        None,
        slo={"baseline_tpot_ms": 50.0},
        engine={"kv_blocks": 256, "max_batch_tokens": 40},
        scheduler={"budget": 16},
    )
    engine = Engine(
        RunnerTarget(target, eos_token_ids=()),
        Oracle(inner, ref, prompts),
        LocalScheduler(settings.scheduler),
        settings,
        ngram=NgramDrafter(),
    )
    assert engine.info().speculation_methods == ("auto", "eagle", "ngram", "none")
    sources: set[str] = set()
    methods = ["auto", "ngram", "eagle", "auto"]
    reqs = [_req(k, prompts[k], m, 30.0) for k, m in zip(prompts, methods, strict=True)]
    assert _run(engine, reqs, sources=sources) == ref
    assert "eagle" in sources or "eagle+ngram" in sources, sources


def test_a_head_for_another_target_is_refused_at_startup(smol, tmp_path):
    from adaserve.model.eagle import eagle_spec

    target, head, _, _ = smol
    inner = EagleDrafter(load_eagle_runner(head, target.device, target.dtype, kv_blocks=16))
    spec = eagle_spec(head)
    inner.spec = type(spec)(spec.feature_layers, spec.target_layers + 2, spec.hidden_size)
    with pytest.raises(ValueError, match="wrong target"):
        _engine(target, inner)


def test_the_shipped_head_drafts_its_own_trees_losslessly(smol):
    """The shipped head (`embedded-eagle`), no oracle: the trees it drafts itself (beam
    search, confidence stop) are verified into the target's own greedy output, beside
    plain requests, and some of its drafts are accepted."""
    from adaserve.model.embedded import resolve_model

    target, _, prompts, ref = smol
    head = resolve_model("embedded-eagle", role="drafter")
    inner = EagleDrafter(load_eagle_runner(head, target.device, target.dtype, kv_blocks=256))
    engine = _engine(target, inner)
    methods = ["eagle", "eagle", "none", "eagle"]
    reqs = [_req(k, prompts[k], m, 30.0) for k, m in zip(prompts, methods, strict=True)]
    assert _run(engine, reqs, arrive_at=[0, 2, 2, 5]) == ref
    stats = engine.method_stats["eagle"]
    assert stats.steps > 0 and stats.accepted > 0  # drafts accepted, not just roots verified
    assert target.kv_usage() == 0.0 and inner.runner.kv_usage() == 0.0
