"""The OpenAI surface a vLLM user expects, through the official `openai` package against
real gateways and verifiers on loopback (tiny random target, real tokenizer and chat
template): logprobs, penalties and logit processors, n > 1 and best_of, structured
output, lists of prompts, echo, /tokenize and /detokenize, and bad input.

Two serving stacks run the same target: one speculative (the target drafting for
itself, so drafts are accepted often and rejected where processors move the target's
choice), one plain (no drafter). Every feature must give the same tokens on both,
greedy and seeded, and where Hugging Face has the feature, HF's result.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import numpy as np
import openai
import pytest
import torch

from tests._faults import metric
from tests._serving import (
    IM_END,
    TEST_CONFIG,
    Proc,
    _hf_model,
    free_port,
    make_served_model,
    start_gateway,
    start_verifier,
)

pytestmark = pytest.mark.slow  # four serving processes per module

UNIT = TEST_CONFIG + "scheduler:\n  budget: 16\n  adaptive: {d_min: 2, d_max: 4, w_max: 2}\n"


@dataclass
class Stack:
    url: str
    metrics: str  # the unit's engine metrics

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0)


@dataclass
class Stacks:
    spec: Stack
    plain: Stack
    target: Path
    tokenizer: object

    def both(self, fn: Callable[[openai.OpenAI], Any]) -> tuple[Any, Any]:
        """The same call on the speculative and the plain stack."""
        return fn(self.spec.client()), fn(self.plain.client())

    def chat_ids(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            messages, add_generation_prompt=True, tokenize=False
        )
        return self.tokenizer.encode(text, add_special_tokens=False)  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def stacks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stacks]:
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("features")
    target = make_served_model(root / "target", seed=0)
    procs: list[Proc] = []
    out = []
    try:
        for name, drafter in (("spec", target), ("plain", None)):
            mport = free_port()
            v, addr = start_verifier(root, target, drafter, UNIT, name=name, metrics_port=mport)
            procs.append(v)
            g, url = start_gateway(root, "--verifier", addr, name=f"gw-{name}", wait_path="/ready")
            procs.append(g)
            out.append(Stack(url, f"http://127.0.0.1:{mport}/metrics"))
        yield Stacks(out[0], out[1], target, AutoTokenizer.from_pretrained(target))
    finally:
        for p in reversed(procs):
            p.stop()


MESSAGES = [{"role": "user", "content": "Tell me about colours."}]


def _chat(client: openai.OpenAI, **kw):
    args = {"model": "tiny", "messages": MESSAGES, "max_tokens": 24, "temperature": 0} | kw
    return client.chat.completions.create(**args)


def _content_lp(choice) -> list[tuple[str, float, list[str]]]:
    return [
        (e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in choice.logprobs.content
    ]


# ---- logprobs ------------------------------------------------------------------------


def test_chat_logprobs_are_plain_decodings_and_hugging_faces(stacks: Stacks) -> None:
    spec, plain = stacks.both(lambda c: _chat(c, logprobs=True, top_logprobs=4, max_tokens=20))
    s, p = spec.choices[0], plain.choices[0]
    assert s.message.content == p.message.content
    ls, lp = _content_lp(s), _content_lp(p)
    assert [t for t, _, _ in ls] == [t for t, _, _ in lp]
    assert [top for _, _, top in ls] == [top for _, _, top in lp]
    np.testing.assert_allclose([v for _, v, _ in ls], [v for _, v, _ in lp], atol=1e-5)
    # Hugging Face's log-softmax of the same model at the same positions.
    ids = stacks.chat_ids(MESSAGES)
    toks = [stacks.tokenizer.convert_tokens_to_ids(t) for t, _, _ in ls]  # type: ignore[attr-defined]
    with torch.no_grad():
        logits = _hf_model(str(stacks.target))(torch.tensor([ids + toks])).logits[0]
    ref = torch.log_softmax(logits[len(ids) - 1 : -1], dim=-1)
    np.testing.assert_allclose(
        [v for _, v, _ in ls], ref[range(len(toks)), toks].numpy(), atol=1e-4
    )
    assert all(len(top) == 4 for _, _, top in ls)


def test_streamed_logprobs_equal_non_streamed(stacks: Stacks) -> None:
    client = stacks.spec.client()
    whole = _chat(client, logprobs=True, top_logprobs=2, max_tokens=16)
    entries, text = [], ""
    for chunk in _chat(client, logprobs=True, top_logprobs=2, max_tokens=16, stream=True):
        choice = chunk.choices[0]
        text += choice.delta.content or ""
        entries += choice.logprobs.content if choice.logprobs else []
    assert text == whole.choices[0].message.content
    got = [(e.token, round(e.logprob, 4)) for e in entries]
    assert got == [(e.token, round(e.logprob, 4)) for e in whole.choices[0].logprobs.content]


def test_completion_logprobs_stream_and_not(stacks: Stacks) -> None:
    def run(client: openai.OpenAI, stream: bool):
        kw = dict(model="tiny", prompt="Once upon", max_tokens=12, temperature=0, logprobs=3)
        if not stream:
            return client.completions.create(**kw).choices[0].logprobs
        tokens, values = [], []
        for c in client.completions.create(stream=True, **kw):
            if c.choices and c.choices[0].logprobs:
                tokens += c.choices[0].logprobs.tokens
                values += c.choices[0].logprobs.token_logprobs
        return tokens, values

    spec, plain = stacks.both(lambda c: run(c, False))
    assert spec.tokens == plain.tokens and len(spec.tokens) == 12
    np.testing.assert_allclose(spec.token_logprobs, plain.token_logprobs, atol=1e-5)
    assert all(len(t) <= 3 for t in spec.top_logprobs)
    assert spec.text_offset == list(np.cumsum([0] + [len(t) for t in spec.tokens[:-1]]))
    tokens, values = run(stacks.spec.client(), True)
    assert tokens == spec.tokens
    np.testing.assert_allclose(values, spec.token_logprobs, atol=1e-5)


# ---- penalties and logit processors ------------------------------------------------------


PROCESSORS = [
    {"repetition_penalty": 1.6},
    {"presence_penalty": 1.5, "frequency_penalty": 0.7},
    {"logit_bias": {"5": 8.0, "17": -100}},
    {"min_tokens": 10, "logit_bias": {str(IM_END): 20.0}},
    {"bad_words": ["e", "th"], "allowed_token_ids": list(range(90))},
    {"min_p": 0.2, "temperature": 1.0, "seed": 11},
    {"repetition_penalty": 1.3, "frequency_penalty": 0.5, "temperature": 0.8, "seed": 5},
]


@pytest.mark.parametrize("extra", PROCESSORS, ids=lambda e: "+".join(e))
def test_processors_are_the_same_with_and_without_speculation(stacks: Stacks, extra) -> None:
    body = {k: v for k, v in extra.items() if k not in ("temperature", "seed")}
    kw = {k: v for k, v in extra.items() if k in ("temperature", "seed")}
    spec, plain = stacks.both(lambda c: _chat(c, max_tokens=30, extra_body=body, **kw))
    assert spec.choices[0].message.content == plain.choices[0].message.content
    assert spec.usage.completion_tokens == plain.usage.completion_tokens
    text = spec.choices[0].message.content
    if "bad_words" in body:
        assert "e" not in text and "th" not in text
    if "min_tokens" in body:  # eos pushed up by 20 logits, yet held back until 10 tokens
        assert spec.usage.completion_tokens == 11 and spec.choices[0].finish_reason == "stop"


def test_greedy_with_processors_is_hugging_face_generate(stacks: Stacks) -> None:
    from transformers import AutoModelForCausalLM

    ids = stacks.chat_ids(MESSAGES)
    model = AutoModelForCausalLM.from_pretrained(stacks.target, dtype=torch.float32).eval()
    ref = model.generate(
        torch.tensor([ids]),
        max_new_tokens=30,
        do_sample=False,
        repetition_penalty=1.4,
        sequence_bias={(5,): 4.0, (IM_END,): 5.0},
        min_new_tokens=8,
        eos_token_id=IM_END,
        pad_token_id=0,
    )[0, len(ids) :].tolist()
    body = {"repetition_penalty": 1.4, "logit_bias": {"5": 4.0, str(IM_END): 5.0}, "min_tokens": 8}
    out = _chat(stacks.spec.client(), max_tokens=30, extra_body=body)
    assert out.choices[0].message.content == stacks.tokenizer.decode(ref, skip_special_tokens=True)  # type: ignore[attr-defined]


# ---- n > 1 and best_of -------------------------------------------------------------------


def test_n_sequences_share_the_prompt_and_each_has_its_own_stream(stacks: Stacks) -> None:
    """n = 3 seeded: choice 0 is what n = 1 gives, the choices differ, each is the same
    with speculation as without, and the siblings took the prompt's KV from the prefix
    cache (fork after prefill)."""
    long = [{"role": "user", "content": "Describe the colour blue in detail. " * 3}]
    kw = dict(messages=long, temperature=1.0, seed=123, max_tokens=16)
    hits = metric(stacks.spec.metrics, "adaserve_prefix_cache_hits_total")
    spec, plain = stacks.both(lambda c: _chat(c, n=3, **kw))
    gained = metric(stacks.spec.metrics, "adaserve_prefix_cache_hits_total") - hits
    texts = [c.message.content for c in spec.choices]
    assert [c.index for c in spec.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in plain.choices]
    assert len(set(texts)) == 3
    one = _chat(stacks.spec.client(), n=1, **kw)
    assert one.choices[0].message.content == texts[0]
    assert spec.usage.completion_tokens == sum(
        len(stacks.tokenizer.encode(t, add_special_tokens=False)) + (c.finish_reason == "stop")  # type: ignore[attr-defined]
        for t, c in zip(texts, spec.choices, strict=True)
    )
    prompt_blocks = len(stacks.chat_ids(long)) // 16
    assert gained >= 2 * 16 * prompt_blocks  # both siblings' full prompt blocks


def test_n_streamed(stacks: Stacks) -> None:
    client = stacks.spec.client()
    whole = _chat(client, n=2, temperature=0.9, seed=4, max_tokens=12)
    texts: dict[int, str] = {0: "", 1: ""}
    reasons: dict[int, str | None] = {}
    for chunk in _chat(client, n=2, temperature=0.9, seed=4, max_tokens=12, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert [texts[0], texts[1]] == [c.message.content for c in whole.choices]
    assert reasons == {c.index: c.finish_reason for c in whole.choices}


def test_best_of_keeps_the_most_likely(stacks: Stacks) -> None:
    """best_of = 4, n = 2: the two sequences (of the four n = 4 gives with the same
    seed) with the highest cumulative logprob, in that order."""
    client = stacks.spec.client()
    kw = dict(model="tiny", prompt="The sky is", max_tokens=8, temperature=1.0, seed=9)
    four = client.completions.create(n=4, logprobs=0, **kw)
    ranked = sorted(four.choices, key=lambda c: -sum(c.logprobs.token_logprobs))
    best = client.completions.create(n=2, best_of=4, **kw)
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert [c.index for c in best.choices] == [0, 1] and best.choices[0].logprobs is None


# ---- prompts, echo, tokenize -----------------------------------------------------------------


def test_list_of_prompts_with_n_and_echo(stacks: Stacks) -> None:
    prompts = ["Roses are", "The cat", "Once"]
    out = stacks.spec.client().completions.create(
        model="tiny", prompt=prompts, n=2, max_tokens=6, temperature=0, echo=True
    )
    assert [c.index for c in out.choices] == list(range(6))
    for p, prompt in enumerate(prompts):
        alone = stacks.plain.client().completions.create(
            model="tiny", prompt=prompt, max_tokens=6, temperature=0
        )
        for i in range(2):
            assert out.choices[2 * p + i].text == prompt + alone.choices[0].text
    ids = stacks.tokenizer(prompts)["input_ids"]  # type: ignore[operator]
    assert out.usage.prompt_tokens == sum(len(x) for x in ids)
    streamed: dict[int, str] = {}
    for chunk in stacks.spec.client().completions.create(
        model="tiny",
        prompt=[[5, 6, 7], [40, 41]],
        max_tokens=4,
        temperature=0,
        echo=True,
        stream=True,
    ):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    decode = stacks.tokenizer.decode  # type: ignore[attr-defined]
    assert streamed[0].startswith(decode([5, 6, 7])) and streamed[1].startswith(decode([40, 41]))
    assert len(streamed[0]) > 3 and len(streamed[1]) > 2


def test_tokenize_and_detokenize(stacks: Stacks) -> None:
    r = httpx.post(
        f"{stacks.spec.url}/tokenize", json={"prompt": "Hello", "return_token_strs": True}
    )
    body = r.json()
    assert body["tokens"] == stacks.tokenizer.encode("Hello")  # type: ignore[attr-defined]
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] > 0
    assert "".join(body["token_strs"]) == "Hello"
    r = httpx.post(f"{stacks.spec.url}/tokenize", json={"messages": MESSAGES})
    assert r.json()["tokens"] == stacks.chat_ids(MESSAGES)
    back = httpx.post(f"{stacks.spec.url}/detokenize", json={"tokens": body["tokens"]})
    assert back.json() == {"prompt": "Hello"}
    bad = httpx.post(f"{stacks.spec.url}/detokenize", json={"tokens": [10**6]})
    assert bad.status_code == 400 and "tokens" in bad.json()["error"]["message"]
    bad = httpx.post(f"{stacks.spec.url}/tokenize", json={"model": "nope", "prompt": "x"})
    assert bad.status_code == 404


# ---- prompt logprobs: echo with logprobs, vLLM's prompt_logprobs --------------------------------


def _hf_prompt_logprobs(stacks: Stacks, ids: list[int]) -> np.ndarray:
    """[P - 1, V]: HF's log-softmax; row i scores ids[i + 1]."""
    with torch.no_grad():
        logits = _hf_model(str(stacks.target))(torch.tensor([ids])).logits[0, :-1]
    return torch.log_softmax(logits, dim=-1).numpy()


