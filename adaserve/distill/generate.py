"""Batched target generation (greedy or sampled) over left-padded prompts: the
continuations the drafter is trained to imitate, with the target's top-k
log-probabilities at every generated position (the distillation labels, so training
never runs the target again)."""

from __future__ import annotations

import multiprocessing as mp
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from adaserve.distill.llama import KVCache, LlamaModel
from adaserve.model.cuda_graphs import GraphRunner

TOPK = 32


@dataclass
class Continuation:
    tokens: list[int]  # ends with an eos id when one was produced
    topk_ids: torch.Tensor  # int32 [len(tokens), TOPK]: target's most likely next tokens
    topk_logp: torch.Tensor  # float16 [len(tokens), TOPK]: their log-probabilities (T = 1)
    # float16 [len(prompt) + len(tokens) - 1, F * hidden] when feature layers were asked
    # for: the target's features at every position but the last (an EAGLE head's input;
    # the last token is never fed back, and nothing is trained after it)
    features: torch.Tensor | None = None


def _sample(
    logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator | None
) -> torch.Tensor:
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, -1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = sorted_p.cumsum(-1) - sorted_p >= top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


@torch.no_grad()
def generate_batch(
    model: LlamaModel,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_ids: Sequence[int],
    temperature: float = 0.0,
    top_p: float = 1.0,
    gen: torch.Generator | None = None,
    topk: int = TOPK,
    static: bool | None = None,
    feature_layers: Sequence[int] = (),
) -> list[Continuation]:
    """Continuations for one batch of prompts. `static` (default: on CUDA) runs decode
    steps at fixed shapes, replayed from a CUDA graph on a GPU, where eager decoding of a
    small model is bound by kernel launches. `feature_layers`: also keep the target's
    features there (Continuation.features), captured while generating: no second pass."""
    device = model.embed_tokens.weight.device
    b, plen = len(prompts), max(len(p) for p in prompts)
    if min(len(p) for p in prompts) == 0:
        raise ValueError("empty prompt")
    ids = torch.full((b, plen), int(eos_ids[0]), dtype=torch.long, device=device)
    valid = torch.zeros((b, plen + max_new_tokens), dtype=torch.bool, device=device)
    for i, p in enumerate(prompts):
        ids[i, plen - len(p) :] = torch.tensor(list(p), device=device)
        valid[i, plen - len(p) : plen] = True
    positions = (valid[:, :plen].long().cumsum(1) - 1).clamp(min=0)
    cache = KVCache(
        model.shape,
        len(model.layers),
        b,
        plen + max_new_tokens,
        device,
        model.embed_tokens.weight.dtype,
    )
    causal = torch.ones(plen, plen, dtype=torch.bool, device=device).tril()
    # a padding query attends to itself only, so no softmax row is empty
    mask = (causal[None] & valid[:, None, :plen]) | torch.eye(plen, dtype=torch.bool, device=device)
    layers = tuple(feature_layers)
    hidden, pf = model.forward_features(ids, layers, positions, mask[:, None], cache)
    hidden = hidden[:, -1]
    eos = torch.tensor(list(eos_ids), device=device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    out = torch.full((b, max_new_tokens), -1, dtype=torch.long, device=device)
    top_ids = torch.zeros((b, max_new_tokens, topk), dtype=torch.int32, device=device)
    top_logp = torch.zeros((b, max_new_tokens, topk), dtype=torch.float16, device=device)
    logits, lp, ix = _labels(model, hidden, topk)
    gen_feats = None
    if pf is not None:
        gen_feats = torch.zeros(
            (b, max_new_tokens, pf.shape[-1]), dtype=torch.float16, device=device
        )
    if static is None:
        static = device.type == "cuda"
    step_fn = _Step(model, cache, valid, positions[:, -1], topk, static, layers)
    if static and device.type == "cuda":
        step_fn = _graphed(step_fn, plen)
    for step in range(max_new_tokens):
        top_ids[:, step], top_logp[:, step] = ix.int(), lp.half()
        tok = _sample(logits, temperature, top_p, gen)
        out[:, step] = torch.where(done, -1, tok)
        done |= torch.isin(tok, eos)
        # finished rows emit -1 from here on, so checking only now and then (each check
        # waits for the GPU) costs a few wasted steps at most
        if step == max_new_tokens - 1 or (step % 8 == 7 and bool(done.all())):
            break
        logits, lp, ix, *feat = step_fn(tok, plen + step)
        if gen_feats is not None:
            gen_feats[:, step] = feat[0][:, 0].half()  # the features of the token just fed
    rows, top_ids, top_logp = out.cpu().tolist(), top_ids.cpu(), top_logp.cpu()
    result = []
    for r, row in enumerate(rows):
        n = sum(t >= 0 for t in row)  # generated tokens form a prefix of the row
        c = Continuation(row[:n], top_ids[r, :n].clone(), top_logp[r, :n].clone())
        if pf is not None and gen_feats is not None:
            p = len(prompts[r])  # left-padded: the prompt's positions are the last p
            c.features = torch.cat([pf[r, plen - p :].half(), gen_feats[r, : n - 1]]).cpu()
        result.append(c)
    return result


def _labels(model: LlamaModel, hidden: torch.Tensor, topk: int) -> tuple[torch.Tensor, ...]:
    """hidden [B, hidden] -> fp32 logits, and the top-k labels of their log-softmax."""
    logits = model.logits(hidden).float()
    lp, ix = torch.log_softmax(logits, -1).topk(topk, -1)
    return logits, lp, ix


class _Step:
    """One decode step: write token `tok` at cache slot `slot`, return the next labels.
    `static` runs it at fixed shapes: the cache writes at the tensor `cache.slot` and
    attention spans the whole cache (unwritten slots masked), so it can be graphed."""

    def __init__(
        self,
        model: LlamaModel,
        cache: KVCache,
        valid: torch.Tensor,
        pos: torch.Tensor,
        topk: int,
        static: bool,
        feature_layers: tuple[int, ...] = (),
    ) -> None:
        self.model, self.cache, self.valid, self.topk = model, cache, valid, topk
        self.feature_layers = feature_layers
        self.pos = pos.clone()  # position of the last token written, per row
        self.tok = torch.zeros_like(pos)
        if static:
            cache.slot = torch.zeros(1, dtype=torch.long, device=pos.device)

    def set_inputs(self, tok: torch.Tensor, slot: int) -> None:
        self.valid[:, slot] = True
        self.pos += 1
        self.tok.copy_(tok)
        if self.cache.slot is not None:
            self.cache.slot.fill_(slot)

    def forward(self, slot: int | None = None) -> tuple[torch.Tensor, ...]:
        if self.cache.slot is not None:
            m = self.valid[:, None, None, :]
        elif slot is not None:
            m = self.valid[:, None, None, : slot + 1]
        else:
            raise ValueError("an eager step (no static cache slot) needs its slot")
        hidden, feats = self.model.forward_features(
            self.tok[:, None], self.feature_layers, self.pos[:, None], m, self.cache
        )
        labels = _labels(self.model, hidden[:, -1], self.topk)
        return labels if feats is None else (*labels, feats)

    def __call__(self, tok: torch.Tensor, slot: int) -> tuple[torch.Tensor, ...]:
        self.set_inputs(tok, slot)
        return self.forward(slot)


def _graphed(
    step: _Step, first_slot: int
) -> Callable[[torch.Tensor, int], tuple[torch.Tensor, ...]]:
    """`step` captured once as a CUDA graph (one key: the batch has one shape); calls
    update its inputs in place and replay. The warm-up runs write into the first decode
    slot, which the first real step rewrites."""
    assert step.cache.slot is not None, "only a static step has fixed shapes"
    step.cache.slot.fill_(first_slot)
    graphs: GraphRunner[int, tuple[torch.Tensor, ...]] = GraphRunner()
    graphs.capture([0], lambda _key: step.forward(), warmup=2)

    def run(tok: torch.Tensor, slot: int) -> tuple[torch.Tensor, ...]:
        step.set_inputs(tok, slot)
        return graphs.replay(0)

    return run


_WORKER: dict = {}


def _worker_init(target_dir: str) -> None:
    from adaserve.distill.weights import load_teacher

    torch.set_num_threads(1)  # one thread per process: far faster on a busy shared CPU
    _WORKER["model"] = load_teacher(Path(target_dir))


def _worker_run(task: tuple) -> list[Continuation]:
    prompts, max_new, eos, temperature, top_p, seed, layers = task
    gen = torch.Generator().manual_seed(seed)
    return generate_batch(
        _WORKER["model"], prompts, max_new, eos, temperature, top_p, gen, feature_layers=layers
    )


def generate_all(
    model: LlamaModel,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_ids: Sequence[int],
    batch_size: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    deadline: float | None = None,
    desc: str = "generate",
    workers: int = 1,
    target_dir: Path | None = None,
    feature_layers: Sequence[int] = (),
) -> list[Continuation | None]:
    """Continuations in prompt order; None for prompts skipped because `deadline`
    (a time.monotonic() value) passed. Batches group similar prompt lengths.
    workers > 1 (CPU only) runs batches in single-threaded processes that each load
    the target from `target_dir`."""
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    batches = [order[s : s + batch_size] for s in range(0, len(order), batch_size)]
    results: list[Continuation | None] = [None] * len(prompts)
    bar = tqdm(total=len(prompts), desc=desc, unit="prompt", mininterval=2.0)

    def tasks():
        for k, idx in enumerate(batches):
            if deadline is not None and time.monotonic() > deadline:
                return
            yield (
                [list(prompts[i]) for i in idx],
                max_new_tokens,
                list(eos_ids),
                temperature,
                top_p,
                seed + k,
                tuple(feature_layers),
            )

    def store(idx: list[int], outs: list[Continuation]) -> None:
        for i, o in zip(idx, outs, strict=True):
            results[i] = o
        bar.update(len(idx))

    if workers <= 1:
        device = model.embed_tokens.weight.device
        gen = torch.Generator(device=device).manual_seed(seed)
        for idx, task in zip(batches, tasks(), strict=False):
            store(idx, generate_batch(model, task[0], *task[1:5], gen=gen, feature_layers=task[6]))
    else:
        if target_dir is None:
            raise ValueError("workers > 1 needs target_dir")
        todo = zip(batches, tasks(), strict=False)  # lazy: the deadline is checked per submit
        with mp.get_context("spawn").Pool(workers, _worker_init, (str(target_dir),)) as pool:
            pending: deque = deque()

            def submit() -> None:
                nxt = next(todo, None)
                if nxt is not None:
                    pending.append((nxt[0], pool.apply_async(_worker_run, (nxt[1],))))

            for _ in range(workers):
                submit()
            while pending:
                idx, res = pending.popleft()
                store(idx, res.get())
                submit()
    bar.close()
    return results
