"""BeamDrafter against a brute-force beam search on Hugging Face transformers (full
re-forward of every path), plus its state protocol: incremental updates, drift, loss,
release, failure atomicity."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from adaserve.drafter import DrafterStateLost, DraftUpdate
from adaserve.model.kv_cache import KVCacheFull
from adaserve.model.loader import load_runner
from adaserve.speculate import BeamDrafter
from tests._stats import single_thread


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with single_thread():
        yield


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()


def _runner(path, **kw):
    kw.setdefault("kv_blocks", 128)
    return load_runner(path, device="cpu", dtype="float32", kv_block_size=4, **kw)


@torch.no_grad()
def _logq(model, seqs: list[list[int]]) -> torch.Tensor:
    """log q(. | seq) for each sequence, by a full forward (no cache): [len(seqs), V]."""
    return torch.stack(
        [torch.log_softmax(model(torch.tensor([s])).logits[0, -1].float(), -1) for s in seqs]
    )


def oracle_beam(model, history: list[int], depth: int, width: int, columns=None):
    """Tokens, parents and conditional log q of the beam tree, brute force. `columns`
    restricts the draft vocabulary (a reduced head) and maps back to target ids."""
    tokens, parents, logq_out = [history[-1]], [-1], [0.0]
    beams = [(0, 0.0, list(history))]  # (node index, path log q, sequence)
    for _ in range(depth):
        lq = _logq(model, [b[2] for b in beams])
        if columns is not None:
            lq = torch.log_softmax(lq[:, columns], -1)  # the reduced head's own softmax
        vocab = lq.shape[1]
        scores = torch.tensor([b[1] for b in beams])[:, None] + lq
        top = scores.reshape(-1).topk(width)
        new = []
        for score, flat in zip(top.values.tolist(), top.indices.tolist(), strict=True):
            b, v = divmod(flat, vocab)
            tok = v if columns is None else int(columns[v])
            tokens.append(tok)
            parents.append(beams[b][0])
            logq_out.append(float(lq[b, v]))
            new.append((len(tokens) - 1, score, [*beams[b][2], tok]))
        beams = new
    return tokens, parents, np.array(logq_out)


def _assert_tree(tree, expected):
    tokens, parents, logq = expected
    assert tree.tokens.tolist() == tokens
    assert tree.parents.tolist() == parents
    np.testing.assert_allclose(tree.logprobs, logq, atol=2e-4)
    tree.validate()


def _upd(sid, new, total):
    return DraftUpdate(sid, np.asarray(new, dtype=np.int32), total)


HIST = {"a": [5, 17, 200, 3, 9, 41, 7], "b": [88], "c": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]}


@pytest.mark.parametrize(("depth", "width"), [(1, 1), (1, 4), (3, 1), (3, 3), (4, 2)])
def test_beam_trees_match_brute_force(tiny_llama_dir, hf_model, depth, width):
    runner = _runner(tiny_llama_dir)
    drafter = BeamDrafter(runner)
    hist = {k: list(v) for k, v in HIST.items()}
    trees = drafter.speculate([_upd(k, v, len(v)) for k, v in hist.items()], depth, width)
    for (k, v), tree in zip(hist.items(), trees, strict=True):
        assert len(tree) == 1 + depth * width
        _assert_tree(tree, oracle_beam(hf_model, v, depth, width))
        assert runner.committed_len(k) == len(v) and runner.scratch_len(k) == 0
    # Incremental: new committed tokens per request (different counts), same state.
    extra = {"a": [11, 12], "b": [100], "c": [7, 7, 7, 7]}
    updates = []
    for k, new in extra.items():
        hist[k] += new
        updates.append(_upd(k, new, len(hist[k])))
    trees = drafter.speculate(updates, depth, width)
    for (k, v), tree in zip(hist.items(), trees, strict=True):
        _assert_tree(tree, oracle_beam(hf_model, v, depth, width))
        assert runner.committed_len(k) == len(v)


def test_layer_layout_and_path_probabilities(tiny_llama_dir):
    drafter = BeamDrafter(_runner(tiny_llama_dir))
    (tree,) = drafter.speculate([_upd("a", HIST["a"], 7)], 4, 3)
    depths = tree.depths()
    assert depths.tolist() == [0] + [d for d in range(1, 5) for _ in range(3)]
    f = tree.path_probs()
    # Children never beat their parents, and each layer is sorted best first.
    assert np.all(f[1:] <= f[tree.parents[1:]] + 1e-9)
    for d in range(1, 5):
        layer = f[depths == d]
        assert np.all(np.diff(layer) <= 1e-9)


def test_depth_zero_defers_all_work(tiny_llama_dir, hf_model):
    runner = _runner(tiny_llama_dir)
    drafter = BeamDrafter(runner)
    (t0,) = drafter.speculate([_upd("a", HIST["a"][:4], 4)], 0, 3)
    assert t0.tokens.tolist() == [HIST["a"][3]] and runner.committed_len("a") == 0
    (t1,) = drafter.speculate([_upd("a", HIST["a"][4:], 7)], 2, 2)
    _assert_tree(t1, oracle_beam(hf_model, HIST["a"], 2, 2))


def test_lost_state_is_reported_for_all_ids_at_once(tiny_llama_dir, hf_model):
    runner = _runner(tiny_llama_dir)
    drafter = BeamDrafter(runner)
    drafter.speculate([_upd("a", HIST["a"], 7), _upd("b", HIST["b"], 1)], 2, 2)
    usage = runner.kv_usage()
    with pytest.raises(DrafterStateLost) as err:
        drafter.speculate(
            [
                _upd("a", [1, 2], 10),  # drift: the drafter holds 7, 7 + 2 != 10
                _upd("b", [4], 2),  # consistent
                _upd("z", [3, 4], 5),  # unknown, and not a full history
                _upd("c", [], 12),  # unknown
            ],
            2,
            2,
        )
    assert sorted(err.value.ids) == ["a", "c", "z"]
    # "b" untouched; "a"'s stale state is gone (its KV freed).
    assert runner.committed_len("b") == 1 and runner.kv_usage() < usage
    (tb,) = drafter.speculate([_upd("b", [4], 2)], 2, 2)
    _assert_tree(tb, oracle_beam(hf_model, [88, 4], 2, 2))
    # The engine's answer: the full history for the lost ones.
    full = HIST["a"] + [1, 2, 3]
    ta, tb = drafter.speculate([_upd("a", full, 10), _upd("b", [5], 3)], 2, 2)
    _assert_tree(ta, oracle_beam(hf_model, full, 2, 2))
    _assert_tree(tb, oracle_beam(hf_model, [88, 4, 5], 2, 2))


def test_no_new_tokens_is_lost_and_resend_recovers(tiny_llama_dir, hf_model):
    drafter = BeamDrafter(_runner(tiny_llama_dir))
    drafter.speculate([_upd("a", HIST["a"], 7)], 2, 2)
    with pytest.raises(DrafterStateLost):
        drafter.speculate([_upd("a", [], 7)], 2, 2)
    (t,) = drafter.speculate([_upd("a", HIST["a"], 7)], 2, 2)
    _assert_tree(t, oracle_beam(hf_model, HIST["a"], 2, 2))


def test_full_history_for_a_known_id_restarts_it(tiny_llama_dir, hf_model):
    drafter = BeamDrafter(_runner(tiny_llama_dir))
    drafter.speculate([_upd("a", HIST["a"], 7)], 2, 2)
    other = [9, 9, 9]
    (t,) = drafter.speculate([_upd("a", other, 3)], 2, 2)
    _assert_tree(t, oracle_beam(hf_model, other, 2, 2))


def test_release_frees_every_block(tiny_llama_dir):
    runner = _runner(tiny_llama_dir)
    drafter = BeamDrafter(runner)
    for step in range(5):
        drafter.speculate([_upd(k, v, len(v)) for k, v in HIST.items()], 3, 2)
        assert runner.kv_usage() > 0
        drafter.release([*HIST, "never-seen"])
        assert runner.kv_usage() == 0.0, step


def test_bad_arguments(tiny_llama_dir):
    drafter = BeamDrafter(_runner(tiny_llama_dir))
    with pytest.raises(ValueError, match="depth"):
        drafter.speculate([_upd("a", [1], 1)], -1, 1)
    with pytest.raises(ValueError, match="width"):
        drafter.speculate([_upd("a", [1], 1)], 1, 0)
    with pytest.raises(ValueError, match="twice"):
        drafter.speculate([_upd("a", [1], 1), _upd("a", [1], 1)], 1, 1)
    with pytest.raises(ValueError, match="total_len"):
        drafter.speculate([_upd("a", [1, 2], 1)], 1, 1)
    with pytest.raises(ValueError, match="vocabulary"):
        drafter.speculate([_upd("a", [1], 1)], 1, 300)
    assert drafter.runner.kv_usage() == 0.0  # the failed call left nothing behind


def test_cache_exhaustion_leaves_state_consistent(tiny_llama_dir, hf_model):
    runner = _runner(tiny_llama_dir, kv_blocks=6)  # 24 token slots
    drafter = BeamDrafter(runner)
    drafter.speculate([_upd("a", HIST["a"], 7)], 2, 2)
    usage = runner.kv_usage()
    with pytest.raises(KVCacheFull):
        drafter.speculate([_upd("a", [4], 8), _upd("c", HIST["c"], 12)], 3, 3)
    assert runner.kv_usage() == usage and runner.scratch_len("a") == 0
    # "a" continues as if the failed call never happened (its new token still pending).
    (t,) = drafter.speculate([_upd("a", [4], 8)], 2, 2)
    _assert_tree(t, oracle_beam(hf_model, [*HIST["a"], 4], 2, 2))


def test_requests_past_the_drafter_context_get_root_only_trees(tiny_llama_dir, hf_model):
    drafter = BeamDrafter(_runner(tiny_llama_dir, max_model_len=12))
    short, long = HIST["a"], HIST["c"]
    ts, tl = drafter.speculate([_upd("s", short, 7), _upd("l", long, 12)], 3, 2)
    _assert_tree(ts, oracle_beam(hf_model, short, 3, 2))
    assert tl.tokens.tolist() == [long[-1]]


class _ReducedHead:
    """A runner whose LM head keeps only `columns` of the vocabulary (what a drafter
    with a reduced draft vocabulary looks like from the outside)."""

    def __init__(self, runner, columns: np.ndarray) -> None:
        self._runner = runner
        self.draft_to_target = torch.as_tensor(columns)
        self._cols = torch.as_tensor(columns)

    def forward(self, inputs, *, last_only: bool = False):
        return self._runner.forward(inputs, last_only=last_only)[:, self._cols]

    def __getattr__(self, name):
        return getattr(self._runner, name)


def test_draft_vocabulary_maps_back_to_target_ids(tiny_llama_dir, hf_model):
    columns = np.random.default_rng(0).choice(256, 40, replace=False)
    drafter = BeamDrafter(_ReducedHead(_runner(tiny_llama_dir), columns))
    hist = HIST["c"]
    (t,) = drafter.speculate([_upd("c", hist, len(hist))], 3, 2)
    _assert_tree(t, oracle_beam(hf_model, hist, 3, 2, columns=torch.as_tensor(columns)))
    assert set(t.tokens[1:].tolist()) <= set(columns.tolist())
    # An explicit mapping wins over the runner's.
    ident = BeamDrafter(_ReducedHead(_runner(tiny_llama_dir), columns), draft_to_target=columns)
    (t2,) = ident.speculate([_upd("c", hist, len(hist))], 3, 2)
    assert t2.tokens.tolist() == t.tokens.tolist()


def test_a_vocabulary_map_on_the_runners_device_is_taken_as_is(tiny_llama_dir):
    """The loader leaves a distilled drafter's map on the runner's device. A tensor off
    the CPU (here `meta`, on a GPU `cuda`) has no numpy view: the drafter must not ask
    for one (it crashed on the H100 once)."""
    runner = _ReducedHead(_runner(tiny_llama_dir), np.arange(40))
    runner.device = torch.device("meta")
    runner.draft_to_target = torch.arange(40, device="meta")
    assert BeamDrafter(runner)._d2t.device.type == "meta"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_drafter_and_verifier_match_cpu(tiny_llama_dir):
    from adaserve.request import SamplingParams
    from adaserve.sampling import TokenRng
    from adaserve.verify import verify_batch

    trees = {}
    for dev in ("cpu", "cuda"):
        runner = load_runner(tiny_llama_dir, device=dev, dtype="float32", kv_blocks=128)
        drafter = BeamDrafter(runner, draft_to_target=np.arange(256))
        trees[dev] = drafter.speculate([_upd(k, v, len(v)) for k, v in HIST.items()], 3, 3)
        drafter.release(list(HIST))
        assert runner.kv_usage() == 0.0
    for a, b in zip(trees["cpu"], trees["cuda"], strict=True):
        assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-3)
    logits = torch.randn(sum(len(t) for t in trees["cpu"]), 256) * 3
    sps = [
        SamplingParams(),
        SamplingParams(temperature=0.8, top_p=0.9),
        SamplingParams(top_k=5, temperature=1.0),
    ]
    res = {
        dev: verify_batch(trees["cpu"], logits.to(dev), sps, [None, TokenRng(1), TokenRng(2)])
        for dev in ("cpu", "cuda")
    }
    for a, b in zip(res["cpu"], res["cuda"], strict=True):
        assert a.emitted_tokens.tolist() == b.emitted_tokens.tolist()


@pytest.mark.parametrize("stop_prob", [1e-5, 1e-4, 1e-3, 0.01, 0.05, 0.5])
def test_stop_prob_cuts_each_tree_where_its_beams_get_unlikely(tiny_llama_dir, stop_prob):
    """Each request's tree is a prefix of its full-depth tree, cut before the first
    layer whose predecessor has no beam with path probability >= stop_prob; requests of
    one call stop independently."""
    depth, width = 5, 2
    full = BeamDrafter(_runner(tiny_llama_dir))
    cut = BeamDrafter(_runner(tiny_llama_dir))
    ups = [_upd(k, v, len(v)) for k, v in HIST.items()]
    want = full.speculate(ups, depth, width)
    got = cut.speculate(ups, depth, width, stop_prob)
    layers = []
    for g, w in zip(got, want, strict=True):
        k = (len(g) - 1) // width  # layers searched
        assert 1 <= k <= depth and len(g) == 1 + k * width
        m = len(g)
        _assert_tree(g, (w.tokens[:m].tolist(), w.parents[:m].tolist(), w.logprobs[:m]))
        f = w.path_probs()
        depths = w.depths()
        for d in range(1, k):  # went on: a beam of each earlier layer was likely enough
            assert f[depths == d].max() >= stop_prob * (1 - 1e-5)
        if k < depth:  # stopped: no beam of its last layer was
            assert f[depths == k].max() < stop_prob * (1 + 1e-5)
        layers.append(k)
    if stop_prob == 1e-3:  # the fixture's weights give one call two stopping depths
        assert len(set(layers)) > 1, layers
    # Zero searches every request to full depth, as without the argument.
    again = BeamDrafter(_runner(tiny_llama_dir)).speculate(ups, depth, width, 0.0)
    for a, w in zip(again, want, strict=True):
        _assert_tree(a, (w.tokens.tolist(), w.parents.tolist(), w.logprobs))
    # The state after a cut call is that of a full one: the next call matches.
    extra = [_upd(k, [3, 4], len(v) + 2) for k, v in HIST.items()]
    for a, b in zip(full.speculate(extra, 2, 2), cut.speculate(extra, 2, 2), strict=True):
        _assert_tree(b, (a.tokens.tolist(), a.parents.tolist(), a.logprobs))


def test_stop_prob_outside_its_range_is_refused(tiny_llama_dir):
    drafter = BeamDrafter(_runner(tiny_llama_dir))
    for bad in (-0.1, 1.0, float("nan")):
        with pytest.raises(ValueError, match="stop_prob"):
            drafter.speculate([_upd("a", HIST["a"], 7)], 3, 2, bad)
    assert drafter.stats().num_sequences == 0
