"""Chat prompts: messages (with tool calls and tool results) and tools through the
target's chat template, and the tool-call format its model writes.

A template that knows tools (Qwen2.5's, Llama 3.1's, Mistral's: it reads a `tools`
variable) gets them as Hugging Face passes them, and assistant tool calls with their
arguments as objects. A template that does not (SmolLM2's plain ChatML) gets the tools
described in a system message, in the Hermes format Qwen2.5 also uses: calls inside
`<tool_call>` tags, results inside `<tool_response>` tags in a user turn, so any
template renders them and roles still alternate.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

_FALLBACK_SYSTEM = (
    "You may call functions to help with the user's request. The functions are:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call a function, answer with one line per call, each\n"
    '<tool_call>\n{{"name": <function name>, "arguments": <arguments object>}}\n</tool_call>'
)


def template_of(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    return template if isinstance(template, str) else json.dumps(template)


def knows_tools(tokenizer: Any) -> bool:
    """Whether the chat template renders a `tools` variable itself."""
    return "tools" in template_of(tokenizer)


def tool_call_format(tokenizer: Any) -> str:
    """The tool-call format of the template's model family: "hermes", "llama3_json" or
    "mistral" (InfoResponse.tool_call_format; the gateway parses them). Hermes (Qwen2.5's)
    for a template that knows no tools: the fallback prompt asks for it."""
    template = template_of(tokenizer)
    if not knows_tools(tokenizer):
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "hermes"


def _arguments(raw: str) -> Any:
    """Tool-call arguments as the templates expect them: an object where the JSON text
    is one (they `tojson` it), else the text as sent."""
    try:
        value = json.loads(raw)
    except ValueError:
        return raw
    return value if isinstance(value, dict) else raw


def render(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> list[int]:
    """Token ids of the chat prompt. Messages are OpenAI's, flattened: role, content,
    name, tool_calls (id, function name, arguments as JSON text), tool_call_id."""
    if not template_of(tokenizer):
        raise ValueError("this model has no chat template: use /v1/completions")
    native = knows_tools(tokenizer)
    conv = [_native(m) for m in messages] if native else _fallback(messages, tools)
    kwargs: dict[str, Any] = {"add_generation_prompt": add_generation_prompt}
    if continue_final_message:
        kwargs["continue_final_message"] = True
    if tools and native:
        kwargs["tools"] = tools
    # Render to text, then encode: the same on every transformers version (tokenize=True
    # changed its return type), and the template already holds the special tokens.
    text = tokenizer.apply_chat_template(conv, tokenize=False, **kwargs)
    return list(tokenizer.encode(text, add_special_tokens=False))


def _native(m: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m["role"], "content": m.get("content", "")}
    if m.get("name"):
        out["name"] = m["name"]
    if m.get("tool_calls"):
        out["tool_calls"] = [
            {
                "id": c["id"],
                "type": "function",
                "function": {"name": c["name"], "arguments": _arguments(c["arguments"])},
            }
            for c in m["tool_calls"]
        ]
    if m.get("tool_call_id"):
        out["tool_call_id"] = m["tool_call_id"]
    return out


def hermes_call(name: str, arguments: str) -> str:
    args = _arguments(arguments)
    return f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {json.dumps(args)}}}\n</tool_call>'


def _fallback(
    messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """Tools, calls and results as Hermes-format text in roles every template knows."""
    conv: list[dict[str, Any]] = []
    if tools:
        described = "\n".join(json.dumps(t.get("function", t)) for t in tools)
        system = _FALLBACK_SYSTEM.format(tools=described)
        if messages and messages[0]["role"] == "system":
            system = f"{messages[0].get('content', '')}\n\n{system}"
            messages = messages[1:]
        conv.append({"role": "system", "content": system})
    for m in messages:
        if m["role"] == "tool":
            result = f"<tool_response>\n{m.get('content', '')}\n</tool_response>"
            if conv and conv[-1].get("_tool_results"):  # results of one turn: one message
                conv[-1]["content"] += "\n" + result
            else:
                conv.append({"role": "user", "content": result, "_tool_results": True})
            continue
        content = m.get("content", "") or ""
        if m.get("tool_calls"):
            calls = "\n".join(hermes_call(c["name"], c["arguments"]) for c in m["tool_calls"])
            content = f"{content}\n{calls}" if content else calls
        conv.append({"role": m["role"], "content": content})
    for m in conv:
        m.pop("_tool_results", None)
    return conv