def test_lm_eval_harness_loglikelihood_request(stacks: Stacks) -> None:
    """lm-evaluation-harness' local-completions loglikelihood request: the echoed
    prompt's tokens come first, the first one's logprob null, the rest HF's log-softmax;
    top_logprobs (k = 1) hold the greedy token, so its greedy match works. The same on
    the speculative and the plain stack."""
    prompts = ["The colour of the sky is blue", "Roses are red, violets are"]
    kw = dict(model="tiny", max_tokens=1, temperature=0, logprobs=1, echo=True, seed=1234)
    spec, plain = stacks.both(lambda c: c.completions.create(prompt=prompts, **kw))
    assert len(spec.choices) == 2
    for p, prompt in enumerate(prompts):
        ids = stacks.tokenizer.encode(prompt)  # type: ignore[attr-defined]
        ref = _hf_prompt_logprobs(stacks, ids)
        for out in (spec, plain):
            choice = out.choices[p]
            lp = choice.logprobs
            assert choice.text.startswith(prompt) and len(lp.tokens) == len(ids) + 1
            assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
            assert "".join(lp.tokens[: len(ids)]) == prompt
            got = lp.token_logprobs[1 : len(ids)]
            np.testing.assert_allclose(got, ref[np.arange(len(ids) - 1), ids[1:]], atol=1e-4)
            decode = stacks.tokenizer.decode  # type: ignore[attr-defined]
            for i, top in enumerate(lp.top_logprobs[1 : len(ids)]):
                greedy = decode([int(ref[i].argmax())])
                assert list(top) == [greedy]
                assert top[greedy] == pytest.approx(float(ref[i].max()), abs=1e-4)
            # The harness' own reading: the continuation's loglikelihood and greedy match.
            ctxlen = len(ids) - 3
            cont = lp.token_logprobs[ctxlen:-1]
            assert sum(cont) == pytest.approx(
                float(ref[np.arange(ctxlen - 1, len(ids) - 1), ids[ctxlen:]].sum()), abs=1e-3
            )
            greedy_match = all(
                max(t, key=t.__getitem__) == tok
                for t, tok in zip(lp.top_logprobs[ctxlen:-1], lp.tokens[ctxlen:-1], strict=True)
            )
            assert greedy_match == all(
                int(ref[i].argmax()) == ids[i + 1] for i in range(ctxlen - 1, len(ids) - 1)
            )
            assert lp.text_offset[: len(ids)] == list(range(len(ids)))  # one character each
        assert spec.choices[p].text == plain.choices[p].text
    # Token-id prompts too (the harness sends ids): the tokens are the ids' pieces.
    ids = [5, 6, 7, 40, 41]
    out = stacks.spec.client().completions.create(prompt=[ids], **kw)
    lp = out.choices[0].logprobs
    ref = _hf_prompt_logprobs(stacks, ids)
    np.testing.assert_allclose(lp.token_logprobs[1:5], ref[range(4), ids[1:]], atol=1e-4)


