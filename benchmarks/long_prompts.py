"""Long-prompt chat rows for `adaserve measure-drafter --prompts`, from text every Python
install has: the reference manual's topics (`pydoc_data.topics`, English prose with
code) and standard-library modules (Python source).

    .venv/bin/python benchmarks/long_prompts.py --out /tmp/long.jsonl --chars 12000
    HF_HUB_OFFLINE=1 .venv/bin/python -m adaserve measure-drafter \\
        --prompts /tmp/long.jsonl --limit 16 --max-new-tokens 64 --draft-context 256 512 1024

Each row asks for a continuation of one document cut to --chars characters (~4 per
token): the case where a drafter reading only the prompt's tail (the serving setting
`speculation.draft_context`) may lose acceptance. Deterministic: documents in name
order, the longest first.
"""

from __future__ import annotations

import argparse
import inspect
import json
from pathlib import Path

# Standard-library modules long enough for the longest --chars asked of them.
MODULES = ("argparse", "dataclasses", "inspect", "subprocess", "typing", "zipfile", "tarfile")


def rows(chars: int, per_category: int) -> list[dict]:
    from pydoc_data.topics import topics

    docs = sorted((t for t in topics.items() if len(t[1]) >= chars), key=lambda t: t[0])
    code = []
    for name in MODULES:
        src = inspect.getsource(__import__(name))
        if len(src) >= chars:
            code.append((name, src))
    out = []
    for category, items in (("docs", docs), ("code", code)):
        for name, text in items[:per_category]:
            prompt = f"Continue this text ({name}):\n\n{text[:chars]}"
            out.append({"category": category, "messages": [{"role": "user", "content": prompt}]})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--chars", type=int, default=12000, help="characters of each document")
    p.add_argument("--per-category", type=int, default=8)
    args = p.parse_args()
    out = rows(args.chars, args.per_category)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in out))
    print(f"{len(out)} rows -> {args.out}")


if __name__ == "__main__":
    main()
