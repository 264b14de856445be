"""The differential tester's cases (adaserve/bench/fuzz.py): one random request per
(seed, case number), and the smaller requests a mismatching case shrinks through."""

from __future__ import annotations

import copy
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

# Prompts: short (the CPU pays for every token), some repetitive so n-gram drafts hit.
PROMPTS = [
    "Tell me about colours.",
    "Write a Python function that reverses a string.",
    "List the days of the week.",
    "Explain photosynthesis in one sentence.",
    "Count from one to ten: one, two, three,",
    "The capital of France is",
    "Summarize: The cat sat on the mat. The cat sat on the mat again. The cat slept.",
    "def fibonacci(n):",
]
SYSTEM = "You are a helpful assistant. Be brief."
NEVER = "\u2603\u2603qz"  # a stop string the model does not write
VOCAB = 49152  # the embedded target's (logit_bias ids below it)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
            "required": ["zone"],
        },
    },
}
SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["colour", "n"],
    "additionalProperties": False,
}
REGEX = r"[A-Z][a-z]{1,8}( [a-z]{1,8}){0,3}\."
CHOICES = ["red", "green", "blue", "yellow"]
BAD_WORDS = [" the", "The", " cat", "def", " is", ","]


@dataclass
class Case:
    """One drawn request: where it goes, its body (without `speculation`), the method
    the speculative side asks for, and the features it exercises."""

    index: int
    endpoint: str  # "chat/completions" or "completions"
    body: dict[str, Any]
    method: str
    features: list[str] = field(default_factory=list)
    probe_stop: bool = False  # draw stop strings from the plain output first

    def reproducer(self) -> dict[str, Any]:
        return {
            "endpoint": f"/v1/{self.endpoint}",
            "speculation_method": self.method,
            "body": self.body,
        }


# ---- drawing ----------------------------------------------------------------------------


def draw(seed: int, index: int, methods: list[str]) -> Case:
    """Case `index` of `seed`: the same request every time (its own generator, so a case
    is reproduced without drawing the ones before it)."""
    rng = random.Random(f"{seed}:{index}")
    chat = rng.random() < 0.6
    endpoint = "chat/completions" if chat else "completions"
    feats: list[str] = [endpoint]
    prompt = rng.choice(PROMPTS)
    body: dict[str, Any] = {}
    if chat:
        messages = [{"role": "user", "content": prompt}]
        if rng.random() < 0.3:
            messages.insert(0, {"role": "system", "content": SYSTEM})
        body["messages"] = messages
    else:
        body["prompt"] = prompt
    body["max_tokens"] = rng.choice([1, 2, 3]) if rng.random() < 0.2 else rng.randint(4, 24)
    if body["max_tokens"] <= 3:
        feats.append("tiny max_tokens")
    if rng.random() < 0.5:
        body["temperature"] = 0.0
        feats.append("greedy")
    else:
        body["temperature"] = rng.choice([0.5, 0.8, 1.0, 1.3])
        body["seed"] = rng.randint(0, 2**31)
        if rng.random() < 0.4:
            body["top_p"] = rng.choice([0.5, 0.9])
        if rng.random() < 0.3:
            body["top_k"] = rng.choice([5, 40])
        if rng.random() < 0.2:
            body["min_p"] = 0.05
        feats.append("seeded sampling")
    if rng.random() < 0.25:
        body["n"] = rng.randint(2, 3)
        feats.append("n>1")
    if rng.random() < 0.35:
        body["stream"] = True
        feats.append("stream")
        if rng.random() < 0.7:
            body["stream_options"] = {"include_usage": True}
    case = Case(index, endpoint, body, rng.choice(methods), feats)
    feats.append(f"method {case.method}")
    _draw_logprobs(rng, case, chat)
    _draw_processors(rng, case)
    structured = _draw_structure(rng, case, chat)
    _draw_stop(rng, case)
    if not structured and rng.random() < 0.1:
        body["ignore_eos"] = True
        feats.append("ignore_eos")
    _draw_slo(rng, case)
    return case


def _draw_logprobs(rng: random.Random, case: Case, chat: bool) -> None:
    body, feats = case.body, case.features
    if rng.random() < 0.4:
        k = rng.randint(0, 5)
        if chat:
            body["logprobs"] = True
            if rng.random() < 0.7:
                body["top_logprobs"] = k
        else:
            body["logprobs"] = k
        feats.append("logprobs")
        if k:
            feats.append("top_logprobs")
        if rng.random() < 0.4:
            body["return_tokens_as_token_ids"] = True
            feats.append("token ids")
    if not chat and rng.random() < 0.15 and not body.get("stream"):
        body["echo"] = True
        feats.append("echo")
    if rng.random() < 0.1 and not body.get("stream"):
        # vLLM's: the prompt's logprobs, scored while it is prefilled (in chunks that
        # differ with the load, and never taken from the prefix cache).
        body["prompt_logprobs"] = rng.randint(0, 3)
        feats.append("prompt_logprobs")
    if not chat and rng.random() < 0.1 and not body.get("stream"):
        # vLLM's: best_of sequences drawn, the n with the highest cumulative logprob
        # returned.
        body["best_of"] = body.get("n", 1) + rng.randint(1, 2)
        feats.append("best_of")


