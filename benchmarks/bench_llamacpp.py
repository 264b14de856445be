"""Single-stream decode speed of adaserve against llama.cpp (issue 25), side by side.

One `adaserve up --all-in-one` (embedded pair, `configs/embedded-cpu.yaml`) and one
llama.cpp process (llama-cpp-python, the embedded GGUF: SmolLM2-135M-Instruct Q4_1, the
file adaserve dequantizes to fp32) take the same prompts in alternation, one request at
a time, greedy, ending at end-of-text or `--max-tokens`. Both get the same prompt token
ids (adaserve's chat template). Each request is streamed and timed from its first token
to its last: decode tokens/s = (tokens - 1) / that time, so prefill (which adaserve's
prefix cache would skip and llama.cpp's would not) is left out; TTFT is reported apart.
Ratios are medians over rounds of adaserve's request over the llama.cpp request beside
it (same prompt).

llama-cpp-python is not a dependency of adaserve: point `--llama-python` at a Python
that has it (it runs there as a worker on stdin/stdout).

    .venv/bin/python benchmarks/bench_llamacpp.py --llama-python /tmp/llamacpp-venv/bin/python \
        --category summarize --methods none ngram auto --repeats 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import httpx
from _server import free_port, start_up, stop_up
from bench_spec_server import prompt_set

from adaserve.model.embedded import embedded_gguf
from adaserve.model.loader import load_tokenizer

# The llama.cpp side: one JSON request per line (prompt ids, max tokens), one JSON
# answer per line (tokens, ttft_s, decode_s). Greedy: temp 0.
WORKER = r"""
import json, sys, time
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=2048, n_threads=int(sys.argv[2]), verbose=False)
eos = llm.token_eos()
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    t0 = time.perf_counter(); times = []; ids = []
    for tok in llm.generate(req["ids"], temp=0.0, top_k=1, reset=True):
        times.append(time.perf_counter())
        if tok == eos:
            break
        ids.append(tok)
        if len(ids) >= req["max_tokens"]:
            break
    print(json.dumps({"tokens": len(ids), "ttft_s": times[0] - t0,
                      "decode_s": times[len(ids) - 1] - times[0], "ids": ids}), flush=True)
"""


def stream_one(port: int, messages: list[dict], max_tokens: int, method: str) -> dict:
    """One streamed chat request to adaserve: tokens, TTFT and first-to-last token time."""
    body = {
        "model": "SmolLM2-135M-Instruct",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "tpot_slo_ms": 1000.0,
        "speculation": {"method": method},
    }
    t0 = time.perf_counter()
    first = last = None
    first_text = ""
    tokens = 0
    with (
        httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as r,
    ):
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                last = time.perf_counter()
                if first is None:
                    first, first_text = last, chunk["choices"][0]["delta"]["content"]
    assert first is not None and last is not None
    return {"tokens": tokens, "ttft_s": first - t0, "decode_s": last - first, "first": first_text}


def rate(r: dict) -> float:
    """Tokens after the first chunk over the time after it (a verified tree may send
    several tokens in one chunk: `first_tokens`, 1 for llama.cpp)."""
    done = r["tokens"] - r.get("first_tokens", 1)
    return done / r["decode_s"] if r["decode_s"] > 0 else float("nan")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--llama-python", required=True, help="a Python with llama-cpp-python")
    p.add_argument("--llama-threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--category", default=None, choices=["summarize", "coding", "chat", "qa"])
    p.add_argument("--methods", nargs="+", default=["none", "ngram", "auto"])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--config", default="configs/embedded-cpu.yaml")
    p.add_argument("--drafter", default="embedded", help="adaserve's drafter (embedded-eagle)")
    p.add_argument("--out", default="benchmarks/results/llamacpp")
    args = p.parse_args()

    out = Path(args.out)
    prompts = prompt_set(args.category)
    tok = load_tokenizer("embedded")
    ids = [
        tok(
            tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )["input_ids"]
        for m in prompts
    ]
    worker = subprocess.Popen(
        [args.llama_python, "-c", WORKER, str(embedded_gguf()), str(args.llama_threads)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert worker.stdin is not None and worker.stdout is not None
    assert json.loads(worker.stdout.readline())["ready"]

    def llama(i: int) -> dict:
        worker.stdin.write(json.dumps({"ids": ids[i], "max_tokens": args.max_tokens}) + "\n")
        worker.stdin.flush()
        return json.loads(worker.stdout.readline())

    port = free_port()
    up = ["--all-in-one", "--target", "embedded", "--drafter", args.drafter]
    up += ["--config", args.config, "--metrics-port", str(free_port())]
    proc = start_up(up, port, out / "up.log")
    modes = ["llama.cpp", *args.methods]
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    try:
        for i in range(len(prompts)):  # warm-up; adaserve's prefix cache holds the prompts
            llama(i)
            stream_one(port, prompts[i], 4, "none")
        for k in range(args.repeats):
            i = k % len(prompts)
            for mode in modes:
                if mode == "llama.cpp":
                    r = llama(i)
                else:
                    r = stream_one(port, prompts[i], args.max_tokens, mode)
                    # the first chunk's tokens, by re-tokenizing its text
                    r["first_tokens"] = len(
                        tok(r.pop("first"), add_special_tokens=False)["input_ids"]
                    )
                runs[mode].append({k: v for k, v in r.items() if k != "ids"} | {"prompt": i})
    finally:
        stop_up(proc)
        worker.stdin.close()
        worker.wait(timeout=30)
    rows = []
    print(f"{'mode':>10s}  decode tok/s  TTFT ms  ratio vs llama.cpp (median per round)")
    for mode in modes:
        rates = [rate(r) for r in runs[mode]]
        ratios = [a / b for a, b in zip(rates, (rate(r) for r in runs["llama.cpp"]), strict=True)]
        row = {
            "mode": mode,
            "decode_tokens_per_s_median": statistics.median(rates),
            "ttft_ms_median": 1000 * statistics.median(r["ttft_s"] for r in runs[mode]),
            "ratio_vs_llamacpp": statistics.median(ratios),
            "runs": runs[mode],
        }
        rows.append(row)
        print(
            f"{mode:>10s}  {row['decode_tokens_per_s_median']:12.1f}  "
            f"{row['ttft_ms_median']:7.0f}  {row['ratio_vs_llamacpp']:.2f}"
        )
    result = {
        "category": args.category,
        "max_tokens": args.max_tokens,
        "llama_threads": args.llama_threads,
        "load_after": os.getloadavg(),
        "rows": rows,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
