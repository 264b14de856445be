"""`adaserve distill` end to end; every stage caches its result in the work dir, so a
rerun with --resume continues where the last one stopped:

  prompts.json            chat-templated prompt ids (needs the tokenizer)
  gen_*.safetensors       target continuations: held-out greedy, writer texts,
                          train greedy, then sampled passes while the budget lasts;
                          any gen_extra*.safetensors (generated elsewhere, e.g. by
                          another run's work dir) joins the training data
  draft_vocab.safetensors d2t: the most frequent continuation tokens
  ckpt.pt                 students + optimizer state, saved periodically
then each student is exported as a drafter directory and measured on the held-out set.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from adaserve.distill import measure
from adaserve.distill.data import Sequences, tokenize_prompts
from adaserve.distill.export import export_drafter
from adaserve.distill.generate import generate_all
from adaserve.distill.llama import LlamaModel
from adaserve.distill.train import TrainConfig, Trainer, jsonl_logger
from adaserve.distill.vocab import (
    continuation_counts,
    coverage,
    expected_counts,
    select_draft_vocab,
)
from adaserve.distill.weights import init_student, load_teacher, trainable_state

PROMPTS_DIR = Path(__file__).parent / "prompts"


@dataclass(frozen=True)
class GenSettings:
    max_new_tokens: int = 256
    heldout_max_new_tokens: int = 192
    writer_max_new_tokens: int = 160
    batch: int = 32
    sample_passes: int = 1
    temperature: float = 0.8
    top_p: float = 0.95
    time_budget_s: float | None = None  # writer/greedy/sampled phases stop when it runs out
    max_prompts: int | None = None  # cap on train prompts (quick runs, tests)
    max_heldout: int | None = None  # cap on held-out prompts
    workers: int = 1  # CPU: single-threaded generation processes
    # target layers whose outputs are kept per token (feat_*.safetensors, EAGLE training)
    feature_layers: tuple[int, ...] = ()


@dataclass(frozen=True)
class DistillJob:
    target_dir: Path
    target_spec: str  # recorded in the drafter's config (adaserve_target)
    out: Path
    work: Path
    layers: tuple[int, ...]
    draft_vocab: int
    train: TrainConfig
    gen: GenSettings
    device: str
    train_prompts: Path = PROMPTS_DIR / "train.jsonl"
    heldout_prompts: Path = PROMPTS_DIR / "heldout.jsonl"
    resume: bool = False
    weight_format: str = "float"


def _say(msg: str) -> None:
    print(f"[distill] {msg}", flush=True)


def stage_prompts(job: DistillJob) -> dict:
    path = job.work / "prompts.json"
    if not path.is_file():
        _say("tokenizing prompts")
        path.write_text(
            json.dumps(tokenize_prompts(job.target_dir, job.train_prompts, job.heldout_prompts))
        )
    return json.loads(path.read_text())


def _phase(
    job: DistillJob,
    name: str,
    teacher: LlamaModel,
    prompts: list[list[int]],
    eos: list[int],
    max_new: int,
    deadline: float | None,
    temperature: float = 0.0,
    seed: int = 0,
) -> Sequences:
    path = job.work / f"gen_{name}.safetensors"
    if path.is_file():
        return Sequences.load(path)
    if deadline is not None and time.monotonic() > deadline:
        return Sequences.build([], [])
    conts = generate_all(
        teacher,
        prompts,
        max_new,
        eos,
        job.gen.batch,
        temperature,
        job.gen.top_p,
        seed,
        deadline,
        desc=f"generate {name}",
        workers=job.gen.workers,
        target_dir=job.target_dir,
        feature_layers=job.gen.feature_layers,
    )
    seqs = Sequences.build(prompts, conts)
    if job.gen.feature_layers:  # written first: a gen file without its features is redone
        from adaserve.distill import eagle_data

        width = len(job.gen.feature_layers) * teacher.shape.hidden
        feats = eagle_data.build_features(conts, width)
        eagle_data.save_features(eagle_data.feature_path(path), feats, job.gen.feature_layers)
    seqs.save(path)
    _say(
        f"{name}: {len(seqs)} sequences, {int(sum(len(seqs.continuation(i)) for i in range(len(seqs))))} new tokens"
    )
    return seqs


def stage_generate(
    job: DistillJob, teacher: LlamaModel, prompts: dict
) -> tuple[Sequences, Sequences]:
    g, eos = job.gen, prompts["eos"]
    deadline = time.monotonic() + g.time_budget_s if g.time_budget_s else None
    heldout = _phase(
        job,
        "heldout",
        teacher,
        prompts["heldout"][: g.max_heldout],
        eos,
        g.heldout_max_new_tokens,
        None,
    )
    direct, writers = prompts["direct"], prompts["writer"]
    if g.max_prompts is not None:
        n_w = min(len(writers), g.max_prompts * len(writers) // (len(direct) + len(writers)))
        direct, writers = direct[: g.max_prompts - n_w], writers[:n_w]
    texts = _phase(
        job,
        "writer",
        teacher,
        [w["writer"] for w in writers],
        eos,
        g.writer_max_new_tokens,
        deadline,
    )
    train_prompts = list(direct)
    for i in range(len(texts)):
        text = [t for t in texts.continuation(i).tolist() if t not in eos]
        w = writers[i]  # writer phase keeps prompt order when nothing was skipped
        if text and list(texts.seq(i)[: texts.prompt_lens[i]]) == w["writer"]:
            train_prompts.append(w["prefix"] + text + w["suffix"])
    # writer texts are target continuations too: they train as well
    parts = [texts, _phase(job, "greedy", teacher, train_prompts, eos, g.max_new_tokens, deadline)]
    for k in range(g.sample_passes):
        parts.append(
            _phase(
                job,
                f"sample{k}",
                teacher,
                train_prompts,
                eos,
                g.max_new_tokens,
                deadline,
                g.temperature,
                seed=1000 + k,
            )
        )
    parts += [Sequences.load(p) for p in sorted(job.work.glob("gen_extra*.safetensors"))]
    return Sequences.concat(parts), heldout


def stage_vocab(
    job: DistillJob, train: Sequences, vocab: int, eos: list[int]
) -> tuple[torch.Tensor, dict]:
    path = job.work / "draft_vocab.safetensors"
    counts = continuation_counts(train, vocab)
    if path.is_file():
        d2t = load_file(str(path))["d2t"]
    else:
        d2t = torch.from_numpy(
            select_draft_vocab(expected_counts(train, vocab), job.draft_vocab, eos)
        )
        save_file({"d2t": d2t}, str(path))
    if len(d2t) != job.draft_vocab:
        raise ValueError(
            f"{path} has {len(d2t)} tokens, --draft-vocab is {job.draft_vocab}: use a new work dir"
        )
    info = {
        f"coverage_{n}": round(coverage(counts, select_draft_vocab(counts, n, eos)), 5)
        for n in (4096, 8192, 12288, 16384, 32768)
        if n <= vocab
    }
    info["coverage"] = round(coverage(counts, d2t.numpy()), 5)
    return d2t, info


def check_settings(job: DistillJob, now: dict | None = None) -> None:
    """A work dir with a checkpoint continues only with --resume and the same settings."""
    path = job.work / "settings.json"
    now = now or {"layers": list(job.layers), "draft_vocab": job.draft_vocab}
    if (job.work / "ckpt.pt").is_file():
        if not job.resume:
            raise ValueError(
                f"{job.work} holds a checkpoint: pass --resume to continue it, or use another --work-dir"
            )
        before = json.loads(path.read_text()) if path.is_file() else now
        if before != now:
            raise ValueError(f"{job.work} was started with {before}, this run asks for {now}")
    path.write_text(json.dumps(now))


def run_report(
    job: DistillJob,
    train: Sequences,
    heldout: Sequences,
    gen_s: float,
    trainer: Trainer,
    last: dict,
    d2t: torch.Tensor,
    vocab_info: dict,
) -> dict:
    """distill_report.json's account of the data and the training run."""
    device = torch.device(job.device)
    return {
        "target": job.target_spec,
        "device": str(device),
        "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
        "train_sequences": len(train),
        "train_tokens": len(train.tokens),
        "train_continuation_tokens": int(len(train.tokens) - train.prompt_lens.sum()),
        "heldout_sequences": len(heldout),
        "generate_s": round(gen_s, 1),
        "steps": trainer.step,
        "epochs": trainer.epoch,
        "train_s": round(trainer.elapsed, 1),
        "train_config": asdict(job.train),
        "gen_config": asdict(job.gen),
        "last_step": last,
        "draft_vocab": len(d2t),
        **vocab_info,
    }


