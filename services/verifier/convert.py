"""The verifier's wire conversions beyond services/common/convert.py's: a request's
chat messages and structured output from the wire, its resolved SLO, and the engine's
TokenDelta and baseline back onto it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from adaserve.calibration import Baseline
from adaserve.chat import render as chat_render
from adaserve.request import StructuredOutput, TokenDelta
from adaserve.rpc.v1 import verifier_pb2 as vpb
from services.common.convert import finish_reason_to_pb


def baseline_to_pb(b: Baseline | None) -> vpb.BaselineInfo | None:
    if b is None:
        return None
    return vpb.BaselineInfo(
        source=b.source,
        measured_at=b.measured_at,
        load_1m=b.load_1m,
        cores=b.cores,
        settled=b.settled,
        recalibrations=b.recalibrations,
    )


def structured_output_from_pb(so: vpb.StructuredOutput) -> StructuredOutput:
    field = so.field or "structured_output"
    which = so.WhichOneof("kind")
    if which == "json_object":
        return StructuredOutput("json_object", field=field)
    if which == "choice":
        return StructuredOutput("choice", json.dumps(list(so.choice.choices)), field=field)
    if which in ("json_schema", "regex", "grammar"):
        return StructuredOutput(which, getattr(so, which), field=field)
    raise ValueError(f"{field}: one of json_schema, json_object, regex, choice or grammar")


def render_chat(tokenizer: Any, chat: vpb.ChatMessages) -> list[int]:
    messages = [
        {
            "role": m.role,
            "content": m.content,
            **({"name": m.name} if m.name else {}),
            **({"tool_call_id": m.tool_call_id} if m.tool_call_id else {}),
            **(
                {
                    "tool_calls": [
                        {"id": c.id, "name": c.name, "arguments": c.arguments} for c in m.tool_calls
                    ]
                }
                if m.tool_calls
                else {}
            ),
        }
        for m in chat.messages
    ]
    tools = None
    if chat.tools_json:
        try:
            tools = json.loads(chat.tools_json)
        except ValueError:
            raise ValueError("tools: not valid JSON") from None
        if not isinstance(tools, list):
            raise ValueError("tools: must be a list")
    return chat_render(
        tokenizer,
        messages,
        tools,
        add_generation_prompt=chat.add_generation_prompt,
        continue_final_message=chat.continue_final_message,
    )


@dataclass(frozen=True)
class ResolvedSLO:
    tpot_ms: float
    ttft_ms: float | None
    name: str  # the metrics class ("custom" for an explicit tpot_slo_ms)


def chunk_to_pb(delta: TokenDelta, slo: ResolvedSLO, server_elapsed_ms: float) -> vpb.GenerateChunk:
    out = vpb.GenerateChunk(
        token_ids=delta.token_ids,
        text=delta.text,
        finish_reason=finish_reason_to_pb(delta.finish_reason),
        num_prompt_tokens=delta.num_prompt_tokens,
        num_generated=delta.num_generated,
        tpot_slo_ms=slo.tpot_ms,
        ttft_slo_ms=slo.ttft_ms or 0.0,
        slo_class=slo.name,
        best_effort=delta.best_effort,
        error=delta.error or "",
        server_elapsed_ms=server_elapsed_ms,
    )
    if delta.ttft_ms is not None:
        out.ttft_ms = delta.ttft_ms
    return out