def test_echo_with_logprobs_streamed_and_echo_only(stacks: Stacks) -> None:
    """Streamed, each choice's first frame is the echoed prompt with its logprobs; the
    whole stream reads as the non-streamed response. max_tokens 0 (vLLM): the prompt
    alone, nothing generated."""
    client = stacks.spec.client()
    kw = dict(
        model="tiny", prompt=["Once upon", "A"], max_tokens=5, temperature=0, logprobs=2, echo=True
    )
    whole = client.completions.create(**kw)
    got: dict[int, list] = {}
    firsts: dict[int, Any] = {}
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            firsts.setdefault(c.index, c)
            if c.logprobs is not None:
                got.setdefault(c.index, []).extend(c.logprobs.token_logprobs)
    for i, prompt in enumerate(["Once upon", "A"]):
        assert firsts[i].text == prompt and firsts[i].logprobs.token_logprobs[0] is None
        assert len(firsts[i].logprobs.tokens) == len(prompt)
        ref = whole.choices[i].logprobs.token_logprobs
        assert got[i][0] is None and ref[0] is None
        np.testing.assert_allclose(got[i][1:], ref[1:], atol=1e-5)
    only = client.completions.create(
        model="tiny", prompt="Roses", max_tokens=0, logprobs=1, echo=True
    )
    (choice,) = only.choices
    assert choice.text == "Roses" and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == 5 and choice.logprobs.token_logprobs[0] is None
    assert only.usage.completion_tokens == 0 and only.usage.prompt_tokens == 5


