"""Chat templates in the tool-calling formats of the model families adaserve supports,
for the tiny test tokenizer (written for the tests: the families' own templates are not
available offline). Each renders a `tools` variable, assistant `tool_calls` and `tool`
messages the way its family does:

- QWEN_LIKE (Qwen2.5, Hermes format): tools in `<tools>` in the system turn; calls as
  `<tool_call>` JSON; results as `<tool_response>` in a user turn.
- LLAMA_LIKE (Llama 3.1 JSON tool calling): "Environment: ipython"; a call is a JSON
  object with name and parameters; results in an ipython turn.
- MISTRAL_LIKE: `[AVAILABLE_TOOLS]`, `[TOOL_CALLS]` with a JSON array, `[TOOL_RESULTS]`.

The plain ChatML template of `tests/_serving.py` knows no tools, like SmolLM2's.
"""

QWEN_LIKE = (
    "{%- if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions.\n\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n\n"
    "For each call return <tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% elif messages[0]['role'] == 'system' %}<|im_start|>system\n"
    "{{ messages[0]['content'] }}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' %}"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant\n"
    "{% if m.content %}{{ m.content }}{% endif %}"
    "{% for c in m.tool_calls or [] %}\n<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n'
    "</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

LLAMA_LIKE = (
    "{%- if tools %}<|im_start|>system\nEnvironment: ipython\n"
    'To call a function respond with JSON {"name": function name, "parameters": '
    "arguments}. Functions:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{% for c in m.tool_calls %}"
    '{"name": "{{ c.function.name }}", "parameters": {{ c.function.arguments | tojson }}}'
    "{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>ipython\n{{ m.content }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

MISTRAL_LIKE = (
    "{%- set ns = namespace(shown=false) %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}"
    "{% if tools and not ns.shown %}[AVAILABLE_TOOLS]{{ tools | tojson }}"
    "[/AVAILABLE_TOOLS]{% set ns.shown = true %}{% endif %}[INST]{{ m.content }}[/INST]"
    "{%- elif m.role == 'assistant' and m.tool_calls %}[TOOL_CALLS]["
    "{% for c in m.tool_calls %}"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}'
    "{% if not loop.last %}, {% endif %}{% endfor %}]<|im_end|>"
    "{%- elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]"
    "{%- elif m.role == 'assistant' %}{{ m.content }}<|im_end|>"
    "{%- else %}{{ m.content }}\n"
    "{%- endif %}{%- endfor %}"
)
