"""Training an EAGLE head: the training-time test (EAGLE-3) over target-generated data.

Each batch runs the head `ttt_steps` times (eagle_head.EagleHead.unroll): step 0 reads
the target's features, step k the head's own h from step k - 1, exactly as drafting
does. Loss = sum_k 0.8^k KL(p_target || q_head) at every position whose root (the
verification point the chain starts from) is in the continuation, with p the target's
top-32 renormalised over the draft vocabulary (as the model drafter's loss,
adaserve/distill/train.py). Training on its own outputs is what keeps the 2nd..4th
drafts from drifting: a head trained teacher-forced only (EAGLE-1 without its feature
loss) sees inputs at drafting time it never saw in training. No feature-regression
term: with fused multi-layer inputs there is no single target feature to regress to,
and EAGLE-3 found the token loss alone better.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from adaserve.distill.data import Sequences
from adaserve.distill.eagle_head import EagleHead, head_state
from adaserve.distill.train import TrainConfig, Trainer, lr_factor, topk_kl

STEP_DECAY = 0.8  # weight of TTT step k: 0.8^k (later drafts matter less: fewer reach them)


def collate_eagle(
    data: Sequences, feats: np.ndarray, idx: np.ndarray, max_len: int, device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """ids int64 [B, T] right-padded; feats float32 [B, T, F*H]; first label row per
    sequence (its position pl - 1) int64 [B]; prompt lengths int64 [B]; and `start`,
    the batch's first root position (min prompt length - 1)."""
    seqs = [data.seq(int(i))[:max_len] for i in idx]
    width = max(len(s) for s in seqs)
    ids = np.zeros((len(seqs), width), dtype=np.int64)
    f = np.zeros((len(seqs), width, feats.shape[1]), dtype=np.float16)
    for r, (i, s) in enumerate(zip(idx, seqs, strict=True)):
        ids[r, : len(s)] = s
        o = int(data.offsets[i])
        f[r, : len(s)] = feats[o : o + len(s)]
    pls = data.prompt_lens[idx].astype(np.int64)
    lens = np.asarray([len(s) for s in seqs], dtype=np.int64)
    return (
        torch.from_numpy(ids).to(device),
        torch.from_numpy(f).to(device).float(),
        torch.from_numpy(data.cont_offsets[idx]).to(device),
        torch.from_numpy(np.stack([pls, lens], 1)).to(device),
        int(pls.min()) - 1,
    )


class EagleTrainer(Trainer):
    """Trainer's loop, schedule and checkpoint cadence, for one head."""

    def __init__(
        self,
        head: EagleHead,
        d2t: torch.Tensor,
        data: Sequences,
        feats: np.ndarray,
        cfg: TrainConfig,
        ttt_steps: int,
        ckpt_path: Path,
        log: Callable[[dict], None] = lambda rec: None,
        bf16_cpu: bool = True,
    ) -> None:
        self.head, self.data, self.feats, self.cfg = head, data, feats, cfg
        self.ttt_steps = ttt_steps
        embed = head.embed_tokens.weight.detach()
        self.device = embed.device
        self.d2t = d2t.to(self.device)
        self.lm_head = embed[self.d2t]
        self.t2d = torch.full((embed.shape[0],), -1, dtype=torch.long, device=self.device)
        self.t2d[self.d2t] = torch.arange(len(d2t), device=self.device)
        self.topk_ids = torch.from_numpy(data.topk_ids).to(self.device)
        self.topk_logp = torch.from_numpy(data.topk_logp).to(self.device)
        self.params = [p for n, p in head.named_parameters() if not n.startswith("embed_tokens")]
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
        self.ckpt_path, self.log = ckpt_path, log
        # bf16 autocast (fp32 weights and optimizer): GPUs, and CPUs with bf16 kernels,
        # where it halves the step time (AVX512-BF16: 2.1x on the CPU that trained the
        # shipped head)
        self.bf16 = self.device.type == "cuda" or (
            bf16_cpu and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        )
        self.step, self.elapsed, self.epoch, self.cursor = 0, 0.0, 0, 0
        self.lengths = np.minimum(np.diff(data.offsets), cfg.max_len)
        if ckpt_path.is_file():
            self._load()

    def _model_state(self) -> dict:
        return {"head": head_state(self.head), "opt": self.opt.state_dict()}

    def _restore_models(self, ck: dict) -> None:
        if "head" not in ck:
            raise ValueError(f"{self.ckpt_path}: not an EAGLE checkpoint")
        self.head.load_state_dict(ck["head"], strict=False)
        self.opt.load_state_dict(ck["opt"])

    def train_step(self, idx: np.ndarray) -> dict[str, float]:
        cfg = self.cfg
        ids, feats, row0, pl_len, start = collate_eagle(
            self.data, self.feats, idx, cfg.max_len, self.device
        )
        lr = cfg.lr * lr_factor(self.progress(), cfg.warmup, cfg.min_lr_ratio)
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.head.train()
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            loss, stats = self._loss(ids, feats, row0, pl_len, start)
        stats["lr"] = lr
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip)
        self.opt.step()
        stats["loss"] = float(loss.detach())
        return stats

    def _loss(
        self,
        ids: torch.Tensor,
        feats: torch.Tensor,
        row0: torch.Tensor,
        pl_len: torch.Tensor,
        start: int,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        hs = self.head.unroll(ids, feats, self.ttt_steps, start)
        t = ids.shape[1]
        pos = torch.arange(t, device=self.device)[None]
        pl, ln = pl_len[:, :1], pl_len[:, 1:]
        total = ids.new_zeros((), dtype=torch.float32)
        weights = 0.0
        stats: dict[str, float] = {}
        for k, h in enumerate(hs):
            p = pos if k == 0 else pos[:, start:]
            # position p predicts token p + 1; its chain's root p - k must be a
            # verification point (>= pl - 1), and token p + 1 must exist
            ok = (p - k >= pl - 1) & (p <= ln - 2)
            if not bool(ok.any()):  # every chain in the batch ends before step k
                break
            rows = (row0[:, None] + (p - (pl - 1)))[ok]
            loss, agree = self._kl(h[ok], rows)
            if k == 0:
                stats["tokens"] = float(len(rows))
            w = STEP_DECAY**k
            total = total + w * loss
            weights += w
            stats[f"s{k}/kl"] = float(loss.detach())
            stats[f"s{k}/agree"] = agree
        return total / weights, stats

    def _kl(self, h: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, float]:
        """topk_kl at label rows; and the head's top-1 agreement with the target's argmax."""
        t_ids = self.topk_ids[rows].long()
        s_logits = self.head.logits(h, self.lm_head).float()
        loss = topk_kl(t_ids, self.topk_logp[rows], self.t2d, s_logits, self.cfg.temperature)
        with torch.no_grad():
            agree = float((self.d2t[s_logits.argmax(-1)] == t_ids[:, 0]).float().mean())
        return loss, agree