def test_vllm_prompt_logprobs_field(stacks: Stacks) -> None:
    """vLLM's prompt_logprobs: per choice (completions) or per response (chat), None
    then {token id: {logprob, rank, decoded_token}} with the prompt's own token and the
    top k; HF's values; the same with and without speculation."""
    body = {"model": "tiny", "prompt": "Hello there", "max_tokens": 3, "temperature": 0}
    ids = stacks.tokenizer.encode("Hello there")  # type: ignore[attr-defined]
    ref = _hf_prompt_logprobs(stacks, ids)
    outs = [
        httpx.post(f"{s.url}/v1/completions", json=body | {"prompt_logprobs": 2}, timeout=60).json()
        for s in (stacks.spec, stacks.plain)
    ]
    for out in outs:
        plp = out["choices"][0]["prompt_logprobs"]
        assert len(plp) == len(ids) and plp[0] is None
        assert out["choices"][0]["logprobs"] is None  # logprobs were not asked
        for i, pos in enumerate(plp[1:]):
            own = pos[str(ids[i + 1])]
            assert own["logprob"] == pytest.approx(float(ref[i, ids[i + 1]]), abs=1e-4)
            assert own["rank"] == int((ref[i] > ref[i, ids[i + 1]]).sum()) + 1
            assert own["decoded_token"] == "Hello there"[i + 1]
            top = np.argsort(-ref[i])[:2]
            for r, t in enumerate(top):
                assert pos[str(int(t))]["rank"] == r + 1
            assert len(pos) in (2, 3)
    assert outs[0]["choices"][0]["text"] == outs[1]["choices"][0]["text"]
    chat = stacks.spec.client().chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=2, extra_body={"prompt_logprobs": 0}
    )
    plp = chat.model_extra["prompt_logprobs"]  # type: ignore[index]
    chat_ids = stacks.chat_ids(MESSAGES)
    assert len(plp) == len(chat_ids) and plp[0] is None
    ref = _hf_prompt_logprobs(stacks, chat_ids)
    got = [pos[str(t)]["logprob"] for pos, t in zip(plp[1:], chat_ids[1:], strict=True)]
    np.testing.assert_allclose(got, ref[range(len(chat_ids) - 1), chat_ids[1:]], atol=1e-4)


