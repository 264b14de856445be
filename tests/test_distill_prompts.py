"""The distillation prompt sets: held-out topics are disjoint from training, and the
committed files are what the generator writes."""

from __future__ import annotations

import json
import random

from adaserve.distill import prompt_set
from adaserve.distill.prompt_set import TOPICS


def _rows(name: str) -> list[dict]:
    with open(prompt_set.PROMPTS_DIR / f"{name}.jsonl") as f:
        return [json.loads(line) for line in f]


def test_topic_lists_are_disjoint() -> None:
    for train, held in (
        (TOPICS.train_topics, TOPICS.heldout_topics),
        (TOPICS.train_tasks, TOPICS.heldout_tasks),
        (TOPICS.train_concepts, TOPICS.heldout_concepts),
        (TOPICS.train_activities, TOPICS.heldout_activities),
    ):
        assert not {x.lower() for x in train} & {x.lower() for x in held}


def test_heldout_prompts_never_appear_in_training() -> None:
    train = {json.dumps(r.get("messages") or r["writer"]) for r in _rows("train")}
    held = _rows("heldout")
    assert len(held) >= 200
    assert not any(json.dumps(r["messages"]) in train for r in held)
    assert {r["category"] for r in held} == {"qa", "coding", "chat", "summarize", "math"}


def test_committed_files_are_reproducible() -> None:
    train = prompt_set.build(
        TOPICS.train_topics,
        TOPICS.train_tasks,
        TOPICS.train_concepts,
        TOPICS.train_activities,
        [],
        random.Random(1),
        n_math=600,
        per_topic=10,
    )
    assert train == _rows("train")


def test_two_stage_prompts_have_a_slot() -> None:
    writers = [r for r in _rows("train") if "writer" in r]
    assert len(writers) > 300
    assert all("{text}" in r["template"] for r in writers)
