"""Chat templates that offer tools (Hermes-style `<tool_call>` and Llama 3 JSON calls), and
copies of the tiny checkpoints that use one (a longer context: tools' JSON takes many of the
tiny tokenizer's tokens)."""

from __future__ import annotations

import json
import shutil

HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
Tools:{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
Call one as <tool_call>
{"name": ..., "arguments": ...}
</tool_call><|im_end|>
{% endif %}{%- for message in messages %}{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
LLAMA3_TEMPLATE = """{%- if tools %}<|im_start|>system
Respond with {"name": function name, "parameters": dictionary}. Tools:{% for t in tools %} {{ t | tojson }}{% endfor %}<|im_end|>
{% endif %}{%- for message in messages %}{%- if message.tool_calls %}<|im_start|>assistant
{% for call in message.tool_calls %}{"name": "{{ call.function.name }}", "parameters": {{ call.function.arguments | tojson }}}{% endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>ipython
{{ message.content }}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def with_template(tiny_dir, tmp_path_factory, template: str, name: str):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp(name)
    dirs = {}
    for model in ("llama", "draft_llama"):
        dirs[model] = root / model
        shutil.copytree(tiny_dir[model], dirs[model])
        tok = AutoTokenizer.from_pretrained(dirs[model])
        tok.chat_template = template
        tok.save_pretrained(dirs[model])
        config = json.loads((dirs[model] / "config.json").read_text())
        config["max_position_embeddings"] = 2048  # tools' JSON takes many of the tiny tokenizer's tokens
        (dirs[model] / "config.json").write_text(json.dumps(config))
    return dirs
