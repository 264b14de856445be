"""Draft-step CUDA graph buckets and padding: eager on CPU, capture/replay on CUDA."""

from __future__ import annotations

import pytest
import torch

from adaserve.model.cuda_graphs import DEFAULT_N_BUCKETS, DraftStepGraphs, pad_inputs, pick_bucket


def test_pick_bucket():
    assert pick_bucket(1) == 1
    assert pick_bucket(3) == 4
    assert pick_bucket(13) == 16
    assert pick_bucket(256) == 256
    assert pick_bucket(257) is None
    assert pick_bucket(5, (2, 8)) == 8
    with pytest.raises(ValueError, match="n must be"):
        pick_bucket(0)


def test_pad_inputs_per_request_and_per_token():
    n, w, bucket = 3, 2, 4
    tokens = torch.arange(n * w)
    lens = torch.tensor([5, 6, 7])
    tables = torch.ones(n, 8, dtype=torch.int32)
    out = pad_inputs(
        {"tokens": tokens, "lens": lens, "tables": tables}, n, w, bucket, {"tables": -1}
    )
    assert out["tokens"].tolist() == [0, 1, 2, 3, 4, 5, 0, 0]
    assert out["lens"].tolist() == [5, 6, 7, 0]
    assert out["tables"].shape == (4, 8) and out["tables"][3].tolist() == [-1] * 8
    assert out["tables"].dtype == torch.int32
    same = pad_inputs({"tokens": tokens}, n, w, n)
    assert same["tokens"] is tokens  # nothing to pad: no copy
    with pytest.raises(ValueError, match="rows"):
        pad_inputs({"bad": torch.zeros(5)}, n, w, bucket)
    with pytest.raises(ValueError, match="smaller"):
        pad_inputs({"tokens": tokens}, n, w, 2)


class _ToyDraftStep(torch.nn.Module):
    """Shaped like a draft step: per-token embeddings, mixing *within* each request's w
    tokens (as tree attention does), per-request features, an LM head."""

    def __init__(self, vocab: int = 50, hidden: int = 16, width: int = 2) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.width = width
        self.emb = torch.nn.Parameter(torch.randn(vocab, hidden, generator=g))
        self.pos = torch.nn.Parameter(torch.randn(64, hidden, generator=g))
        self.head = torch.nn.Parameter(torch.randn(hidden, vocab, generator=g))

    def forward(self, x) -> torch.Tensor:
        h = self.emb[x["tokens"]] + self.pos[x["positions"]]  # [n*w, H]
        per_req = h.view(-1, self.width, h.shape[-1]).mean(1, keepdim=True)  # [n, 1, H]
        h = h.view(-1, self.width, h.shape[-1]) + per_req + x["lens"].float()[:, None, None]
        return torch.tanh(h.reshape(-1, h.shape[-1])) @ self.head


def _inputs(n: int, w: int, seed: int, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return {
        "tokens": torch.randint(0, 50, (n * w,), generator=g).to(device),
        "positions": torch.randint(0, 60, (n * w,), generator=g).to(device),
        "lens": torch.randint(1, 60, (n,), generator=g).to(device),
    }


@pytest.mark.parametrize("width", [1, 2, 3])
def test_padding_is_invisible_to_real_rows_eager(width):
    step = _ToyDraftStep(width=width)
    graphs = DraftStepGraphs(step, widths=[1, 2, 3], enabled=False)
    with torch.no_grad():
        for n in (1, 3, 5, 13, 50, 300):
            x = _inputs(n, width, n)
            ref = step(x)
            padded = graphs.eager_padded(x, n, width)
            assert padded.shape == ref.shape
            torch.testing.assert_close(padded, ref, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(graphs(x, n, width), ref)  # CPU: plain eager


def test_shape_for_and_validation():
    graphs = DraftStepGraphs(lambda x: x["tokens"], widths=[1, 4], enabled=False)
    assert graphs.shape_for(5, 4) == (8, 4)
    assert graphs.shape_for(5, 3) is None  # width without graphs: eager
    assert graphs.shape_for(10_000, 1) is None
    assert not graphs.enabled
    with pytest.raises(ValueError, match="increasing"):
        DraftStepGraphs(lambda x: x, widths=[1], n_buckets=(4, 2))
    assert tuple(sorted(DEFAULT_N_BUCKETS)) == DEFAULT_N_BUCKETS


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_capture_and_replay_match_eager_on_cuda():
    width = 2
    step = _ToyDraftStep(width=width).cuda()
    graphs = DraftStepGraphs(step, widths=[width], n_buckets=(1, 4, 16))
    with torch.no_grad():
        graphs.capture(lambda b, w: _inputs(b, w, 0, "cuda"))
        assert set(graphs._graphs) == {(1, 2), (4, 2), (16, 2)}
        for n in (1, 3, 4, 11, 16, 17):
            x = _inputs(n, width, 100 + n, "cuda")
            torch.testing.assert_close(graphs(x, n, width), step(x), rtol=1e-5, atol=1e-5)
