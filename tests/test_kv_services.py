"""KV on demand through the services (a real verifier with an in-process drafter and a
real gateway on loopback, the official `openai` client): a burst that overflows a small
KV cache finishes whole, with requests preempted and recomputed, every output the
target's own greedy output; a prompt longer than the whole cache is a 400 naming it and
nothing else is affected."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import openai
import pytest

from tests._faults import metric
from tests._serving import (
    TEST_CONFIG,
    free_port,
    greedy_reference,
    make_served_model,
    start_gateway,
    start_verifier,
)

pytestmark = pytest.mark.slow

# 12 blocks of 16 tokens: four requests of ~10 + 60 tokens cannot all hold their KV.
SMALL_KV = TEST_CONFIG.replace(
    "engine:\n", "engine:\n  kv_blocks: 12\n  kv_block_size: 16\n  kv_watermark: 0.0\n"
)


@pytest.fixture(scope="module")
def small_kv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, object]]:
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("kv")
    target = make_served_model(root / "target", seed=0)
    metrics_port = free_port()
    vproc, vaddr = start_verifier(root, target, target, SMALL_KV, metrics_port=metrics_port)
    try:
        gproc, url = start_gateway(root, "--verifier", vaddr, wait_path="/ready")
    except BaseException:
        vproc.stop()
        raise
    try:
        yield (
            url,
            f"http://127.0.0.1:{metrics_port}/metrics",
            (target, AutoTokenizer.from_pretrained(target)),
        )
    finally:
        gproc.stop()
        vproc.stop()


def test_a_burst_that_overflows_the_kv_cache_finishes_whole(small_kv) -> None:
    url, metrics_url, (target, tokenizer) = small_kv
    before = metric(metrics_url, "adaserve_num_preemptions_total")
    prompts = [f"Burst request {i}: tell me something." for i in range(4)]
    slos = [30.0, 60.0, 1000.0, 5000.0]

    async def burst() -> list:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        return await asyncio.gather(
            *(
                client.completions.create(
                    model="tiny",
                    prompt=p,
                    max_tokens=60,
                    temperature=0,
                    extra_body={"ignore_eos": True, "tpot_slo_ms": slo},
                )
                for p, slo in zip(prompts, slos, strict=True)
            )
        )

    outs = asyncio.run(burst())
    for p, out in zip(prompts, outs, strict=True):
        ids = tokenizer.encode(p)
        ref = greedy_reference(target, ids, 60, eos=())
        assert out.choices[0].finish_reason == "length"
        assert out.choices[0].text == tokenizer.decode(ref, skip_special_tokens=True)
    assert metric(metrics_url, "adaserve_num_preemptions_total") > before


def test_a_prompt_longer_than_the_kv_cache_is_a_400(small_kv) -> None:
    url = small_kv[0]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="longer than the KV cache"):
        client.completions.create(model="tiny", prompt=[5] * 250, max_tokens=4)
    ok = client.completions.create(model="tiny", prompt="still serving", max_tokens=4)
    assert ok.choices[0].finish_reason in ("length", "stop")
