"""Logits processors at every tree node: penalties, logit bias, min_tokens, bad words,
allowed tokens and the grammar mask of structured output.

Plain decoding processes the one row that picks the next token from the request's
history (prompt + output). A tree row is the same position on a hypothetical path, so
each row here is processed from *its own* history: the committed output plus the drafted
tokens on the path from the root to that node. The processed row is then bitwise what
plain decoding would have at that position (the same elementwise operations on the
same values), which is what keeps greedy and seeded sampling identical with or without
speculation. The drafter ignores all of this; it only costs acceptance.

Order: logit_bias, then repetition / frequency / presence penalties, then what sets
-inf (min_tokens' held-back stop tokens, bad words, allowed_token_ids, the grammar
mask; -inf commutes with the rest). Temperature, min_p, top-k and top-p follow in
`sampling.filtered_probs`.
"""

from __future__ import annotations

import numpy as np
import torch

from adaserve.request import SamplingParams, TokenLogprobs
from adaserve.target import LogitsContext

NEG_INF = float("-inf")


def path_tokens(parents: np.ndarray, tokens: np.ndarray) -> list[list[int]]:
    """Per node: the drafted tokens from below the root down to it (the root is the last
    committed token, already in the history); [] for the root."""
    out: list[list[int]] = []
    for v in range(len(parents)):
        p = int(parents[v])
        out.append([] if p < 0 else [*out[p], int(tokens[v])])
    return out


def unpack_bits(masks: np.ndarray, vocab: int) -> np.ndarray:
    """bool [R, vocab] from int32 bitmasks [R, W] (bit j of word w: token 32 w + j)."""
    bits = np.unpackbits(np.ascontiguousarray(masks).view(np.uint8), axis=1, bitorder="little")
    if bits.shape[1] < vocab:  # a tokenizer smaller than the model: the rest is not text
        bits = np.pad(bits, ((0, 0), (0, vocab - bits.shape[1])))
    return bits[:, :vocab].astype(bool)


def process_rows(
    logits: torch.Tensor, parents: np.ndarray, tokens: np.ndarray, ctx: LogitsContext
) -> torch.Tensor:
    """The processed logits [R, V] of one request's rows (a tree, node order; or one row
    with parents [-1]), as a new tensor; `logits` is not modified."""
    out = logits.float().clone()
    process_rows_(out, parents, tokens, ctx)
    return out


def process_rows_(
    logits: torch.Tensor, parents: np.ndarray, tokens: np.ndarray, ctx: LogitsContext
) -> None:
    """`process_rows` in place, on `logits` [R, V] (a view of the forward's).

    Penalties, bias and bans touch only the tokens they name (a history has hundreds
    of distinct tokens, the vocabulary tens of thousands): on a CPU the cost is a few
    small indexed ops per row instead of a dozen passes over the vocabulary. Masks
    (grammar, allowed_token_ids) are one pass. Where bans would leave a row nothing the
    grammar allows (min_tokens before a grammar that can only end), the grammar wins: a
    function of the row alone, so plain decoding does the same at that position."""
    sp = ctx.sampling
    vocab = logits.shape[1]
    paths = path_tokens(parents, tokens)
    bans = _bans(sp, ctx, paths, vocab)
    if sp.logit_bias:
        dev = logits.device
        ids = torch.tensor([t for t, _ in sp.logit_bias], dtype=torch.int64, device=dev)
        bias = torch.tensor([b for _, b in sp.logit_bias], dtype=logits.dtype, device=dev)
        logits[:, ids] += bias
    if sp.repetition_penalty != 1.0 or sp.frequency_penalty or sp.presence_penalty:
        _penalize(logits, sp, ctx, paths)
    if ctx.masks is None and not sp.allowed_token_ids:
        for r, banned in bans.items():
            logits[r, banned.to(logits.device)] = NEG_INF
        return
    # Masks are built on the host (numpy, single-threaded) and applied in one op: on a
    # busy CPU each torch op over the vocabulary costs a parallel region.
    keep = np.ones((len(paths), vocab), dtype=bool)
    if ctx.masks is not None:
        keep = unpack_bits(ctx.masks, vocab)
    if sp.allowed_token_ids:
        allowed = np.zeros(vocab, dtype=bool)
        allowed[list(sp.allowed_token_ids)] = True
        keep &= allowed
    if bans:
        grammar = keep.copy()
        for r, banned in bans.items():
            keep[r, banned.numpy()] = False
        empty = ~keep.any(axis=1)
        keep[empty] = grammar[empty]
    nothing = ~keep.any(axis=1)  # rows after a stop token: never emitted from, kept finite
    if logits.device.type == "cpu" and logits.dtype == torch.float32:  # no parallel region
        rows = logits.numpy()
        np.copyto(rows, NEG_INF, where=~keep)
        rows[nothing] = 0.0
        return
    logits.masked_fill_(torch.from_numpy(~keep).to(logits.device), NEG_INF)
    if nothing.any():  # rows after a stop token: never emitted from, kept finite
        logits[torch.from_numpy(nothing).to(logits.device)] = 0.0