def _draw_processors(rng: random.Random, case: Case) -> None:
    body, feats = case.body, case.features
    if rng.random() < 0.2:
        body["presence_penalty"] = rng.choice([-0.5, 0.5, 1.5])
        body["frequency_penalty"] = rng.choice([0.0, 0.5, 1.0])
        feats.append("penalties")
    if rng.random() < 0.1:
        body["repetition_penalty"] = rng.choice([1.1, 1.3])
        feats.append("repetition_penalty")
    if rng.random() < 0.2:
        body["logit_bias"] = {
            str(rng.randrange(VOCAB)): rng.choice([-100.0, -5.0, 5.0])
            for _ in range(rng.randint(1, 4))
        }
        feats.append("logit_bias")
    if rng.random() < 0.15:
        body["min_tokens"] = rng.randint(1, body["max_tokens"])
        feats.append("min_tokens")
    if rng.random() < 0.1:  # vLLM's: token sequences the output never completes
        body["bad_words"] = rng.sample(BAD_WORDS, rng.randint(1, 2))
        feats.append("bad_words")


def _draw_structure(rng: random.Random, case: Case, chat: bool) -> bool:
    """A grammar or tools, at most one of them; True when drawn."""
    body, feats = case.body, case.features
    roll = rng.random()
    if roll < 0.06:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "c", "schema": SCHEMA},
        }
        feats.append("json_schema")
    elif roll < 0.09:
        body["response_format"] = {"type": "json_object"}
        feats.append("json_object")
    elif roll < 0.14:
        body["guided_regex"] = REGEX
        feats.append("regex")
    elif roll < 0.19:
        body["guided_choice"] = CHOICES
        feats.append("choice")
    elif chat and roll < 0.34:
        body["tools"] = [WEATHER, CLOCK]
        choice = rng.choice(["none", "auto", "required", "named", None])
        if choice == "named":
            body["tool_choice"] = {"type": "function", "function": {"name": "get_time"}}
        elif choice is not None:
            body["tool_choice"] = choice
        if rng.random() < 0.5:
            body["parallel_tool_calls"] = False
        feats.append(f"tools {choice or 'default'}")
        return choice in ("required", "named")
    else:
        return False
    return True


def _draw_stop(rng: random.Random, case: Case) -> None:
    roll = rng.random()
    if roll < 0.3:
        case.probe_stop = True  # drawn from the plain output: they hit
        case.features.append("stop drawn from output")
    elif roll < 0.4:
        case.body["stop"] = [NEVER] if rng.random() < 0.5 else NEVER
        case.features.append("stop that never occurs")
    elif roll < 0.5:
        case.body["stop"] = rng.sample([".", ",", " the", "\n", "a"], rng.randint(1, 2))
        case.features.append("stop common")


def _draw_slo(rng: random.Random, case: Case) -> None:
    body, feats = case.body, case.features
    if rng.random() < 0.3:
        body["tpot_slo_ms"] = rng.choice([5.0, 60.0, 500.0])
        feats.append("tpot_slo_ms")
    if rng.random() < 0.3:
        body["ttft_slo_ms"] = rng.choice([50.0, 2000.0])
        feats.append("ttft_slo_ms")
    if rng.random() < 0.15:
        body["slo_class"] = rng.choice(["coding", "chat", "summarize"])
        feats.append("slo_class")


def stop_from(text: str, rng: random.Random) -> list[str] | None:
    """One or two substrings of an output (1-4 characters, so most span a token
    boundary), or None when it is too short."""
    if len(text) < 2:
        return None
    out = []
    for _ in range(rng.randint(1, 2)):
        n = rng.randint(1, min(4, len(text)))
        at = rng.randrange(0, len(text) - n + 1)
        piece = text[at : at + n]
        if piece.strip():
            out.append(piece)
    return out or None


# ---- shrinking --------------------------------------------------------------------------


# Never dropped: the prompt, and what keeps the request deterministic (without
# `temperature` it samples at 1.0, without `seed` unseeded: the two sides then differ
# by chance, and the shrinker would chase noise).
KEEP = {"messages", "prompt", "max_tokens", "temperature", "seed"}


def reductions(case: Case) -> Iterator[Case]:
    body = case.body

    def variant(new: dict[str, Any]) -> Case:
        return Case(case.index, case.endpoint, new, case.method, case.features)

    for key in list(body):
        if key not in KEEP:
            # stream_options goes with stream (without it, a 400 by OpenAI's rule).
            gone = {key, "stream_options"} if key == "stream" else {key}
            yield variant({k: v for k, v in body.items() if k not in gone})
    if body.get("temperature"):  # seeded sampling -> greedy
        drop = {"seed", "top_p", "top_k", "min_p"}
        yield variant({**{k: v for k, v in body.items() if k not in drop}, "temperature": 0.0})
    if body["max_tokens"] > 1:
        yield variant({**body, "max_tokens": body["max_tokens"] // 2})
    if body.get("n", 1) > 1:
        yield variant({**body, "n": 1})
    stop = body.get("stop")
    if isinstance(stop, list) and len(stop) > 1:
        for s in stop:
            yield variant({**body, "stop": [s]})
    if "prompt" in body and len(body["prompt"]) > 4:
        yield variant({**body, "prompt": body["prompt"][: len(body["prompt"]) // 2]})
    if "messages" in body:
        msgs = body["messages"]
        if len(msgs) > 1:
            yield variant({**body, "messages": msgs[-1:]})
        text = msgs[-1]["content"]
        if len(text) > 4:
            short = copy.deepcopy(msgs)
            short[-1]["content"] = text[: len(text) // 2]
            yield variant({**body, "messages": short})
