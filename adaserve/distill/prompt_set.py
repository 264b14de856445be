"""Build the distillation prompt sets: instructions across coding, chat, QA, writing,
maths and summarisation, composed from templates and topic lists.

Train and held-out prompts draw from DISJOINT topic, task and text lists, so held-out
acceptance measures generalisation, not memorisation. Summarisation prompts are
two-stage: the target first writes a text (`writer`), which is then spliced into
`template` at `{text}`. Deterministic: `python -m adaserve.distill.prompt_set` rewrites
adaserve/distill/prompts/{train,heldout}.jsonl byte for byte.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

PROMPTS_DIR = Path(__file__).parent / "prompts"


@dataclass(frozen=True)
class Topics:
    """The topic, task and text lists prompts are composed from: data, kept in
    prompt_topics.json. The train_* and heldout_* lists are disjoint
    (tests/test_distill_prompts.py checks it)."""

    languages: list[str]
    names: list[str]
    math_items: list[str]
    recipients: list[str]
    train_topics: list[str]
    heldout_topics: list[str]
    train_tasks: list[str]
    heldout_tasks: list[str]
    train_concepts: list[str]
    heldout_concepts: list[str]
    train_activities: list[str]
    heldout_activities: list[str]
    heldout_texts: list[str]


TOPICS = Topics(**json.loads((Path(__file__).parent / "prompt_topics.json").read_text("utf-8")))

EXPLAIN = [
    "Explain {t} in simple terms.",
    "What is {t}?",
    "Give me three interesting facts about {t}.",
    "How does {t} work?",
    "What are the main advantages and disadvantages of {t}?",
    "Write a short paragraph about {t} for a ten-year-old.",
    "Why is {t} important?",
    "Describe the history of {t} briefly.",
    "What are common misconceptions about {t}?",
    "Write a short blog post introduction about {t}.",
    "Create a quiz with three questions about {t}.",
    "Summarize the key ideas of {t} in a few bullet points.",
    "Write a haiku about {t}.",
    "Write a short poem about {t}.",
    "Tell me a fun story that involves {t}.",
    "Compare {t} and {u}.",
    "How are {t} and {u} related?",
    "I am a beginner. Where should I start if I want to learn about {t}?",
    "Write a tweet about {t}.",
    "What questions would an expert ask about {t}?",
]
CODING = [
    "Write a {lang} function that {task}.",
    "How do I write code in {lang} that {task}?",
    "Write a {lang} program that {task}, and explain how it works.",
    "Show me an example in {lang} of a function that {task}, with comments.",
    "Write unit tests in {lang} for a function that {task}.",
]
CODING_CONCEPT = [
    "Explain {c} with a short code example.",
    "What is {c} in programming?",
    "When should I use {c}?",
    "What are common mistakes with {c}?",
]
CHAT = [
    "Hi! Can you help me plan {a}?",
    "Give me some tips for {a}.",
    "I'm nervous about {a}. Any advice?",
    "What should I pack or prepare for {a}?",
    "Can you make a simple checklist for {a}?",
    "My friend and I disagree about {a}. How do we decide?",
    "Write a friendly message inviting my friends to {a}.",
    "What are some fun ideas for {a}?",
]
WRITING = [
    "Write a short email to {who} about {what}.",
    "Write a polite note to {who} about {what}.",
    "Write a short speech for {who} about {what}.",
    "Draft a text message to {who} about {what}.",
]
WRITER = [
    "Write a short news report about {t}.",
    "Write a short informative paragraph about {t}.",
    "Write a short story about {t}.",
    "Write a short opinion piece about {t}.",
    "Write a short product description related to {t}.",
]
SUMMARIZE = [
    "Summarize the following text in one sentence:\n\n{text}",
    "Summarize the following text in two sentences:\n\n{text}",
    "Give three bullet points summarizing this text:\n\n{text}",
    "What is the main idea of this text?\n\n{text}",
    "Write a short title for this text:\n\n{text}",
    "Rewrite this text in simpler words:\n\n{text}",
    "Extract the key facts from this text as a list:\n\n{text}",
    "TL;DR:\n\n{text}",
]


def _math(rng: random.Random) -> str:
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 20)
    item, name = rng.choice(TOPICS.math_items), rng.choice(TOPICS.names)
    return rng.choice(
        [
            f"What is {a} + {b}?",
            f"What is {a} times {c}?",
            f"Solve for x: {c}x + {a} = {a + c * b}.",
            f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have now?",
            f"{name} has {a * c} {item} and shares them equally among {c} friends. How many does each friend get?",
            f"What is {c} percent of {a * 10}?",
            f"Is {a} a prime number? Explain.",
            f"Convert {a} kilometers to miles.",
            f"What is the average of {a}, {b} and {c}?",
        ]
    )


def _user(text: str) -> dict:
    return {"messages": [{"role": "user", "content": text}]}


def build(
    topics: list[str],
    tasks: list[str],
    concepts: list[str],
    activities: list[str],
    texts: list[str],
    rng: random.Random,
    n_math: int,
    per_topic: int,
) -> list[dict]:
    out: list[dict] = []
    for t in topics:
        for tpl in rng.sample(EXPLAIN, per_topic):
            out.append({"category": "qa", **_user(tpl.format(t=t, u=rng.choice(topics)))})
        for tpl in rng.sample(WRITER, 3):
            out.append(
                {
                    "category": "summarize",
                    "writer": tpl.format(t=t),
                    "template": rng.choice(SUMMARIZE),
                }
            )
    for task in tasks:
        for lang in rng.sample(TOPICS.languages, 5):
            out.append(
                {"category": "coding", **_user(rng.choice(CODING).format(lang=lang, task=task))}
            )
    for c in concepts:
        for tpl in rng.sample(CODING_CONCEPT, 3):
            out.append({"category": "coding", **_user(tpl.format(c=c))})
    for a in activities:
        for tpl in rng.sample(CHAT, 5):
            out.append({"category": "chat", **_user(tpl.format(a=a))})
        who, what = rng.choice(TOPICS.recipients), a
        out.append({"category": "chat", **_user(rng.choice(WRITING).format(who=who, what=what))})
    for text in texts:  # hand-written texts: summarisation without a writer stage
        for tpl in rng.sample(SUMMARIZE, 3):
            out.append({"category": "summarize", **_user(tpl.format(text=text))})
    out += [{"category": "math", **_user(_math(rng))} for _ in range(n_math)]
    rng.shuffle(out)
    return [{"id": i, **p} for i, p in enumerate(out)]


def main() -> None:
    train = build(
        TOPICS.train_topics,
        TOPICS.train_tasks,
        TOPICS.train_concepts,
        TOPICS.train_activities,
        [],
        random.Random(1),
        n_math=600,
        per_topic=10,
    )
    heldout = build(
        TOPICS.heldout_topics,
        TOPICS.heldout_tasks,
        TOPICS.heldout_concepts,
        TOPICS.heldout_activities,
        TOPICS.heldout_texts,
        random.Random(2),
        n_math=20,
        per_topic=2,
    )
    # held-out writer stages would need the target at measuring time: keep only direct prompts
    seen = {json.dumps(p.get("messages")) for p in train}  # random maths can collide
    heldout = [p for p in heldout if "writer" not in p and json.dumps(p["messages"]) not in seen]
    heldout = [{**p, "id": i} for i, p in enumerate(heldout)]
    PROMPTS_DIR.mkdir(exist_ok=True)
    for name, rows in (("train", train), ("heldout", heldout)):
        with open(PROMPTS_DIR / f"{name}.jsonl", "w") as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        print(name, len(rows))


if __name__ == "__main__":
    main()