def _bans(
    sp: SamplingParams, ctx: LogitsContext, paths: list[list[int]], vocab: int
) -> dict[int, torch.Tensor]:
    """Per row, the token ids it may not emit: stop tokens before min_tokens, and the
    last token of every bad word whose other tokens end the row's history."""
    out: dict[int, list[int]] = {}
    if sp.min_tokens and ctx.stop_ids:
        stops = [t for t in ctx.stop_ids if t < vocab]
        for r, p in enumerate(paths):
            if stops and len(ctx.output) + len(p) < sp.min_tokens:
                out.setdefault(r, []).extend(stops)
    if sp.bad_words:
        # Matched against prompt + output + path, as Hugging Face's NoBadWordsLogitsProcessor
        # reads its input ids.
        longest = max(len(w) for w in sp.bad_words) - 1
        base = np.concatenate([ctx.prompt, ctx.output]).astype(np.int64)
        tail = base[len(base) - longest :].tolist() if longest else []
        for r, p in enumerate(paths):
            hist = (tail + p)[-longest:] if longest else []
            for w in sp.bad_words:
                k = len(w) - 1
                if w[-1] < vocab and (k == 0 or (len(hist) >= k and tuple(hist[-k:]) == w[:-1])):
                    out.setdefault(r, []).append(w[-1])
    return {r: torch.tensor(sorted(set(ids)), dtype=torch.int64) for r, ids in out.items()}


def _penalize(
    logits: torch.Tensor, sp: SamplingParams, ctx: LogitsContext, paths: list[list[int]]
) -> None:
    """Repetition (HF's: prompt + output, negative logits x p, the rest / p), then
    OpenAI's frequency and presence (output only: minus count x f + p), per row on the
    tokens its history holds."""
    output = ctx.output.astype(np.int64)
    seen = np.unique(np.concatenate([ctx.prompt.astype(np.int64), output]))
    for r, p in enumerate(paths):
        row = logits[r]
        path = np.asarray(p, dtype=np.int64)
        if sp.repetition_penalty != 1.0:
            ids = torch.from_numpy(np.union1d(seen, path)).to(logits.device)
            v = row[ids]
            pen = sp.repetition_penalty
            row[ids] = torch.where(v < 0, v * pen, v / pen)
        if sp.frequency_penalty or sp.presence_penalty:
            ids_np, counts = np.unique(np.concatenate([output, path]), return_counts=True)
            if ids_np.shape[0]:
                c = torch.from_numpy(counts).to(logits.device, logits.dtype)
                ids = torch.from_numpy(ids_np).to(logits.device)
                row[ids] -= sp.frequency_penalty * c + sp.presence_penalty * (c > 0).float()


SCORE_ROWS = 128  # rows log-softmaxed at once: the temporaries stay [128, V]


def scored_logprobs(logits: torch.Tensor, tokens: np.ndarray, k: int) -> TokenLogprobs:
    """`token_logprobs` plus each token's rank in its row (1: the most likely; ties
    count in the token's favour), on whatever device `logits` [m, V] is, SCORE_ROWS
    rows at a time: only the m x (k + 2) values come back to the host (prompt
    logprobs, one prefill chunk at a time)."""
    ids = torch.as_tensor(np.asarray(tokens, dtype=np.int64), device=logits.device)
    parts: list[tuple[torch.Tensor, ...]] = []
    for a in range(0, logits.shape[0], SCORE_ROWS):
        lp = torch.log_softmax(logits[a : a + SCORE_ROWS].float(), dim=-1)
        chosen = lp.gather(1, ids[a : a + SCORE_ROWS, None])
        ranks = (lp > chosen).sum(dim=-1) + 1
        top_lp, top_ids = torch.topk(lp, k, dim=-1, sorted=True)
        parts.append((chosen[:, 0], top_ids, top_lp, ranks))
    chosen, top_ids, top_lp, ranks = (torch.cat(p).cpu().numpy() for p in zip(*parts, strict=True))
    return TokenLogprobs(
        chosen.astype(np.float32),
        top_ids.astype(np.int32),
        top_lp.astype(np.float32),
        ranks.astype(np.int32),
    )


def token_logprobs(logits: torch.Tensor, tokens: np.ndarray, k: int) -> TokenLogprobs:
    """Log-probabilities of `tokens[i]` under row i of the raw `logits` [m, V], and each
    row's k most likely tokens (descending)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.as_tensor(np.asarray(tokens, dtype=np.int64))
    chosen = lp.gather(1, ids[:, None])[:, 0]
    if k > 0:
        top_lp, top_ids = torch.topk(lp, k, dim=-1, sorted=True)
    else:
        top_lp = torch.zeros((lp.shape[0], 0))
        top_ids = torch.zeros((lp.shape[0], 0), dtype=torch.int64)
    return TokenLogprobs(
        chosen.numpy().astype(np.float32),
        top_ids.numpy().astype(np.int32),
        top_lp.numpy().astype(np.float32),
    )
