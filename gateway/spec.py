"""One generation request as the gateway forwards it, whichever front it came from.

The REST and gRPC fronts both build a `GenerateSpec`; settings-dependent checks
(limits, SLO header, defaults) happen once, here, and `to_pb` is the only place that
knows the verifier's wire format.
"""

from __future__ import annotations

import json
import logging
import math
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal

from adaserve import routing
from adaserve.config import Settings
from adaserve.rpc.v1 import verifier_pb2 as vpb
from gateway.errors import bad_request
from gateway.openai_schemas import (
    MAX_TOP_LOGPROBS,
    REQUEST_ID_RE,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    TokenizeRequest,
    unknown_fields,
)
from gateway.tools import ToolPlan
from gateway.tools import plan as tool_plan
from services.common.convert import speculation_method_to_pb

log = logging.getLogger(__name__)

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
    tool_call_id: str = ""  # a tool message: the call it answers
    tool_calls: tuple[tuple[str, str, str], ...] = ()  # assistant: (id, name, arguments)


@dataclass(frozen=True)
class Structured:
    """A grammar the output must match, as the verifier's wire names it."""

    kind: Literal["json_schema", "json_object", "regex", "choice", "grammar"]
    value: str | tuple[str, ...] = ""  # schema JSON text, pattern, grammar, or choices
    field: str = "response_format"  # the request field, for the unit's error messages

    def to_pb(self) -> vpb.StructuredOutput:
        out = vpb.StructuredOutput(field=self.field)
        if self.kind == "json_object":
            out.json_object = True
        elif self.kind == "choice":
            out.choice.choices.extend(self.value)
        else:
            setattr(out, self.kind, self.value)
        return out


@dataclass(frozen=True)
class GenerateSpec:
    kind: Literal["completion", "chat"]
    model: str | None
    prompt_text: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    messages: tuple[Message, ...] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
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
    n: int = 1  # sequences the unit generates for this prompt
    echo: bool = False  # completions: the prompt's text before the output
    logprobs: int | None = None  # None: none; k: each token's logprob and the top k
    # What the unit scores the prompt with (top k; None: not at all): the larger of
    # vLLM's prompt_logprobs and, with echo, logprobs.
    prompt_logprobs: int | None = None
    prompt_logprobs_field: int | None = None  # vLLM's prompt_logprobs as asked (the field)
    echo_only: bool = False  # completions' max_tokens 0 with echo: generate 1, show none
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = 0.0
    min_tokens: int = 0
    bad_words: tuple[str, ...] = ()
    allowed_token_ids: tuple[int, ...] = ()
    structured: Structured | None = None
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: "token_id:N" strings
    tools: ToolPlan | None = None  # chat: the tools, and what tool_choice asks
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
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=dict(self.logit_bias),
            min_p=self.min_p,
            min_tokens=self.min_tokens,
            bad_words=list(self.bad_words),
            allowed_token_ids=list(self.allowed_token_ids),
        )
        if self.seed is not None:
            sampling.seed = self.seed
        if self.logprobs is not None:
            sampling.logprobs = self.logprobs
        if self.prompt_logprobs is not None:
            sampling.prompt_logprobs = self.prompt_logprobs
        if self.structured is not None:
            sampling.structured_output.CopyFrom(self.structured.to_pb())
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
            n=self.n,
            echo=self.echo,
            prefix_keys=self.prefix_keys,
        )
        if self.messages is not None:
            req.chat.add_generation_prompt = self.add_generation_prompt
            req.chat.continue_final_message = self.continue_final_message
            if self.tools is not None:
                req.chat.tools_json = self.tools.tools_json
            for m in self.messages:
                msg = req.chat.messages.add(
                    role=m.role, content=m.content, name=m.name, tool_call_id=m.tool_call_id
                )
                for cid, name, arguments in m.tool_calls:
                    msg.tool_calls.add(id=cid, name=name, arguments=arguments)
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


def check_fields(body: Any, settings: Settings) -> None:
    """No silent drops: a known feature adaserve does not offer is refused naming it,
    and so is an unknown field under `gateway.unknown_fields: reject`."""
    refused = body.refusal()
    if refused is not None:
        name, why = refused
        raise bad_request(f"{name}: {why}", param=name, code="unsupported")
    check_unknown(body, settings)


def check_unknown(body: Any, settings: Settings) -> None:
    """Fields no schema here knows: under `gateway.unknown_fields: reject` a 400 naming
    the first (OpenAI's answer); under `ignore` a warning in the gateway's log naming
    them all (vLLM's), so an operator sees what a client sent that changed nothing."""
    unknown = unknown_fields(body)
    if not unknown:
        return
    if settings.gateway.unknown_fields == "reject":
        raise bad_request(
            f"unknown field {unknown[0]!r} (gateway.unknown_fields is reject)",
            param=unknown[0],
            code="unknown_field",
        )
    log.warning(
        "request fields ignored (no schema adaserve knows has them): %s", ", ".join(unknown)
    )


