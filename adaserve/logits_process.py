"""Logits processors at every tree node: penalties, logit bias, min_tokens, bad words,
allowed tokens and the grammar mask of structured output.

Plain decoding processes the one row that picks the next token from the request's
history (prompt + output). A tree row is the same position on a hypothetical path, so
each row here is processed from *its own* history: the committed output plus the drafted
tokens on the path from the root to that node. The processed row is then bitwise what
plain decoding would have at that position (the same elementwise operations on the
same values), which is what keeps greedy and seeded sampling identical with or without
speculation. The drafter ignores all of this; it only costs acceptance.

Order, as vLLM applies them: min_tokens, logit_bias, allowed_token_ids, bad_words,
repetition / frequency / presence penalties, the grammar mask. Temperature, min_p,
top-k and top-p follow in `sampling.filtered_probs`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from adaserve.request import SamplingParams, TokenLogprobs

NEG_INF = float("-inf")


@dataclass(frozen=True)
class LogitsContext:
    """What one request's rows need: its settings, its committed history and, with
    structured output, the grammar's mask at every row."""

    sampling: SamplingParams
    prompt: np.ndarray  # int32 [P]
    output: np.ndarray  # int32 [G]: tokens generated so far (committed)
    stop_ids: tuple[int, ...]  # what min_tokens holds back: eos unless ignore_eos, stop ids
    masks: np.ndarray | None = None  # int32 [rows, ceil(V / 32)] bitmask per row; None: none


def path_tokens(parents: np.ndarray, tokens: np.ndarray) -> list[list[int]]:
    """Per node: the drafted tokens from below the root down to it (the root is the last
    committed token, already in the history); [] for the root."""
    out: list[list[int]] = []
    for v in range(len(parents)):
        p = int(parents[v])
        out.append([] if p < 0 else [*out[p], int(tokens[v])])
    return out


def unpack_masks(masks: np.ndarray, vocab: int) -> torch.Tensor:
    """bool [R, vocab] from int32 bitmasks [R, W] (bit j of word w: token 32 w + j)."""
    bits = np.unpackbits(np.ascontiguousarray(masks).view(np.uint8), axis=1, bitorder="little")
    if bits.shape[1] < vocab:  # a tokenizer smaller than the model: the rest is not text
        bits = np.pad(bits, ((0, 0), (0, vocab - bits.shape[1])))
    return torch.from_numpy(bits[:, :vocab].astype(bool))


def process_rows(
    logits: torch.Tensor, parents: np.ndarray, tokens: np.ndarray, ctx: LogitsContext
) -> torch.Tensor:
    """The processed logits [R, V] of one request's rows (a tree, node order; or one row
    with parents [-1]). A new tensor; `logits` is not modified."""
    sp = ctx.sampling
    vocab = logits.shape[1]
    out = logits.float().clone()
    paths = path_tokens(parents, tokens)
    hist = [np.concatenate([ctx.output, np.asarray(p, dtype=np.int64)]) for p in paths]
    if sp.min_tokens and ctx.stop_ids:
        early = [r for r, p in enumerate(paths) if len(ctx.output) + len(p) < sp.min_tokens]
        stops = [t for t in ctx.stop_ids if t < vocab]
        if early and stops:
            out[np.ix_(early, stops)] = NEG_INF
    if sp.logit_bias:
        ids = torch.tensor([t for t, _ in sp.logit_bias], dtype=torch.int64)
        bias = torch.tensor([b for _, b in sp.logit_bias], dtype=torch.float32)
        out[:, ids] += bias
    if sp.allowed_token_ids:
        keep = torch.zeros(vocab, dtype=torch.bool)
        keep[list(sp.allowed_token_ids)] = True
        out.masked_fill_(~keep, NEG_INF)
    if sp.bad_words:
        _ban_bad_words(out, sp.bad_words, ctx.prompt, hist)
    if sp.repetition_penalty != 1.0:
        seen = _presence(np.concatenate([ctx.prompt, ctx.output]), paths, vocab)
        # HF's RepetitionPenaltyLogitsProcessor: negative logits x p, the rest / p.
        p = sp.repetition_penalty
        out = torch.where(seen, torch.where(out < 0, out * p, out / p), out)
    if sp.frequency_penalty or sp.presence_penalty:
        counts = _counts(ctx.output, paths, vocab)
        out -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0).float()
    if ctx.masks is not None:
        allowed = unpack_masks(ctx.masks, vocab)
        out.masked_fill_(~allowed, NEG_INF)
        # A row the grammar allows something in but min_tokens or bias emptied (the
        # grammar can only end): the grammar wins. A function of the row alone, so the
        # plain step would do the same.
        empty = torch.isneginf(out).all(dim=1) & allowed.any(dim=1)
        if bool(empty.any()):
            out[empty] = logits[empty].float().masked_fill(~allowed[empty], NEG_INF)
    dead = torch.isneginf(out).all(dim=1)
    if bool(dead.any()):  # nothing left (a stopped grammar's after-stop rows): unprocessed
        out[dead] = logits[dead].float()
    return out


def _ban_bad_words(
    out: torch.Tensor, words: Sequence[tuple[int, ...]], prompt: np.ndarray, hist: list[np.ndarray]
) -> None:
    """Ban the last token of every bad word whose other tokens end the row's history
    (prompt + output + path, as Hugging Face's NoBadWordsLogitsProcessor reads it)."""
    vocab = out.shape[1]
    for r, h in enumerate(hist):
        full = np.concatenate([prompt, h]) if any(len(w) > 1 for w in words) else h
        for w in words:
            if w[-1] >= vocab:
                continue
            k = len(w) - 1
            if k == 0 or (len(full) >= k and tuple(full[len(full) - k :].tolist()) == w[:-1]):
                out[r, w[-1]] = NEG_INF


def _presence(history: np.ndarray, paths: list[list[int]], vocab: int) -> torch.Tensor:
    base = torch.zeros(vocab, dtype=torch.bool)
    if len(history):
        base[torch.from_numpy(history.astype(np.int64))] = True
    seen = base.expand(len(paths), vocab).clone()
    rows, toks = _path_index(paths)
    seen[rows, toks] = True
    return seen


def _counts(output: np.ndarray, paths: list[list[int]], vocab: int) -> torch.Tensor:
    base = torch.bincount(torch.from_numpy(output.astype(np.int64)), minlength=vocab)[:vocab]
    counts = base.float().expand(len(paths), vocab).clone()
    rows, toks = _path_index(paths)
    counts.index_put_((rows, toks), torch.ones(len(rows)), accumulate=True)
    return counts


def _path_index(paths: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [r for r, p in enumerate(paths) for _ in p]
    toks = [t for p in paths for t in p]
    return torch.tensor(rows, dtype=torch.int64), torch.tensor(toks, dtype=torch.int64)


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