@pytest.mark.parametrize(
    "extra",
    [{"prompt_logprobs": -1}, {"prompt_logprobs": 21}, {"prompt_logprobs": 1, "stream": True}],
)
def test_bad_prompt_logprobs_is_an_openai_400(stacks: Stacks, extra: dict) -> None:
    r = httpx.post(
        f"{stacks.spec.url}/v1/completions",
        json={"model": "tiny", "prompt": "x", "max_tokens": 1, **extra},
    )
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == "prompt_logprobs"
    assert "prompt_logprobs" in err["message"]
    with pytest.raises(openai.BadRequestError):
        stacks.spec.client().completions.create(
            model="tiny", prompt="x", max_tokens=1, extra_body={"prompt_logprobs": 99}
        )


# ---- structured output ---------------------------------------------------------------------

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 10},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        },
        "required": ["name", "age", "tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {
                    # bounded: a random model never ends an unbounded float's digits
                    "x": {"type": "integer", "minimum": -5, "maximum": 5},
                    "y": {"type": "number", "enum": [0.5, -1.25, 3]},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            },
            "id": {"type": "string", "pattern": "^[a-f0-9]{4}$"},
            "ok": {"type": "boolean"},
        },
        "required": ["point", "id", "ok"],
        "additionalProperties": False,
    },
]


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_json_schema_outputs_always_validate(stacks: Stacks, i: int) -> None:
    schema = SCHEMAS[i]
    rf = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}
    cases = [dict(temperature=0), dict(temperature=1.0, seed=1), dict(temperature=1.0, seed=2)]
    for kw in cases:
        spec, plain = stacks.both(
            lambda c, kw=kw: _chat(c, max_tokens=120, response_format=rf, **kw)
        )
        text = spec.choices[0].message.content
        assert text == plain.choices[0].message.content
        jsonschema.validate(json.loads(text), schema)
        assert spec.choices[0].finish_reason == "stop"
    # vLLM's guided_json, on completions, sampled with n = 3.
    out = stacks.spec.client().completions.create(
        model="tiny",
        prompt="JSON:",
        max_tokens=120,
        n=3,
        temperature=1.0,
        extra_body={"guided_json": schema},
    )
    for c in out.choices:
        jsonschema.validate(json.loads(c.text), schema)


