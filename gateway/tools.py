"""OpenAI tools at the API edge: what `tool_choice` asks of the output, and the tool
calls in the text a model writes, whole or streamed.

- `none`: the model sees the tools and answers in text; nothing is parsed.
- `auto`: the model answers as it likes; text in its family's tool-call format (the
  unit's `tool_call_format`: Hermes `<tool_call>` JSON, Llama 3.1's JSON object,
  Mistral's `[TOOL_CALLS]` array) becomes `tool_calls`, the rest stays content.
- `required` / a named function: the output is grammar-constrained (structured output,
  so exact under speculation) to the call itself, as vLLM does: a JSON array of
  `{"name", "parameters"}` objects (exactly one without `parallel_tool_calls`), or the
  named function's arguments object. An array cut by the length limit keeps its
  complete calls (finish_reason stays "length").
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from gateway.openai_schemas import ChatCompletionRequest, NamedToolChoice

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
# Text that may begin a tool call, per format: held back while it could still be one.
_MARKERS = {"hermes": ("<tool_call>",), "mistral": ("[TOOL_CALLS]",), "llama3_json": ()}


@dataclass(frozen=True)
class ToolPlan:
    mode: Literal["none", "auto", "required", "named"]
    tools_json: str  # OpenAI's tools array, for the chat template
    names: tuple[str, ...]
    parameters: tuple[dict[str, Any], ...]  # each tool's parameters schema
    name: str | None = None  # mode "named"
    parallel: bool = True

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema the output must match (required / named), else None."""
        if self.mode == "named":
            return self.parameters[self.names.index(self.name or "")]
        if self.mode != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": n}, "parameters": p},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for n, p in zip(self.names, self.parameters, strict=True)
        ]
        schema: dict[str, Any] = {
            "type": "array",
            "minItems": 1,
            "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
        }
        if not self.parallel:
            schema["maxItems"] = 1
        return schema


def plan(body: ChatCompletionRequest) -> ToolPlan | None:
    if not body.tools:
        return None
    choice = body.tool_choice or "auto"
    names = tuple(t.function.name for t in body.tools)
    params = tuple(t.function.parameters or {"type": "object"} for t in body.tools)
    tools_json = json.dumps([t.model_dump(by_alias=True, exclude_none=True) for t in body.tools])
    if isinstance(choice, NamedToolChoice):
        return ToolPlan("named", tools_json, names, params, choice.function.name)
    return ToolPlan(choice, tools_json, names, params, parallel=body.parallel_tool_calls)


def new_call(name: str, arguments: str) -> dict[str, Any]:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def parse(text: str, tp: ToolPlan, fmt: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of a whole output."""
    if tp.mode == "named":  # the output is the arguments object (maybe cut by length)
        return None, [new_call(tp.name or "", text.strip())]
    if tp.mode == "required":
        value = _json(text)
        # Cut by the length limit: the calls completed before the cut are kept (the
        # finish reason, "length", says the output was cut), as vLLM's streamed parser
        # does; the grammar makes every element that ended a valid call.
        calls = _objects(value if value is not None else _complete_elements(text), tp)
        return (None, calls) if calls else (text, [])
    if tp.mode == "none":
        return text, []
    content, calls = _auto(text, tp, fmt)
    if not tp.parallel:
        calls = calls[:1]
    return content, calls


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _complete_elements(text: str) -> list[Any] | None:
    """The complete elements at the start of a JSON array cut short, or None when the
    text does not start one."""
    body = text.lstrip()
    if not body.startswith("["):
        return None
    decoder = json.JSONDecoder()
    out: list[Any] = []
    at = 1
    while True:
        while at < len(body) and body[at] in " \t\r\n,":
            at += 1
        try:
            value, at = decoder.raw_decode(body, at)
        except ValueError:
            return out
        out.append(value)


def _objects(value: Any, tp: ToolPlan) -> list[dict[str, Any]]:
    """Calls from parsed JSON: an object or a list of them, each naming a known tool
    with its arguments under "arguments" or "parameters"."""
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in tp.names:
            return []
        args = item.get("arguments", item.get("parameters", {}))
        calls.append(new_call(item["name"], args if isinstance(args, str) else json.dumps(args)))
    return calls


def _auto(text: str, tp: ToolPlan, fmt: str) -> tuple[str | None, list[dict[str, Any]]]:
    if fmt == "mistral":
        at = text.find("[TOOL_CALLS]")
        body = text[at + len("[TOOL_CALLS]") :] if at >= 0 else text
        if at >= 0 or body.lstrip().startswith("[{"):
            calls = _objects(_json(body.strip()), tp)
            if calls:
                return (text[:at].strip() or None) if at > 0 else None, calls
        return text, []
    if fmt == "llama3_json":
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if body.startswith("{"):
            parts = [_json(p) for p in body.split(";")] if ";" in body else [_json(body)]
            calls = [c for p in parts for c in _objects(p, tp)]
            if calls and len(calls) == len(parts):
                return None, calls
        return text, []
    found = list(_HERMES.finditer(text))
    if not found:
        return text, []
    calls = [c for m in found for c in _objects(_json(m.group(1)), tp)]
    if len(calls) != len(found):
        return text, []
    return text[: found[0].start()].strip() or None, calls


class ToolStream:
    """One streamed choice's text split into content to release now and, at the end,
    its tool calls. Text that may begin a call is held back until it is clearly not
    one; from a call's start on, everything waits for the end of the output."""

    def __init__(self, tp: ToolPlan, fmt: str) -> None:
        self.tp = tp
        self.fmt = fmt
        self.held = ""  # text not released yet
        self.released = False  # any content released
        self.capturing = tp.mode in ("named", "required")

    def feed(self, text: str) -> str:
        if self.tp.mode == "none":
            return text
        self.held += text
        if self.capturing:
            return ""
        if self.fmt == "llama3_json" or (self.fmt == "mistral" and not self.released):
            # A call is the whole output: decided by its first non-blank characters.
            start = self.held.lstrip()
            if not start:
                return ""
            if not self.released and (start[0] in "{[" or start.startswith("<|python_tag|>")):
                self.capturing = True
                return ""
            if self.fmt == "llama3_json":
                return self._release(len(self.held))
        for marker in _MARKERS[self.fmt]:
            at = self.held.find(marker)
            if at >= 0:
                out = self._release(at)
                self.capturing = True
                return out
        keep = max(
            (k for m in _MARKERS[self.fmt] for k in range(1, len(m)) if self.held.endswith(m[:k])),
            default=0,
        )
        return self._release(len(self.held) - keep)

    def _release(self, upto: int) -> str:
        out, self.held = self.held[:upto], self.held[upto:]
        self.released |= bool(out)
        return out

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """(content still to release, tool calls) once the output ended."""
        if not self.capturing:
            return self._release(len(self.held)), []
        content, calls = parse(self.held, self.tp, self.fmt)
        self.held = ""
        return content or "", calls
