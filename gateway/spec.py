"""One generation request as the gateway forwards it, whichever front it came from.

The REST and gRPC fronts both build a `GenerateSpec`; settings-dependent checks
(limits, SLO header, defaults) happen once, here, and `to_pb` is the only place that
knows the verifier's wire format.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

from adaserve import routing
from adaserve.config import Settings
from adaserve.rpc.v1 import verifier_pb2 as vpb
from gateway.errors import bad_request
from gateway.openai_schemas import REQUEST_ID_RE, ChatCompletionRequest, CompletionRequest
from services.common.convert import speculation_method_to_pb

SLO_HEADER = "x-slo-tpot-ms"
TTFT_HEADER = "x-slo-ttft-ms"
REQUEST_ID_HEADER = "x-request-id"
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CUSTOM_SLO_CLASS = "custom"  # metrics label of requests with an explicit tpot_slo_ms


@dataclass(frozen=True)
class Message:
    role: str
    content: str
    name: str = ""


@dataclass(frozen=True)
class GenerateSpec:
    kind: Literal["completion", "chat"]
    model: str | None
    prompt_text: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    messages: tuple[Message, ...] | None = None
    add_generation_prompt: bool = True
    max_tokens: int = COMPLETION_DEFAULT_MAX_TOKENS  # 0: the rest of the model's context
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    tpot_slo_ms: float | None = None
    ttft_slo_ms: float | None = None  # None: the class's TTFT SLO, if it has one
    slo_class: str | None = None
    priority: int = 0
    timeout_s: float | None = None
    client_request_id: str | None = None
    speculation: str | None = None  # method; None: the SLO class's, else the unit's default
    # The verifier's request id: always fresh, so clients reusing an id never collide.
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def response_id(self) -> str:
        prefix = "chatcmpl" if self.kind == "chat" else "cmpl"
        return f"{prefix}-{self.client_request_id or self.engine_id}"

    @property
    def metrics_class(self) -> str:
        """The SLO-class label before the verifier resolves it."""
        if self.slo_class:
            return self.slo_class
        return CUSTOM_SLO_CLASS if self.tpot_slo_ms is not None else ""

    @cached_property
    def prefix_keys(self) -> tuple[int, ...]:
        """The prompt's prefix keys (adaserve/routing.py): what prefix-affine routing
        matches against the keys each unit reports."""
        if self.messages is not None:
            return routing.message_keys(
                [(f"{m.role}\x00{m.name}", m.content) for m in self.messages]
            )
        if self.prompt_token_ids is not None:
            return routing.token_keys(self.prompt_token_ids)
        return routing.text_keys(self.prompt_text or "")

    def route_request(self) -> routing.RouteRequest:
        """What routing knows of this request before a unit tokenizes it: the prompt's
        length is estimated at 4 characters a token (the gateway holds no tokenizer)."""
        if self.prompt_token_ids is not None:
            tokens = len(self.prompt_token_ids)
        elif self.messages is not None:
            tokens = sum(len(m.content) for m in self.messages) // 4
        else:
            tokens = len(self.prompt_text or "") // 4
        return routing.RouteRequest(self.ttft_slo_ms, tokens, self.prefix_keys)

    def to_pb(self) -> vpb.GenerateRequest:
        sampling = vpb.SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_tokens=self.max_tokens,
            stop=list(self.stop),
            stop_token_ids=list(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
        )
        if self.seed is not None:
            sampling.seed = self.seed
        req = vpb.GenerateRequest(
            request_id=self.engine_id,
            sampling=sampling,
            tpot_slo_ms=self.tpot_slo_ms or 0.0,
            ttft_slo_ms=self.ttft_slo_ms or 0.0,
            slo_class=self.slo_class or "",
            priority=self.priority,
            timeout_s=self.timeout_s or 0.0,
            client_request_id=self.client_request_id or "",
            speculation_method=speculation_method_to_pb(self.speculation),
            prefix_keys=self.prefix_keys,
        )
        if self.messages is not None:
            req.chat.add_generation_prompt = self.add_generation_prompt
            for m in self.messages:
                req.chat.messages.add(role=m.role, content=m.content, name=m.name)
        elif self.prompt_token_ids is not None:
            req.token_ids.ids.extend(self.prompt_token_ids)
        else:
            req.text = self.prompt_text or ""
        return req


def parse_slo_header(headers: Mapping[str, str], name: str = SLO_HEADER) -> float | None:
    raw = headers.get(name)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= 3_600_000):
        raise bad_request(
            f"header {name} must be a number of milliseconds in (0, 3600000], got {raw!r}",
            param=name,
        )
    return value


def header_request_id(headers: Mapping[str, str]) -> str | None:
    raw = headers.get(REQUEST_ID_HEADER)
    if raw is None:
        return None
    if not REQUEST_ID_RE.match(raw):
        raise bad_request(
            "X-Request-Id must be 1-128 characters of [A-Za-z0-9._:-]", param=REQUEST_ID_HEADER
        )
    return raw


def check_slo_class(name: str | None, known: set[str]) -> None:
    if name is not None and name not in known:
        raise bad_request(
            f"unknown slo_class {name!r}; known classes: {', '.join(sorted(known))}",
            param="slo_class",
            code="unknown_slo_class",
        )


def _check_limits(
    settings: Settings, *, max_tokens: int | None, n: int, stops: list[str], prompt_chars: int
) -> None:
    lim = settings.gateway
    if max_tokens is not None and max_tokens > lim.max_tokens_limit:
        raise bad_request(
            f"max_tokens must be at most {lim.max_tokens_limit}, got {max_tokens}",
            param="max_tokens",
        )
    if n > lim.max_n:
        raise bad_request(f"n must be at most {lim.max_n}, got {n}", param="n")
    if len(stops) > lim.max_stop_strings:
        raise bad_request(
            f"at most {lim.max_stop_strings} stop strings are supported, got {len(stops)}",
            param="stop",
        )
    if prompt_chars > lim.max_prompt_chars:
        raise bad_request(
            f"prompt is {prompt_chars} characters; the limit is {lim.max_prompt_chars}",
            param="prompt",
            code="prompt_too_long",
        )


def _common(
    body: CompletionRequest | ChatCompletionRequest,
    headers: Mapping[str, str],
    known_classes: set[str],
) -> dict:
    check_slo_class(body.slo_class, known_classes)
    tpot = body.tpot_slo_ms
    if tpot is None and body.slo_class is None:
        tpot = parse_slo_header(headers)
    # TTFT: the body field, else the header, else the class's own (resolved by the unit).
    ttft = body.ttft_slo_ms
    if ttft is None:
        ttft = parse_slo_header(headers, TTFT_HEADER)
    return dict(
        model=body.model,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=max(0, body.top_k or 0),
        seed=body.seed,
        stop=tuple(body.stop or ()),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        tpot_slo_ms=tpot,
        ttft_slo_ms=ttft,
        slo_class=body.slo_class,
        priority=body.priority,
        timeout_s=body.timeout,
        client_request_id=body.request_id or header_request_id(headers),
        speculation=body.speculation.method if body.speculation else None,
    )


def from_completion(
    body: CompletionRequest, settings: Settings, headers: Mapping[str, str], known: set[str]
) -> GenerateSpec:
    prompt = body.prompt
    _check_limits(
        settings,
        max_tokens=body.max_tokens,
        n=body.n,
        stops=body.stop or [],
        prompt_chars=len(prompt),
    )
    if isinstance(prompt, str):
        text, ids = prompt, None
    else:
        text, ids = None, tuple(prompt)
    return GenerateSpec(
        kind="completion",
        prompt_text=text,
        prompt_token_ids=ids,
        max_tokens=body.max_tokens or COMPLETION_DEFAULT_MAX_TOKENS,
        **_common(body, headers, known),
    )


def from_chat(
    body: ChatCompletionRequest, settings: Settings, headers: Mapping[str, str], known: set[str]
) -> GenerateSpec:
    messages = tuple(
        # "developer" is OpenAI's newer name for the system role; templates know "system".
        Message("system" if m.role == "developer" else m.role, m.text, m.name or "")
        for m in body.messages
    )
    limit = body.token_limit
    _check_limits(
        settings,
        max_tokens=limit,
        n=body.n,
        stops=body.stop or [],
        prompt_chars=sum(len(m.content) for m in messages),
    )
    return GenerateSpec(
        kind="chat",
        messages=messages,
        add_generation_prompt=body.add_generation_prompt,
        max_tokens=limit or 0,
        **_common(body, headers, known),
    )
