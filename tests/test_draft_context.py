"""`speculation.draft_context`: the draft model reads only the last N tokens of a prompt
(real tiny models). Its ingestion of a long prompt is work every waiting prompt pays
for; the drafts see less, the output is still the target's own, token for token,
through chunked prefill, preemption and a drafter that loses its state."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from adaserve import metrics
from adaserve.drafter import DrafterStateLost, DraftUpdate
from adaserve.engine import Engine
from adaserve.speculate import BeamDrafter
from adaserve.tree import CandidateTree
from tests._engine import LONG, hf_greedy, make_engine, req, run_to_completion
from tests._engine import target_dir as target_dir  # the module's fixture

WINDOW = 8
NEW_TOKENS = 12


class Recording:
    """A drafter that records every update it is sent; `lose_at`: the call at which it
    drops every request's state and reports it lost (a restarted drafter)."""

    def __init__(self, inner: BeamDrafter, lose_at: int | None = None) -> None:
        self.inner, self.lose_at, self.calls = inner, lose_at, 0
        self.updates: list[DraftUpdate] = []

    def speculate(
        self, updates: list[DraftUpdate], depth: int, width: int, stop_prob: float = 0.0
    ) -> list[CandidateTree]:
        self.calls += 1
        if self.calls == self.lose_at:
            ids = [u.id for u in updates]
            self.inner.release(ids)
            raise DrafterStateLost(ids)
        self.updates.extend(updates)
        return self.inner.speculate(updates, depth, width, stop_prob)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def _engine(target_dir, lose_at: int | None = None, **engine: object) -> tuple[Engine, Recording]:
    # The n-gram drafter beside it reads every token (only the draft model has the
    # window): `auto` asks both for every request.
    eng = make_engine(
        target_dir,
        drafter_dir=target_dir,
        ngram=True,
        engine={"max_batch_tokens": 40, **engine},
        speculation={"draft_context": WINDOW},
    )
    assert eng.drafter is not None
    recording = Recording(eng.drafter.inner, lose_at)  # type: ignore[arg-type]
    eng.drafter.inner = recording  # type: ignore[assignment]
    return eng, recording


def _check_window(recording: Recording, prompts: dict[str, list[int]]) -> None:
    """Every request's updates describe tokens[len(prompt) - WINDOW:] only, in order:
    each continues what the drafter holds, and no update reaches past the window's
    length plus the tokens generated."""
    held: dict[str, int] = {}
    for u in recording.updates:
        held_before = held.get(u.id, 0)
        if held_before + len(u.new_tokens) != u.total_len:
            held_before = 0  # a re-send after lost state: the full history again
        assert held_before + len(u.new_tokens) == u.total_len
        held[u.id] = u.total_len
        assert u.total_len <= WINDOW + NEW_TOKENS
    for rid, prompt in prompts.items():
        first = next(u for u in recording.updates if u.id == rid)
        assert list(first.new_tokens) == prompt[len(prompt) - WINDOW :][: len(first.new_tokens)]


@pytest.mark.parametrize(("method", "lose_at"), [("model", None), ("model", 6), ("auto", None)])
def test_a_draft_window_keeps_the_targets_greedy_output(target_dir, method, lose_at) -> None:
    eng, recording = _engine(target_dir, lose_at)
    resyncs = metrics.drafter_resyncs_total._value.get()
    streams = [
        eng.submit(replace(req(i, p, NEW_TOKENS, 1e5), speculation=method))
        for i, p in enumerate(LONG)
    ]
    reports: list = []
    out = run_to_completion(eng, streams, reports=reports)
    for i, p in enumerate(LONG):
        assert out["tokens"][f"r{i}"] == hf_greedy(target_dir, p, NEW_TOKENS)
    _check_window(recording, {f"r{i}": p for i, p in enumerate(LONG)})
    # The prompts are 89-110 tokens: without the window the drafter would have been
    # sent all of them; with it, at most WINDOW of each plus what was generated.
    sent = sum(len(u.new_tokens) for u in recording.updates)
    assert sent <= len(LONG) * (WINDOW + NEW_TOKENS) * (2 if lose_at else 1)
    sources = [s for r in reports for s in r.sources.values()]
    if method == "model":
        # Every decoding iteration verified a tree the draft model drafted from its
        # window (the plan drafts for every request: its depth does not read a clock).
        assert sources and set(sources) == {"model"}
    else:
        # `auto` merges the n-gram drafter's tree (it reads every token) into the model's
        # or verifies it alone, by the measured draft time: which one is the clock's.
        assert sources and set(sources) <= {"model+ngram", "ngram"}
    if lose_at:
        assert metrics.drafter_resyncs_total._value.get() > resyncs


def test_a_preempted_request_drafts_from_its_window_again(target_dir) -> None:
    # 14 blocks of 16 tokens cannot hold four ~100-token prompts and their outputs: the
    # request with the most slack is preempted, its draft state released, and the
    # recompute sends the drafter the window again, from its first token.
    eng, recording = _engine(target_dir, kv_blocks=14, max_running=8)
    preempted = metrics.preemptions_total._value.get()
    slos = [30.0, 40.0, 1e5, 1e6]
    streams = [eng.submit(req(i, p, NEW_TOKENS, slos[i])) for i, p in enumerate(LONG)]
    out = run_to_completion(eng, streams)
    assert metrics.preemptions_total._value.get() > preempted
    for i, p in enumerate(LONG):
        assert out["tokens"][f"r{i}"] == hf_greedy(target_dir, p, NEW_TOKENS)
    _check_window(recording, {f"r{i}": p for i, p in enumerate(LONG)})


def test_prompts_within_the_window_are_read_whole(target_dir) -> None:
    eng, recording = _engine(target_dir)
    prompt = [5, 6, 7]
    streams = [eng.submit(req(0, prompt, NEW_TOKENS, 1e5))]
    out = run_to_completion(eng, streams)
    assert out["tokens"]["r0"] == hf_greedy(target_dir, prompt, NEW_TOKENS)
    first = recording.updates[0]
    assert list(first.new_tokens[:3]) == prompt and np.all(
        [u.total_len <= len(prompt) + NEW_TOKENS for u in recording.updates]
    )


def test_a_prompt_served_from_the_prefix_cache_drafts_from_its_window(target_dir) -> None:
    # The second request's prompt extends the first's: its KV comes from the prefix
    # cache (the target prefills only the rest), and the drafter, which keeps no prefix
    # cache, is still sent the window from its first token.
    eng, recording = _engine(target_dir)
    first, second = LONG[0], LONG[0] + [7, 8, 9]
    run_to_completion(eng, [eng.submit(req(0, first, NEW_TOKENS, 1e5))])
    hits = metrics.prefix_cache_hits._value.get()
    out = run_to_completion(eng, [eng.submit(req(1, second, NEW_TOKENS, 1e5))])
    assert metrics.prefix_cache_hits._value.get() > hits
    assert out["tokens"]["r1"] == hf_greedy(target_dir, second, NEW_TOKENS)
    _check_window(recording, {"r0": first, "r1": second})
