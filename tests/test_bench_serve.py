"""`adaserve bench serve` against a real HTTP server on loopback.

The server speaks the OpenAI streaming format and paces tokens per SLO class, so the
measured TPOT and attainment are known in advance; the load generator, SSE parsing,
timing and summary all run for real."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from pathlib import Path

import pytest
import uvicorn
import yaml
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from adaserve.cli import main

# The test server tells the classes apart by prompt length: ms per token it streams at
# (chat misses the 30 ms SLO by far, margins wide enough for a loaded CI machine), or
# 429 for the "reject" class.
PROMPT_LEN = {"coding": 12, "chat": 13, "reject": 7}
PACE_MS = {12: 2.0, 13: 70.0}


def _app(seen: list[dict]) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        seen.append(body)
        if len(body["prompt"]) == PROMPT_LEN["reject"]:
            return JSONResponse({"error": {"message": "busy"}}, status_code=429)
        n = body["max_tokens"]
        pace = PACE_MS[len(body["prompt"])] / 1000.0

        async def events():
            for i in range(n):
                await asyncio.sleep(pace if i else 0.01)
                choice = {
                    "index": 0,
                    "text": f"t{i} ",
                    "finish_reason": "length" if i == n - 1 else None,
                }
                yield f"data: {json.dumps({'choices': [choice], 'usage': None})}\n\n"
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture
def server():
    seen: list[dict] = []
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(_app(seen), host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not srv.started:
        assert time.monotonic() < deadline, "test server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", seen
    srv.should_exit = True
    thread.join(timeout=10)


def _workload(tmp_path: Path, classes: dict) -> Path:
    data = {
        "name": "bench-test",
        "profile": "llama-3.1-70b-tp4-a100",
        "rps": 10.0,
        "duration_s": 1.0,
        "classes": {
            name: {
                "weight": w,
                "slo": {"tpot_ms": 30.0},
                "prompt_tokens": {"dist": "constant", "mean": PROMPT_LEN[name]},
                "output_tokens": {"dist": "constant", "mean": 8},
            }
            for name, w in classes.items()
        },
    }
    path = tmp_path / "wl.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_bench_measures_tpot_and_attainment(server, tmp_path):
    url, seen = server
    wl = _workload(tmp_path, {"coding": 0.5, "chat": 0.5})
    out = tmp_path / "bench"
    rc = main(["bench", "serve", str(wl), "--url", url, "--out", str(out), "--quiet"])
    assert rc == 0
    s = json.loads((out / "summary.json").read_text())
    pc = s["per_class"]
    assert pc["coding"]["slo_attainment"] == 1.0 and pc["chat"]["slo_attainment"] == 0.0
    assert 2.0 <= pc["coding"]["tpot_p50_ms"] < 30.0
    assert 68.0 <= pc["chat"]["tpot_p50_ms"] < 150.0
    assert s["requests"] == len(seen) > 3 and s["errors"] == 0
    body = seen[0]
    assert body["stream"] and body["ignore_eos"] and body["tpot_slo_ms"] == 30.0
    assert len(body["prompt"]) in (12, 13) and body["max_tokens"] == 8
    records = [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]
    assert all(r["num_tokens"] == 8 and r["finish_reason"] == "length" for r in records)
    assert (out / "latency.png").stat().st_size > 1000

    # the compare command lines two runs up side by side
    assert main(["bench", "compare", str(out), str(out)]) == 0


def test_bench_counts_rejections_as_violations(server, tmp_path, capsys):
    url, _ = server
    wl = _workload(tmp_path, {"reject": 1.0})
    out = tmp_path / "rej"
    assert main(["bench", "serve", str(wl), "--url", url, "--out", str(out), "--no-plots"]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["slo_attainment"] == 0.0 and s["errors"] == s["requests"] > 0
    assert "HTTP 429" in capsys.readouterr().out


def test_bench_bad_url(tmp_path, capsys):
    wl = _workload(tmp_path, {"coding": 1.0})
    assert main(["bench", "serve", str(wl), "--url", "localhost:1", "--out", str(tmp_path)]) == 2
    assert "http://" in capsys.readouterr().err


def test_unreachable_server_is_reported_per_request(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    wl = _workload(tmp_path, {"coding": 1.0})
    out = tmp_path / "down"
    rc = main(
        [
            "bench",
            "serve",
            str(wl),
            "--url",
            f"http://127.0.0.1:{port}",
            "--out",
            str(out),
            "--quiet",
            "--no-plots",
            "--duration",
            "0.3",
        ]
    )
    assert rc == 0
    records = [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]
    assert records and all(
        r["finish_reason"] == "error" and "Connect" in r["error"] for r in records
    )
