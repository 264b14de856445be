"""Prompt files -> chat-templated token ids, and the generated-sequence store.

Tokenisation (needs the tokenizer, so transformers) happens once and is cached as
JSON in the work dir; everything after it needs only torch and safetensors, which is
what lets the heavy stages run on a bare GPU machine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

SENTINEL = "\u0000TEXT\u0000"


def read_prompt_file(path: Path) -> list[dict]:
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "messages" not in row and not ("writer" in row and "template" in row):
                raise ValueError(
                    f"{path}:{n}: a prompt needs 'messages', or 'writer' and 'template'"
                )
            if "template" in row and "{text}" not in row["template"]:
                raise ValueError(f"{path}:{n}: 'template' must contain {{text}}")
            rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no prompts")
    return rows


def tokenize_prompts(tokenizer_dir: Path, train_file: Path, heldout_file: Path) -> dict:
    """{"direct": [[ids]], "writer": [{"writer", "prefix", "suffix"}], "heldout": [[ids]],
    "eos": [ids]}. Writer prompts are two-stage: generate a text from `writer`, then
    `prefix + text + suffix` is the prompt whose continuation is trained on."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    if tok.chat_template is None:
        raise ValueError(f"{tokenizer_dir}: the tokenizer has no chat template")

    def render(messages: list[dict]) -> str:
        return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def ids(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    out: dict = {"direct": [], "writer": [], "heldout": []}
    for row in read_prompt_file(train_file):
        if "messages" in row:
            out["direct"].append(ids(render(row["messages"])))
        else:
            pre, post = render(
                [{"role": "user", "content": row["template"].replace("{text}", SENTINEL)}]
            ).split(SENTINEL)
            out["writer"].append(
                {
                    "writer": ids(render([{"role": "user", "content": row["writer"]}])),
                    "prefix": ids(pre),
                    "suffix": ids(post),
                }
            )
    out["heldout"] = [
        ids(render(r["messages"])) for r in read_prompt_file(heldout_file) if "messages" in r
    ]
    eos = tok.eos_token_id
    out["eos"] = sorted({int(eos)} | set(getattr(tok, "additional_eos_ids", []) or []))
    return out


@dataclass
class Sequences:
    """Prompt + continuation token sequences stored flat, with the target's top-k
    log-probabilities for every continuation token (rows in sequence order)."""

    tokens: np.ndarray  # int32 [total]
    offsets: np.ndarray  # int64 [n + 1]
    prompt_lens: np.ndarray  # int32 [n]
    topk_ids: np.ndarray  # int32 [continuation tokens, K]
    topk_logp: np.ndarray  # float16 [continuation tokens, K]

    def __len__(self) -> int:
        return len(self.prompt_lens)

    def seq(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i] : self.offsets[i + 1]]

    def continuation(self, i: int) -> np.ndarray:
        return self.seq(i)[self.prompt_lens[i] :]

    @property
    def cont_offsets(self) -> np.ndarray:  # int64 [n + 1]: each sequence's first top-k row
        return np.concatenate([[0], np.cumsum(np.diff(self.offsets) - self.prompt_lens)]).astype(
            np.int64
        )

    @classmethod
    def build(cls, prompts: list[list[int]], conts: list) -> Sequences:
        """conts: generate.Continuation or None (skipped) per prompt."""
        pairs = [(p, c) for p, c in zip(prompts, conts, strict=True) if c is not None and c.tokens]
        if not pairs:
            return cls.empty()
        flat = [np.asarray(list(p) + c.tokens, dtype=np.int32) for p, c in pairs]
        return cls(
            tokens=np.concatenate(flat),
            offsets=np.concatenate([[0], np.cumsum([len(f) for f in flat])]).astype(np.int64),
            prompt_lens=np.asarray([len(p) for p, _ in pairs], dtype=np.int32),
            topk_ids=np.concatenate([c.topk_ids.numpy() for _, c in pairs]).astype(np.int32),
            topk_logp=np.concatenate([c.topk_logp.numpy() for _, c in pairs]).astype(np.float16),
        )

    @classmethod
    def empty(cls, k: int = 1) -> Sequences:
        return cls(
            np.zeros(0, np.int32),
            np.zeros(1, np.int64),
            np.zeros(0, np.int32),
            np.zeros((0, k), np.int32),
            np.zeros((0, k), np.float16),
        )

    @classmethod
    def concat(cls, parts: list[Sequences]) -> Sequences:
        parts = [p for p in parts if len(p)]
        if not parts:
            return cls.empty()
        if len({p.topk_ids.shape[1] for p in parts}) > 1:
            raise ValueError(
                f"generated data with different top-k widths: {[p.topk_ids.shape[1] for p in parts]}"
            )
        shifts = np.cumsum([0] + [len(p.tokens) for p in parts[:-1]])
        return cls(
            tokens=np.concatenate([p.tokens for p in parts]),
            offsets=np.concatenate(
                [[0]] + [p.offsets[1:] + s for p, s in zip(parts, shifts, strict=True)]
            ),
            prompt_lens=np.concatenate([p.prompt_lens for p in parts]),
            topk_ids=np.concatenate([p.topk_ids for p in parts]),
            topk_logp=np.concatenate([p.topk_logp for p in parts]),
        )

    def save(self, path: Path) -> None:
        arrays = {
            "tokens": self.tokens,
            "offsets": self.offsets,
            "prompt_lens": self.prompt_lens,
            "topk_ids": self.topk_ids,
            "topk_logp": self.topk_logp,
        }
        save_file(
            {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in arrays.items()}, str(path)
        )

    @classmethod
    def load(cls, path: Path) -> Sequences:
        t = {k: v.numpy() for k, v in load_file(str(path)).items()}
        return cls(t["tokens"], t["offsets"], t["prompt_lens"], t["topk_ids"], t["topk_logp"])
