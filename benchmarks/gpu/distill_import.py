"""Turn what `distill_collect.py` brought back from a GPU run into drafter directories.

    python benchmarks/gpu/distill_import.py FILES_DIR TARGET DEST [float|int8_rowwise]

FILES_DIR holds `<student>-<n>.safetensors` shards and `report.json`; TARGET is the
target's HF directory (or 'embedded'), whose tokenizer files the drafters share. Each
student lands in DEST/<student>, loadable with `--drafter DEST/<student>`.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import torch
from safetensors.torch import load_file

from adaserve.distill.export import export_drafter
from adaserve.model.embedded import resolve_model


def main(files: Path, target: str, dest: Path, weight_format: str = "float") -> None:
    target_dir = resolve_model(target)
    report = json.loads((files / "report.json").read_text())
    shards: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    for f in sorted(files.glob("*-*.safetensors")):
        shards[f.stem.rsplit("-", 1)[0]].update(load_file(str(f)))
    d2t = next(s["__d2t"] for s in shards.values() if "__d2t" in s)
    for name, state in sorted(shards.items()):
        student = {k.removeprefix("model."): v for k, v in state.items() if not k.startswith("__")}
        export_drafter(student, d2t, target_dir, report["target"], dest / name, weight_format)
        cfg = json.loads((dest / name / "config.json").read_text())
        want = report["drafter_configs"][name]["num_hidden_layers"]
        if cfg["num_hidden_layers"] != want:
            raise ValueError(
                f"{name}: {cfg['num_hidden_layers']} layers rebuilt, the run trained {want}"
            )
        print(f"{dest / name}: {want} layers, held-out {report['students'].get(name)}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), *sys.argv[4:5])