def _structured(body: CompletionRequest | ChatCompletionRequest) -> Structured | None:
    """The one grammar the request asks for (OpenAI's response_format, vLLM's
    guided_* fields or structured_outputs), or None."""
    found: list[Structured] = []
    if body.response_format is not None:
        rf, at = body.response_format, "response_format"
        if rf.type == "regex" and isinstance(rf.value, str):
            found.append(Structured("regex", rf.value, at))
        elif rf.type in ("json", "json_object") and rf.value is not None:
            found.append(Structured("json_schema", _schema_text(rf.value, f"{at}.value"), at))
        elif rf.type == "json_object":
            found.append(Structured("json_object", field=at))
        elif rf.type == "json_schema" and rf.json_schema is not None:
            found.append(Structured("json_schema", json.dumps(rf.json_schema.schema_), at))
    if body.guided_json is not None:
        found.append(
            Structured("json_schema", _schema_text(body.guided_json, "guided_json"), "guided_json")
        )
    if body.guided_regex is not None:
        found.append(Structured("regex", body.guided_regex, "guided_regex"))
    if body.guided_choice is not None:
        found.append(Structured("choice", tuple(body.guided_choice), "guided_choice"))
    if body.guided_grammar is not None:
        found.append(Structured("grammar", body.guided_grammar, "guided_grammar"))
    so = body.structured_outputs
    if so is not None:
        at = "structured_outputs"
        if so.json_ is not None:
            found.append(Structured("json_schema", _schema_text(so.json_, f"{at}.json"), at))
        if so.regex is not None:
            found.append(Structured("regex", so.regex, at))
        if so.choice is not None:
            if not so.choice or not all(so.choice):
                raise bad_request(f"{at}.choice: needs non-empty strings", param=f"{at}.choice")
            found.append(Structured("choice", tuple(so.choice), at))
        if so.grammar is not None:
            found.append(Structured("grammar", so.grammar, at))
        if so.json_object:
            found.append(Structured("json_object", field=at))
    if len(found) > 1:
        names = ", ".join(sorted({s.field for s in found}))
        raise bad_request(
            f"only one structured output may be asked for, got {names}", param=found[1].field
        )
    return found[0] if found else None


def _schema_text(schema: dict[str, Any] | str, name: str) -> str:
    if isinstance(schema, dict):
        return json.dumps(schema)
    try:
        parsed = json.loads(schema)
    except ValueError:
        raise bad_request(f"{name}: not valid JSON", param=name) from None
    if not isinstance(parsed, dict | bool):
        raise bad_request(f"{name}: a JSON schema is an object", param=name)
    return schema


def _check_limits(
    settings: Settings,
    *,
    max_tokens: int | None,
    n: int,
    stops: list[str],
    prompt_chars: int,
    n_field: str = "n",
) -> None:
    lim = settings.gateway
    if max_tokens is not None and max_tokens > lim.max_tokens_limit:
        raise bad_request(
            f"max_tokens must be at most {lim.max_tokens_limit}, got {max_tokens}",
            param="max_tokens",
        )
    if n > lim.max_n:
        raise bad_request(f"{n_field} must be at most {lim.max_n}, got {n}", param=n_field)
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


def _check_prompt_logprobs(body: CompletionRequest | ChatCompletionRequest) -> None:
    """vLLM's prompt_logprobs: in [0, MAX_TOP_LOGPROBS], and not with stream (as in
    vLLM)."""
    k = body.prompt_logprobs
    if k is None:
        return
    if k < 0:
        raise bad_request(
            f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {k} (-1, the whole "
            "vocabulary, is not supported)",
            param="prompt_logprobs",
        )
    if k > MAX_TOP_LOGPROBS:
        raise bad_request(
            f"prompt_logprobs must be at most {MAX_TOP_LOGPROBS} (the server's max_logprobs), "
            f"got {k}",
            param="prompt_logprobs",
        )
    if body.stream:
        raise bad_request(
            "prompt_logprobs is not available with stream: true (as in vLLM)",
            param="prompt_logprobs",
        )


def _common(
    body: CompletionRequest | ChatCompletionRequest,
    settings: Settings,
    headers: Mapping[str, str],
    known_classes: set[str],
) -> dict:
    check_fields(body, settings)
    _check_prompt_logprobs(body)
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
        n=body.n,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=body.repetition_penalty or 1.0,
        logit_bias=tuple(sorted((int(k), v) for k, v in (body.logit_bias or {}).items())),
        min_p=body.min_p or 0.0,
        min_tokens=body.min_tokens or 0,
        bad_words=tuple(body.bad_words or ()),
        allowed_token_ids=tuple(body.allowed_token_ids or ()),
        structured=_structured(body),
        tokens_as_ids=body.return_tokens_as_token_ids,
        prompt_logprobs=body.prompt_logprobs,
        prompt_logprobs_field=body.prompt_logprobs,
    )


