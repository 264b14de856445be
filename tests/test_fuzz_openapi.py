"""The gateway's published OpenAPI schema, fuzzed with schemathesis against a live
gateway in front of a live verifier unit (tiny random target, real tokenizer).

Every operation gets schema-valid and schema-invalid requests (bounded and
derandomized, so CI is reproducible and under a minute): none may get a 5xx, every
response must conform to the schema (status code, content type, headers, body), and
schema-invalid input must be refused with a 4xx. The unit's context is 64 tokens and
the gateway's max_tokens limit 16, so valid requests generate little and stay fast.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests._serving import TEST_CONFIG, make_served_model, start_gateway, start_verifier

pytestmark = pytest.mark.slow  # two serving processes


def rejected_or_too_large(ctx: Any, response: Any, case: Any) -> bool | None:
    """schemathesis' negative_data_rejection, with 413 counted as a rejection too: a
    generated body over the gateway's 4 MiB limit is refused before it is parsed
    (gateway/limits.py), which schemathesis' default list of rejecting statuses omits."""
    if response.status_code == 413:
        return None
    return negative_data_rejection(ctx, response, case)


CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    rejected_or_too_large,
]
UNIT_CONFIG = TEST_CONFIG.replace("engine:\n", "engine:\n  max_model_len: 64\n")
EXAMPLES = 150  # per operation and mode; the whole module stays under a minute of calls
GATEWAY_CONFIG = """\
gateway:
  max_tokens_limit: 16
  health_interval_s: 0.5
"""


@pytest.fixture(scope="module")
def gateway_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("fuzz")
    target = make_served_model(root / "target")
    vproc, vaddr = start_verifier(root, target, None, config=UNIT_CONFIG)
    cfg = Path(root / "gateway.yaml")
    cfg.write_text(GATEWAY_CONFIG)
    try:
        gproc, url = start_gateway(
            root, "--verifier", vaddr, "--config", str(cfg), wait_path="/ready"
        )
    except BaseException:
        vproc.stop()
        raise
    try:
        yield url
    finally:
        gproc.stop()
        vproc.stop()


MODES = [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE]


def operations(url: str) -> list[schemathesis.APIOperation]:
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


@pytest.mark.parametrize("mode", MODES, ids=str)
def test_gateway_conforms_to_its_schema(
    gateway_url: str, mode: schemathesis.GenerationMode
) -> None:
    # schemathesis' own pytest loader predates this pytest; hypothesis drives it here.
    failures: dict[str, str] = {}
    statuses: dict[int, int] = {}
    for op in operations(gateway_url):
        if mode == schemathesis.GenerationMode.NEGATIVE and not len(op.body):
            continue  # nothing to get wrong in a body-less GET

        @given(case=op.as_strategy(generation_mode=mode))
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def run(case: schemathesis.Case) -> None:
            response = case.call_and_validate(base_url=gateway_url, checks=CHECKS, timeout=30)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1

        try:
            run()
        except (Exception, BaseExceptionGroup) as exc:  # report every operation's at once
            failures[op.label] = str(exc)[:2000]
    print(f"{mode}: {sum(statuses.values())} requests, by status {dict(sorted(statuses.items()))}")
    assert not failures, "\n\n".join(f"{k}:\n{v}" for k, v in failures.items())


GOOD_BODIES = {
    "POST /v1/completions": {"model": "tiny", "prompt": "Once upon", "max_tokens": 8},
    "POST /v1/chat/completions": {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 8,
    },
}


@pytest.mark.parametrize("stream", [False, True])
def test_successful_generations_conform(gateway_url: str, stream: bool) -> None:
    """Random bodies rarely pass every limit at once: make sure a 200, streamed and
    not, is checked against the schema too."""
    for op in operations(gateway_url):
        if op.label in GOOD_BODIES:
            body = GOOD_BODIES[op.label] | {"stream": stream}
            response = op.Case(body=body, media_type="application/json").call_and_validate(
                base_url=gateway_url, checks=CHECKS, timeout=30
            )
            assert response.status_code == 200
            kind = "text/event-stream" if stream else "application/json"
            assert response.headers["content-type"][0].startswith(kind)
