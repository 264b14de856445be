"""The distillation loop: students learn the target's next-token distribution on
target-generated sequences, from the top-k log-probabilities recorded while generating
(the target never runs during training).

Loss = KL(p_target || q_student) on the continuation positions, with p the target's
top-k renormalised over the tokens that are in the draft vocabulary and q the student's
softmax over the draft vocabulary (its only output space). Several students (e.g. 2, 3
and 4 layers) can train side by side on the same batches.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from adaserve.distill.data import Sequences
from adaserve.distill.llama import LlamaModel
from adaserve.distill.weights import trainable_state


@dataclass(frozen=True)
class TrainConfig:
    steps: int | None = None  # stop after this many optimizer steps ...
    time_budget_s: float | None = None  # ... or this much training time, whichever first
    batch_tokens: int = 8192  # padded tokens per batch
    lr: float = 1e-3
    warmup: float = 0.03  # fraction of the schedule
    min_lr_ratio: float = 0.1
    max_len: int = 1024  # longer sequences are cut at the end
    temperature: float = 1.0
    grad_clip: float = 1.0
    save_every_s: float = 300.0
    log_every: int = 25
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.steps and not self.time_budget_s:
            raise ValueError("give a step count or a time budget")
        if self.batch_tokens < self.max_len:
            raise ValueError(
                f"batch_tokens ({self.batch_tokens}) must be >= max_len ({self.max_len})"
            )


def lr_factor(progress: float, warmup: float, min_ratio: float) -> float:
    if progress < warmup:
        return max(progress / warmup, 1e-3)
    p = min((progress - warmup) / max(1.0 - warmup, 1e-9), 1.0)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * p))


def make_batches(
    lengths: np.ndarray, batch_tokens: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """Index batches of similar lengths with rows * longest <= batch_tokens, shuffled."""
    order = np.argsort(lengths + rng.random(len(lengths)), kind="stable")  # random tie-break
    batches, cur, longest = [], [], 0
    for i in order:
        longest2 = max(longest, int(lengths[i]))
        if cur and (len(cur) + 1) * longest2 > batch_tokens:
            batches.append(np.asarray(cur))
            cur, longest2 = [], int(lengths[i])
        cur.append(int(i))
        longest = longest2
    if cur:
        batches.append(np.asarray(cur))
    rng.shuffle(batches)
    return batches


def collate(data: Sequences, idx: np.ndarray, max_len: int, device) -> tuple[torch.Tensor, ...]:
    """ids int64 [B, T] (right-padded with 0); loss mask bool [B, T], position t trained
    when token t+1 is a continuation token; rows int64 [mask.sum()]: the top-k row of
    each trained position, in the mask's row-major order."""
    seqs = [data.seq(int(i))[:max_len] for i in idx]
    width = max(len(s) for s in seqs)
    ids = np.zeros((len(seqs), width), dtype=np.int64)
    mask = np.zeros((len(seqs), width), dtype=bool)
    rows = []
    starts = data.cont_offsets
    for r, (i, s) in enumerate(zip(idx, seqs, strict=True)):
        ids[r, : len(s)] = s
        pl = int(data.prompt_lens[i])
        kept = len(s) - pl
        if kept > 0:
            mask[r, pl - 1 : len(s) - 1] = True
            rows.append(starts[i] + np.arange(kept))
    rows_np = np.concatenate(rows) if rows else np.zeros(0, np.int64)
    return (
        torch.from_numpy(ids).to(device),
        torch.from_numpy(mask).to(device),
        torch.from_numpy(rows_np).to(device),
    )


def topk_kl(
    t_ids: torch.Tensor,  # int64 [n, K]: the target's top-k token ids
    t_logp: torch.Tensor,  # [n, K]: their log-probabilities
    t2d: torch.Tensor,  # int64 [vocab]: target id -> draft id, -1 outside the draft vocab
    s_logits: torch.Tensor,  # [n, V_draft]: the drafter's logits
    temperature: float,
) -> torch.Tensor:
    """Mean KL(p_target || q_drafter), p = the top-k renormalised over the tokens in the
    draft vocabulary, q = the drafter's softmax over the draft vocabulary."""
    d_ids = t2d[t_ids]
    ok = d_ids >= 0
    t_logp = torch.log_softmax(t_logp.float().masked_fill(~ok, float("-inf")) / temperature, -1)
    t_p = t_logp.exp().nan_to_num(0.0)  # rows with no draft token: all zero, no loss
    t_plogp = (t_p * t_logp.masked_fill(~ok, 0.0)).sum(-1)  # -entropy, for a true KL
    s_logp = F.log_softmax(s_logits.float() / temperature, -1)
    return (t_plogp - (t_p * s_logp.gather(-1, d_ids.clamp(min=0))).sum(-1)).mean()