def test_regex_choice_and_json_object(stacks: Stacks) -> None:
    client = stacks.spec.client()
    out = _chat(client, max_tokens=20, extra_body={"guided_regex": r"[A-Z][a-z]{2,5}-\d\d"})
    assert __import__("re").fullmatch(r"[A-Z][a-z]{2,5}-\d\d", out.choices[0].message.content)
    out = _chat(
        client,
        max_tokens=20,
        temperature=1.0,
        seed=3,
        extra_body={"guided_choice": ["red", "green", "blue"]},
    )
    assert out.choices[0].message.content in ("red", "green", "blue")
    out = _chat(client, max_tokens=60, response_format={"type": "json_object"})
    text = out.choices[0].message.content
    assert out.choices[0].finish_reason == "length" or isinstance(json.loads(text), dict)


def test_hugging_face_client_grammars(stacks: Stacks, monkeypatch: pytest.MonkeyPatch) -> None:
    """huggingface_hub's InferenceClient sends a `json_schema` response_format as TGI's
    grammar, `{"type": "json_object", "value": schema}`; TGI's `json` and `regex`
    grammars come as they are. Each is enforced (not a bare JSON object), and the
    speculative stack gives the plain one's tokens, greedy and seeded."""
    from huggingface_hub import InferenceClient, constants

    # HF_HUB_OFFLINE (set for every test) makes the client refuse any URL, loopback
    # included; these requests go to the stacks only.
    monkeypatch.setattr(constants, "is_offline_mode", lambda: False)
    schema = SCHEMAS[0]
    pattern = r"[A-Z][a-z]{2,5}-\d\d"
    cases = [
        ({"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}, schema),
        ({"type": "json", "value": schema}, schema),
        ({"type": "regex", "value": pattern}, None),
    ]
    for rf, expect in cases:
        for kw in (dict(temperature=0.0), dict(temperature=1.0, seed=7)):
            spec, plain = (
                InferenceClient(base_url=f"{s.url}/v1", timeout=120).chat_completion(
                    MESSAGES, model="tiny", max_tokens=120, response_format=rf, **kw
                )
                for s in (stacks.spec, stacks.plain)
            )
            text = spec.choices[0].message.content
            assert text == plain.choices[0].message.content, (rf, kw)
            assert spec.choices[0].finish_reason == "stop", (rf, kw, text)
            if expect is None:
                assert __import__("re").fullmatch(pattern, text), text
            else:
                jsonschema.validate(json.loads(text), expect)


# ---- bad input --------------------------------------------------------------------------------


BAD_THROUGH_THE_UNIT = [
    ({"logit_bias": {"100000": 1.0}}, "logit_bias"),
    ({"allowed_token_ids": [99999]}, "allowed_token_ids"),
    ({"guided_json": {"type": "frobnicate"}}, "guided_json"),
    ({"guided_regex": "([a-z"}, "guided_regex"),
    ({"guided_grammar": "start: nothing_defined"}, "guided_grammar"),
    ({"guided_json": {"type": "object"}, "ignore_eos": True}, "guided_json"),
    ({"min_tokens": 30}, "min_tokens"),  # above max_tokens
]


def test_bad_new_fields_are_400_naming_them_and_the_batch_goes_on(stacks: Stacks) -> None:
    """Each bad new field is refused with a 400 that names it, while good requests run
    beside it and finish with the target's own output."""
    client = stacks.spec.client()
    good_ref = _chat(stacks.plain.client(), max_tokens=20).choices[0].message.content

    async def run() -> tuple[list, list]:
        aclient = openai.AsyncOpenAI(
            base_url=f"{stacks.spec.url}/v1", api_key="none", max_retries=0
        )
        goods = [
            aclient.chat.completions.create(
                model="tiny", messages=MESSAGES, max_tokens=20, temperature=0
            )
            for _ in range(3)
        ]
        bads = [
            aclient.chat.completions.create(
                model="tiny", messages=MESSAGES, max_tokens=20, extra_body=body
            )
            for body, _ in BAD_THROUGH_THE_UNIT
        ]
        results = await asyncio.gather(*goods, *bads, return_exceptions=True)
        return results[:3], results[3:]

    goods, bads = asyncio.run(run())
    assert [g.choices[0].message.content for g in goods] == [good_ref] * 3
    for err, (_, name) in zip(bads, BAD_THROUGH_THE_UNIT, strict=True):
        assert isinstance(err, openai.BadRequestError), (name, err)
        assert name in err.message, (name, err.message)
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, extra_body={"use_beam_search": True})
    assert info.value.body["param"] == "use_beam_search"
    assert info.value.body["code"] == "unsupported"
