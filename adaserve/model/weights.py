"""Read Hugging Face safetensors checkpoints: one file or sharded through
`model.safetensors.index.json`. Tensors are read one at a time (memory-mapped), so a
rank only ever materializes the tensor it is sharding."""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from adaserve.model.config import UnsupportedModelError


class WeightSource:
    def __init__(self, path: str | Path, tensors: dict[str, torch.Tensor] | None = None) -> None:
        """Tensors from the checkpoint files in `path`, or from `tensors` when given (a
        state dict completed in memory, e.g. a distilled drafter's)."""
        self.path = Path(path)
        self._tensors = tensors
        self._where = {k: "" for k in tensors} if tensors is not None else _index(self.path)
        self._stack = ExitStack()
        self._open: dict[str, safe_open] = {}

    def __enter__(self) -> WeightSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def names(self) -> set[str]:
        return set(self._where)

    def has(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        try:
            file = self._where[name]
        except KeyError:
            raise UnsupportedModelError(f"{self.path}: checkpoint has no tensor {name!r}") from None
        if self._tensors is not None:
            return self._tensors[name]
        handle = self._open.get(file)
        if handle is None:
            handle = self._stack.enter_context(
                safe_open(str(self.path / file), framework="pt", device="cpu")
            )
            self._open[file] = handle
        return handle.get_tensor(name)


def load_state(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, in memory."""
    with WeightSource(path) as src:
        return {name: src.get(name) for name in sorted(src.names())}


def _index(path: Path) -> dict[str, str]:
    """tensor name -> file name, from the index or the single file's header."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        missing = {f for f in weight_map.values() if not (path / f).is_file()}
        if missing:
            raise UnsupportedModelError(f"{path}: shard(s) missing: {', '.join(sorted(missing))}")
        return dict(weight_map)
    single = path / "model.safetensors"
    if single.is_file():
        with safe_open(str(single), framework="pt", device="cpu") as f:
            return {k: single.name for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    if any(path.glob("*.bin")) or any(path.glob("*.pt")):
        raise UnsupportedModelError(
            f"{path}: only pickle (.bin/.pt) weights found; convert them to safetensors"
        )
    raise UnsupportedModelError(f"{path}: no model.safetensors or model.safetensors.index.json")