class Trainer:
    def __init__(
        self,
        students: dict[str, LlamaModel],  # sharing the target's (frozen) embedding
        d2t: torch.Tensor,  # int64 [V_draft]
        data: Sequences,
        cfg: TrainConfig,
        ckpt_path: Path,
        log: Callable[[dict], None] = lambda rec: None,
    ) -> None:
        self.students, self.data, self.cfg = students, data, cfg
        embed = next(iter(students.values())).embed_tokens.weight.detach()
        self.device = embed.device
        self.d2t = d2t.to(self.device)
        self.head = embed[self.d2t]  # [V_draft, hidden]: the tied head's draft rows
        self.t2d = torch.full((embed.shape[0],), -1, dtype=torch.long, device=self.device)
        self.t2d[self.d2t] = torch.arange(len(d2t), device=self.device)
        self.topk_ids = torch.from_numpy(data.topk_ids).to(self.device)
        self.topk_logp = torch.from_numpy(data.topk_logp).to(self.device)
        self.ckpt_path, self.log = ckpt_path, log
        self.opts = {
            name: torch.optim.AdamW(
                [p for p in s.parameters() if p.requires_grad],
                lr=cfg.lr,
                betas=(0.9, 0.95),
                weight_decay=0.0,
            )
            for name, s in students.items()
        }
        self.step, self.elapsed, self.epoch, self.cursor = 0, 0.0, 0, 0
        lengths = np.minimum(np.diff(data.offsets), cfg.max_len)
        self.lengths = lengths
        if ckpt_path.is_file():
            self._load()

    # -- checkpoints ------------------------------------------------------------------
    def _save(self) -> None:
        tmp = self.ckpt_path.with_suffix(".tmp")
        torch.save(
            {
                "step": self.step,
                "elapsed": self.elapsed,
                "epoch": self.epoch,
                "cursor": self.cursor,
                **self._model_state(),
            },
            tmp,
        )
        tmp.replace(self.ckpt_path)

    def _load(self) -> None:
        ck = torch.load(self.ckpt_path, map_location=self.device, weights_only=True)
        self._restore_models(ck)
        self.step, self.elapsed = ck["step"], ck["elapsed"]
        self.epoch, self.cursor = ck["epoch"], ck["cursor"]

    def _model_state(self) -> dict:
        return {
            "students": {n: trainable_state(s) for n, s in self.students.items()},
            "opts": {n: o.state_dict() for n, o in self.opts.items()},
        }

    def _restore_models(self, ck: dict) -> None:
        if set(ck["students"]) != set(self.students):
            raise ValueError(
                f"{self.ckpt_path}: checkpoint has students {sorted(ck['students'])}, "
                f"this run trains {sorted(self.students)}"
            )
        for n, s in self.students.items():
            s.load_state_dict(ck["students"][n], strict=False)
            self.opts[n].load_state_dict(ck["opts"][n])

    # -- loop ---------------------------------------------------------------------------
    def progress(self) -> float:
        c = self.cfg
        return max(
            self.step / c.steps if c.steps else 0.0,
            self.elapsed / c.time_budget_s if c.time_budget_s else 0.0,
        )

    def _epoch_batches(self) -> list[np.ndarray]:
        return make_batches(
            self.lengths, self.cfg.batch_tokens, np.random.default_rng(self.cfg.seed + self.epoch)
        )

    def run(self) -> dict[str, float]:
        cfg = self.cfg
        batches = self._epoch_batches()
        bar = tqdm(
            total=1000,
            desc="distill",
            unit="‰",
            mininterval=2.0,
            initial=int(self.progress() * 1000),
        )
        last_save, stats = time.monotonic(), {}
        while self.progress() < 1.0:
            if self.cursor >= len(batches):
                self.epoch, self.cursor = self.epoch + 1, 0
                batches = self._epoch_batches()
            t0 = time.monotonic()
            stats = self.train_step(batches[self.cursor])
            self.cursor += 1
            self.step += 1
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            self.elapsed += time.monotonic() - t0
            bar.n = min(int(self.progress() * 1000), 1000)
            bar.set_postfix(
                {k: f"{v:.3f}" for k, v in stats.items() if k.endswith("agree")}, refresh=False
            )
            bar.update(0)
            if self.step % cfg.log_every == 0:
                self.log(
                    {
                        "step": self.step,
                        "epoch": self.epoch,
                        "elapsed_s": round(self.elapsed, 1),
                        **stats,
                    }
                )
            if time.monotonic() - last_save > cfg.save_every_s:
                self._save()
                last_save = time.monotonic()
        bar.close()
        self._save()
        return stats

    def train_step(self, idx: np.ndarray) -> dict[str, float]:
        cfg = self.cfg
        ids, mask, rows = collate(self.data, idx, cfg.max_len, self.device)
        labels = torch.roll(ids, -1, dims=1)[mask]  # the token that was generated
        t_ids = self.topk_ids[rows].long()  # [n, K] target ids
        amp = torch.autocast(
            self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"
        )
        lr = cfg.lr * lr_factor(self.progress(), cfg.warmup, cfg.min_lr_ratio)
        stats = {
            "lr": lr,
            "tokens": float(mask.sum()),
            "label_in_vocab": float((self.t2d[labels] >= 0).float().mean()),
        }
        for name, student in self.students.items():
            student.train()
            with amp:
                s_logits = student.logits(student(ids)[mask], self.head).float()
            loss = topk_kl(t_ids, self.topk_logp[rows], self.t2d, s_logits, cfg.temperature)
            opt = self.opts[name]
            for g in opt.param_groups:
                g["lr"] = lr
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(
                [p for p in student.parameters() if p.requires_grad], cfg.grad_clip
            )
            opt.step()
            with torch.no_grad():
                s_top = self.d2t[s_logits.argmax(-1)]
                stats[f"{name}/kl"] = float(loss)
                stats[f"{name}/agree"] = float(
                    (s_top == t_ids[:, 0]).float().mean()
                )  # vs target argmax
                stats[f"{name}/label_agree"] = float((s_top == labels).float().mean())
        return stats


def jsonl_logger(path: Path) -> Callable[[dict], None]:
    def log(rec: dict) -> None:
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    return log