def run(job: DistillJob) -> dict:
    job.work.mkdir(parents=True, exist_ok=True)
    check_settings(job)
    device = torch.device(job.device)
    prompts = stage_prompts(job)
    t0 = time.monotonic()
    teacher = load_teacher(job.target_dir, device)
    if device.type == "cuda":
        teacher = teacher.to(torch.bfloat16)
    train, heldout = stage_generate(job, teacher, prompts)
    gen_s = time.monotonic() - t0
    if len(train) == 0:
        raise ValueError("no training sequences were generated (time budget too small?)")
    d2t, vocab_info = stage_vocab(job, train, teacher.shape.vocab, prompts["eos"])
    _say(
        f"{len(train)} train sequences; draft vocab {len(d2t)} covers {vocab_info['coverage']:.4f}"
    )
    students = {f"L{n}": init_student(teacher, n) for n in job.layers}
    trainer = Trainer(
        students,
        d2t,
        train,
        job.train,
        job.work / "ckpt.pt",
        jsonl_logger(job.work / "train_log.jsonl"),
    )
    last = trainer.run()
    report = run_report(job, train, heldout, gen_s, trainer, last, d2t, vocab_info)
    report["students"] = {}
    head = teacher.embed_tokens.weight.detach()[d2t.to(device)]
    for name, student in students.items():
        dest = job.out if len(students) == 1 else job.out / name
        export_drafter(
            trainable_state(student), d2t, job.target_dir, job.target_spec, dest, job.weight_format
        )
        student.eval()
        acc = measure.summarize(
            measure.draft_matches(student, head, d2t.to(device), heldout), depth=4
        )
        report["students"][name] = acc.as_dict()
        _say(
            f"{name}: held-out top-1 {acc.top1_agreement:.3f}, mean emitted (depth 4) {acc.mean_emitted:.3f}"
        )
    job.out.mkdir(parents=True, exist_ok=True)
    (job.out / "distill_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report
