"""Bring a GPU `adaserve distill` run back through the device tool's file limits
(at most 8 files of 16 MiB, 64 MiB in all): each student's weights in <= 15 MiB shards,
the draft vocabulary beside the first, and one JSON report with every student's config.
`distill_import.py` turns them back into drafter directories.

    python benchmarks/gpu/distill_collect.py OUT_DIR WORK_DIR DEST
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from safetensors.torch import load_file, save_file

SHARD_BYTES = 15 * 2**20


def main(out: Path, work: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    report = json.loads((out / "distill_report.json").read_text())
    log = work / "train_log.jsonl"
    report["train_log"] = (
        [json.loads(x) for x in log.read_text().splitlines()] if log.is_file() else []
    )
    first = True
    for sdir in sorted(p for p in out.iterdir() if p.is_dir()):
        state = load_file(str(sdir / "model.safetensors"))
        if first:  # small extras ride along with the first student
            state.update({"__d2t": load_file(str(sdir / "draft_vocab.safetensors"))["d2t"]})
            first = False
        report.setdefault("drafter_configs", {})[sdir.name] = json.loads(
            (sdir / "config.json").read_text()
        )
        shard, size, n = {}, 0, 0
        for k in sorted(state):
            nbytes = state[k].numel() * state[k].element_size()
            if shard and size + nbytes > SHARD_BYTES:
                save_file(shard, str(dest / f"{sdir.name}-{n}.safetensors"))
                shard, size, n = {}, 0, n + 1
            shard[k], size = state[k].contiguous(), size + nbytes
        save_file(shard, str(dest / f"{sdir.name}-{n}.safetensors"))
    (dest / "report.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
