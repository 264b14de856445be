"""Structured output in the engine (real tiny model with a real tokenizer, llguidance):
every output parses and validates against its schema (nested objects, enums, arrays,
numbers, strings with patterns), regex / choice / Lark grammars hold, greedy and seeded
sampling give the same tokens with a drafter (speculation on) as without, and the
grammar's masks at tree nodes are those of each node's path."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from adaserve import metrics
from adaserve.config import load_settings
from adaserve.engine import Engine
from adaserve.grammar import Constraint, GrammarBackend
from adaserve.model.loader import load_runner
from adaserve.request import GenerationRequest, SamplingParams, StructuredOutput
from adaserve.runner_target import RunnerTarget
from adaserve.scheduler import LocalScheduler
from adaserve.speculate import BeamDrafter
from adaserve.tree import CandidateTree
from tests._engine import run_to_completion
from tests._oracle import OracleDrafter
from tests._serving import IM_END, VOCAB, make_served_model

SCHEMAS = [
    {  # strings and bounded integers
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {  # enums and arrays
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        },
        "required": ["color", "tags"],
        "additionalProperties": False,
    },
    {  # strings with patterns, numbers
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
            "x": {"type": "number", "minimum": -10, "maximum": 10},
        },
        "required": ["code", "x"],
        "additionalProperties": False,
    },
    {  # nested objects
        "type": "object",
        "properties": {
            "inner": {
                "type": "object",
                "properties": {
                    "ok": {"type": "boolean"},
                    "n": {"type": "integer", "minimum": 1, "maximum": 9},
                    "items": {
                        "type": "array",
                        "items": {"enum": [1, 2, 3]},
                        "minItems": 1,
                        "maxItems": 4,
                    },
                },
                "required": ["ok", "n", "items"],
                "additionalProperties": False,
            }
        },
        "required": ["inner"],
        "additionalProperties": False,
    },
]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("structured")
    return make_served_model(root / "target", seed=0), make_served_model(root / "drafter", seed=1)


@pytest.fixture(scope="module")
def tokenizer(models):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(models[0])


def engine_for(target: Path, drafter: Path | OracleDrafter | None, tokenizer) -> Engine:
    settings = load_settings(
        None,
        engine={"kv_blocks": 512, "kv_block_size": 16, "max_queue": 64},
        scheduler={"budget": 16, "adaptive": {"d_min": 3, "d_max": 4, "w_max": 2}},
    )
    runner = load_runner(target, device="cpu", dtype="float32", kv_blocks=512)
    draft = drafter
    if isinstance(drafter, Path):
        draft = BeamDrafter(load_runner(drafter, device="cpu", dtype="float32"))
    return Engine(
        RunnerTarget(runner, eos_token_ids=(IM_END,)),
        draft,
        LocalScheduler(settings.scheduler),
        settings,
        tokenizer=tokenizer,
    )


def generate(engine: Engine, tokenizer, sps: list[SamplingParams], prompt: str = "Hi") -> dict:
    ids = tuple(tokenizer.encode(prompt))
    streams = [
        engine.submit(GenerationRequest(f"r{i}", ids, sp, tpot_slo_ms=5.0))
        for i, sp in enumerate(sps)
    ]
    out = run_to_completion(engine, streams, max_steps=4000)
    assert engine.target.kv_usage() == 0.0
    return out


def _sps(so: StructuredOutput, n_seeds: int = 2) -> list[SamplingParams]:
    greedy = [SamplingParams(max_tokens=150, structured=so)]
    return greedy + [
        SamplingParams(max_tokens=150, structured=so, temperature=1.0, seed=s)
        for s in range(n_seeds)
    ]


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_every_output_validates_and_speculation_changes_nothing(models, tokenizer, i) -> None:
    schema = SCHEMAS[i]
    sps = _sps(StructuredOutput("json_schema", json.dumps(schema)))
    target, drafter = models
    plain = generate(engine_for(target, None, tokenizer), tokenizer, sps)
    # Speculation with real drafters (the grammar prunes most of a random model's
    # drafts) and with one that knows the answer (accepted paths of every length).
    prompt_len = len(tokenizer.encode("Hi"))
    oracle = OracleDrafter({i: (prompt_len, t) for i, t in plain["tokens"].items()}, VOCAB)
    outs = {"plain": plain}
    for name, d in (("self", target), ("random", drafter), ("oracle", oracle)):
        accepted = metrics.spec_num_accepted_tokens._value.get()
        outs[name] = generate(engine_for(target, d, tokenizer), tokenizer, sps)
    assert metrics.spec_num_accepted_tokens._value.get() > accepted  # the oracle's were
    assert outs["self"] == plain and outs["random"] == plain and outs["oracle"] == plain
    out = outs["plain"]
    for ids in out["tokens"].values():
        jsonschema.validate(json.loads(tokenizer.decode(ids, skip_special_tokens=True)), schema)
    finishes = list(out["finish"].values())
    assert finishes == ["stop"] * len(sps)  # the grammar ended it: eos once complete


@pytest.mark.parametrize(
    ("so", "check"),
    [
        (StructuredOutput("regex", r"[a-z]{3}-\d{1,3}"), r"[a-z]{3}-\d{1,3}"),
        (StructuredOutput("choice", json.dumps(["yes", "no", "maybe"])), r"yes|no|maybe"),
        (
            StructuredOutput("grammar", 'start: "(" num ("+" num)* ")"\nnum: /[0-9]/'),
            r"\([0-9](\+[0-9])*\)",
        ),
        (StructuredOutput("json_object"), None),
    ],
    ids=["regex", "choice", "lark", "json_object"],
)
def test_regex_choice_grammar_and_json_object(models, tokenizer, so, check) -> None:
    target = models[0]
    sps = _sps(so)
    plain = generate(engine_for(target, None, tokenizer), tokenizer, sps)
    prompt_len = len(tokenizer.encode("Hi"))
    oracle = OracleDrafter({i: (prompt_len, t) for i, t in plain["tokens"].items()}, VOCAB)
    assert generate(engine_for(target, oracle, tokenizer), tokenizer, sps) == plain
    assert generate(engine_for(target, target, tokenizer), tokenizer, sps) == plain
    for ids in plain["tokens"].values():
        text = tokenizer.decode(ids, skip_special_tokens=True)
        if check is None:
            assert isinstance(json.loads(text), dict), text
        else:
            assert re.fullmatch(check, text), text


def test_tree_masks_are_each_paths_own(tokenizer) -> None:
    """The mask at every kept node is the mask of a matcher fed that node's path alone;
    branches the grammar rejects are pruned; the matcher ends where it started."""
    backend = GrammarBackend(tokenizer, VOCAB, (IM_END,))
    so = StructuredOutput("json_schema", json.dumps(SCHEMAS[1]))
    c = backend.constraint(so, (IM_END,))
    assert c.advance(tokenizer.encode('{"color": "'))
    ids = {ch: tokenizer.convert_tokens_to_ids(ch) for ch in 'rgbxe"d'}
    # r -> e -> d ; r -> x (rejected) ; g ; b -> x (rejected) ; x (rejected)
    tokens = [0, ids["r"], ids["g"], ids["b"], ids["x"], ids["e"], ids["x"], ids["x"], ids["d"]]
    parents = [-1, 0, 0, 0, 0, 1, 1, 3, 5]
    tree = CandidateTree.build(tokens, parents, np.zeros(len(tokens), np.float32))
    before = c._mask()
    pruned, masks = c.tree_masks(tree)
    assert np.array_equal(c._mask(), before)
    assert pruned.tokens.tolist() == [0, ids["r"], ids["g"], ids["b"], ids["e"], ids["d"]]
    assert pruned.parents.tolist() == [-1, 0, 0, 0, 1, 4]
    paths = [[], ["r"], ["g"], ["b"], ["r", "e"], ["r", "e", "d"]]
    for mask, path in zip(masks, paths, strict=True):
        alone = backend.constraint(so, (IM_END,))
        assert alone.advance(tokenizer.encode('{"color": "') + [ids[ch] for ch in path])
        assert np.array_equal(mask, alone._mask()), path
    assert Constraint.allows(masks[0], ids["r"]) and not Constraint.allows(masks[0], ids["x"])


def test_bad_grammars_are_refused_naming_the_field(tokenizer) -> None:
    backend = GrammarBackend(tokenizer, VOCAB, (IM_END,))
    cases = [
        StructuredOutput("json_schema", "{not json", field="response_format"),
        StructuredOutput("json_schema", json.dumps({"type": "frobnicate"}), field="guided_json"),
        StructuredOutput("regex", "([a-z", field="guided_regex"),
        StructuredOutput("choice", json.dumps([]), field="guided_choice"),
        StructuredOutput("grammar", "start: undefined_rule", field="guided_grammar"),
    ]
    for so in cases:
        with pytest.raises(ValueError, match=so.field):
            backend.compile(so)


def test_a_grammar_no_token_can_start_is_refused_at_submit(tokenizer) -> None:
    """A pattern of characters the tokenizer cannot spell (found by the schema fuzzer: a
    plane-8 character) allows no first token: a ValueError naming the field, not a
    token drawn from an empty mask that the grammar then refuses."""
    backend = GrammarBackend(tokenizer, VOCAB, (IM_END,))
    with pytest.raises(ValueError, match="guided_regex: no output"):
        backend.compile(StructuredOutput("regex", "\U0008f6a8\u00acY", field="guided_regex"))
    assert backend.constraint(StructuredOutput("regex", "[a-z]+", field="guided_regex"), ())
