"""Tool-calling fixtures for the tiny models: a chat template that takes tools (as Qwen's does, in
Hermes' format) and a few functions whose arguments a random model fills in a bounded number of
tokens (enums, bounded integers, booleans), so a forced call always ends within its budget.

    tokenizer = tiny_byte_tokenizer(chat_template=TOOLS_TEMPLATE)
"""

from __future__ import annotations

TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% if m['tool_calls'] %}{% for c in m['tool_calls'] %}<tool_call>\n"
    '{"name": "{{ c["function"]["name"] }}", "arguments": {{ c["function"]["arguments"] | tojson }}}\n'
    "</tool_call>{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Oslo", "Lima"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
LIGHTS = {
    "type": "object",
    "properties": {"on": {"type": "boolean"}, "room": {"enum": ["hall", "den"]}},
    "required": ["on", "room"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The forecast", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "set_lights", "parameters": LIGHTS}},
]
SCHEMAS = {"get_weather": WEATHER, "set_lights": LIGHTS}