def from_completion(
    body: CompletionRequest, settings: Settings, headers: Mapping[str, str], known: set[str]
) -> list[GenerateSpec]:
    """One spec per prompt (OpenAI's list of prompts), each for n (or best_of)
    sequences; choice i of prompt p is choice p * n + i of the response."""
    prompts: list[Any] = list(body.prompt)
    n = body.best_of or body.n
    _check_limits(
        settings,
        max_tokens=body.max_tokens,
        n=n,
        stops=body.stop or [],
        prompt_chars=sum(len(p) for p in prompts),
        n_field="best_of" if body.best_of else "n",
    )
    lim = settings.gateway
    if len(prompts) > lim.max_prompts:
        raise bad_request(
            f"at most {lim.max_prompts} prompts per request, got {len(prompts)}", param="prompt"
        )
    if body.best_of is not None and body.best_of > body.n and body.stream:
        raise bad_request("best_of > n cannot be streamed (as in OpenAI)", param="best_of")
    common = _common(body, settings, headers, known)
    # best_of: rank best_of sequences by their cumulative logprob, so ask for them.
    logprobs = body.logprobs
    if body.best_of is not None and body.best_of > body.n and logprobs is None:
        logprobs = 0
    # echo with logprobs: the echoed prompt's tokens come with theirs (OpenAI, vLLM).
    wanted = [
        k for k in (body.prompt_logprobs, body.logprobs if body.echo else None) if k is not None
    ]
    common |= {
        "n": n,
        "logprobs": logprobs,
        "echo": body.echo,
        "prompt_logprobs": max(wanted) if wanted else None,
    }
    echo_only = body.max_tokens == 0
    specs = []
    for prompt in prompts:
        text, ids = (prompt, None) if isinstance(prompt, str) else (None, tuple(prompt))
        specs.append(
            GenerateSpec(
                kind="completion",
                prompt_text=text,
                prompt_token_ids=ids,
                # echo_only: one token is generated (the prefill computes its row anyway)
                # and not shown.
                max_tokens=1 if echo_only else body.max_tokens or COMPLETION_DEFAULT_MAX_TOKENS,
                echo_only=echo_only,
                **common,
            )
        )
    return specs


def chat_messages(messages: list[ChatMessage]) -> tuple[Message, ...]:
    # "developer" is OpenAI's newer name for the system role; templates know "system".
    return tuple(
        Message(
            "system" if m.role == "developer" else m.role,
            m.text,
            m.name or "",
            m.tool_call_id or "",
            tuple((c.id, c.function.name, c.function.arguments) for c in m.tool_calls or ()),
        )
        for m in messages
    )


def from_chat(
    body: ChatCompletionRequest, settings: Settings, headers: Mapping[str, str], known: set[str]
) -> GenerateSpec:
    messages = chat_messages(body.messages)
    limit = body.token_limit
    _check_limits(
        settings,
        max_tokens=limit,
        n=body.n,
        stops=body.stop or [],
        prompt_chars=sum(len(m.content) for m in messages),
    )
    common = _common(body, settings, headers, known)
    common["logprobs"] = (body.top_logprobs or 0) if body.logprobs else None
    common["tools"] = tools = tool_plan(body)
    schema = tools.schema() if tools is not None else None
    if schema is not None:  # a required or named call: grammar-constrained
        if common["structured"] is not None:
            raise bad_request(
                f"tool_choice {tools.mode} cannot be combined with {common['structured'].field}",
                param="tool_choice",
            )
        common["structured"] = Structured("json_schema", json.dumps(schema), "tool_choice")
    return GenerateSpec(
        kind="chat",
        messages=messages,
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        max_tokens=limit or 0,
        **common,
    )


def tokenize_pb(body: TokenizeRequest) -> vpb.TokenizeRequest:
    """vLLM's /tokenize body as the unit's Tokenize request."""
    if body.messages is not None:
        req = vpb.TokenizeRequest()
        req.chat.add_generation_prompt = body.add_generation_prompt
        for m in chat_messages(body.messages):
            req.chat.messages.add(role=m.role, content=m.content, name=m.name)
        return req
    return vpb.TokenizeRequest(text=body.prompt or "", add_special_tokens=body.add_special_tokens)
