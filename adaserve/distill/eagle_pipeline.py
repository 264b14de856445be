"""`adaserve distill --kind eagle` end to end. The stages and work-dir caches are the
model drafter's (adaserve/distill/pipeline.py): prompts, target generation (here with
the target's features captured while generating: feat_*.safetensors beside each
gen_*.safetensors), draft vocabulary; then the head trains with the training-time test
(eagle_train.py), checkpointing to ckpt.pt (--resume continues it), is exported per
the contract (eagle_export.py) and measured exactly on the held-out continuations
(eagle_measure.py).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from adaserve.distill import eagle_data
from adaserve.distill.data import Sequences
from adaserve.distill.eagle_export import export_eagle
from adaserve.distill.eagle_head import init_head
from adaserve.distill.eagle_measure import eagle_matches
from adaserve.distill.eagle_train import EagleTrainer
from adaserve.distill.measure import summarize
from adaserve.distill.pipeline import (
    DistillJob,
    check_settings,
    run_report,
    stage_generate,
    stage_prompts,
    stage_vocab,
)
from adaserve.distill.train import jsonl_logger
from adaserve.distill.weights import load_teacher


@dataclass(frozen=True)
class EagleSettings:
    feature_layers: tuple[int, ...]  # target layers the head reads (F of them)
    head_layers: int = 1
    ttt_steps: int = 4  # unrolled steps trained: the drafting depth it is built for
    init_from: int | None = None  # target layer the head's layers start from (None: last)
    draft_vocab_file: Path | None = None  # reuse a d2t (e.g. the 0.4.0 drafter's)
    measure_depth: int = 4


def _say(msg: str) -> None:
    print(f"[distill eagle] {msg}", flush=True)


def _settings(job: DistillJob, eagle: EagleSettings) -> dict:
    return {
        "kind": "eagle",
        "feature_layers": list(eagle.feature_layers),
        "head_layers": eagle.head_layers,
        "draft_vocab": job.draft_vocab,
        "ttt_steps": eagle.ttt_steps,
    }


def _train_phases(work: Path) -> list[Path]:
    """The generated training files in stage_generate's order (writer, greedy,
    sampled passes, extras); phases cut by the time budget have no file."""
    names = ["gen_writer.safetensors", "gen_greedy.safetensors"]
    names += sorted(p.name for p in work.glob("gen_sample*.safetensors"))
    names += sorted(p.name for p in work.glob("gen_extra*.safetensors"))
    return [work / n for n in names if (work / n).is_file()]


def run(job: DistillJob, eagle: EagleSettings) -> dict:
    if tuple(job.gen.feature_layers) != tuple(eagle.feature_layers):
        raise ValueError("job.gen.feature_layers must be the head's feature layers")
    job.work.mkdir(parents=True, exist_ok=True)
    check_settings(job, _settings(job, eagle))
    device = torch.device(job.device)
    prompts = stage_prompts(job)
    t0 = time.monotonic()
    teacher = load_teacher(job.target_dir, device)
    n_target = len(teacher.layers)
    if any(not 0 <= i < n_target for i in eagle.feature_layers):
        raise ValueError(f"feature layers {list(eagle.feature_layers)} outside 0..{n_target - 1}")
    if device.type == "cuda":
        teacher = teacher.to(torch.bfloat16)
    _, _ = stage_generate(job, teacher, prompts)
    gen_s = time.monotonic() - t0
    paths = _train_phases(job.work)
    parts = [Sequences.load(p) for p in paths]
    train = Sequences.concat(parts)
    if len(train) == 0:
        raise ValueError("no training sequences were generated (time budget too small?)")
    feats = eagle_data.load_phase_features(paths, parts, eagle.feature_layers)
    heldout_path = job.work / "gen_heldout.safetensors"
    heldout = Sequences.load(heldout_path)
    held_feats = eagle_data.load_phase_features([heldout_path], [heldout], eagle.feature_layers)
    if eagle.draft_vocab_file is not None and not (job.work / "draft_vocab.safetensors").is_file():
        shutil.copy(eagle.draft_vocab_file, job.work / "draft_vocab.safetensors")
    d2t, vocab_info = stage_vocab(job, train, teacher.shape.vocab, prompts["eos"])
    _say(
        f"{len(train)} train sequences, {len(train.tokens)} tokens with features "
        f"{feats.shape[1]} wide; draft vocab {len(d2t)} covers {vocab_info['coverage']:.4f}"
    )
    init_from = n_target - 1 if eagle.init_from is None else eagle.init_from
    teacher = teacher.float()  # the head trains in fp32 (autocast on GPUs)
    head = init_head(teacher, eagle.head_layers, eagle.feature_layers, init_from)
    trainer = EagleTrainer(
        head,
        d2t,
        train,
        feats,
        job.train,
        eagle.ttt_steps,
        job.work / "ckpt.pt",
        jsonl_logger(job.work / "train_log.jsonl"),
    )
    last = trainer.run()
    export_eagle(head, d2t, job.target_dir, job.target_spec, job.out, job.weight_format)
    head.eval()
    lm_head = teacher.embed_tokens.weight.detach()[d2t.to(device)]
    matches, steps = eagle_matches(
        head, lm_head, d2t.to(device), heldout, held_feats, eagle.measure_depth
    )
    acc = summarize(matches, eagle.measure_depth, steps)
    _say(
        f"held-out top-1 {acc.top1_agreement:.3f}, tokens per depth-{eagle.measure_depth} "
        f"step {acc.mean_emitted:.3f} ({acc.tokens} tokens; the fp32 head before export)"
    )
    report = {
        "kind": "eagle",
        **run_report(job, train, heldout, gen_s, trainer, last, d2t, vocab_info),
        "eagle": {**asdict(eagle), "draft_vocab_file": str(eagle.draft_vocab_file)},
        "init_from": init_from,
        "heldout": acc.as_dict(),
    }
    (job.out / "distill_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report
