#!/usr/bin/env python3
"""Record how HF transformers renders chat templates (its Jinja2 environment: trim_blocks,
lstrip_blocks, loop controls, raise_exception, tojson) for tests/models/test_chat_template.cpp.

Writes tests/fixtures/chat_templates/cases.json: for each case its template, the context it is
rendered with and HF's rendering. The templates are those of the families kvlens reads (LLaVA-1.5
and LLaVA-NeXT processors, Llama-3, ChatML as Qwen2 writes it, a Qwen2-VL-style one counting
images in a namespace) and one that walks through the rest of the Jinja2 subset.

Usage: python3 tests/make_chat_template_fixtures.py
"""

import json
import os

import transformers
from transformers.utils.chat_template_utils import _compile_jinja_template

LLAVA = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}{% endif %}"
    "{# Render all images first #}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\\n' }}{% endfor %}{# Render all text next #}{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' '}}"
    "{% endfor %}{% else %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")

LLAVA_NEXT_MISTRAL = (
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{ '<<SYS>>\\n' + message['content'][0]['text'] + '\\n<</SYS>>\\n\\n' }}"
    "{% elif message['role'] == 'user' %}{{ '[INST] ' }}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] }}{% endfor %}"
    "{{' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + '</s>' }}"
    "{% endfor %}{% else %}{{ raise_exception('Only user, assistant and system roles are supported!') }}{% endif %}"
    "{% endfor %}")

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim"
    " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

QWEN2_VL_STYLE = """{% set image_count = namespace(value=0) %}
{%- for message in messages -%}
    {%- if loop.first and message['role'] != 'system' -%}
<|im_start|>system
You are a helpful assistant.<|im_end|>
    {% endif %}
<|im_start|>{{ message['role'] }}
    {% if message['content'] is string %}
{{ message['content'] }}<|im_end|>
    {% else %}
        {% for content in message['content'] %}
            {% if content['type'] == 'image' or 'image' in content %}
                {% set image_count.value = image_count.value + 1 %}
                {%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}
<|vision_start|><|image_pad|><|vision_end|>
            {%- elif content['type'] == 'text' or 'text' in content -%}
{{ content['text'] }}
            {%- endif %}
        {% endfor %}<|im_end|>
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WALK = """{#- a walk through the subset -#}
{% set ns = namespace(n=0, names=[]) %}
{%- for m in messages if false is false %}{% endfor %}
{% for k, v in {'b': 2, 'a': 1}.items() %}{{ k }}={{ v }}{{ ',' if not loop.last }}{% endfor %}
{{ messages | length }} {{ messages[-1]['role'] }} {{ (messages | first).role }} {{ messages[::-1][0].role }}
{{ 'a-b-c'.split('-') | join('+') }} {{ ' pad '.strip() ~ '|' }} {{ 'Title me'.title() }} {{ 'x' * 3 }}
{{ 7 // 2 }} {{ 7 % 3 }} {{ -7 % 3 }} {{ 2 ** 10 }} {{ 3 / 2 }} {{ 1.0 }} {{ none }} {{ true }} {{ [1, 'a'] }}
{{ {'k': [1, 2]} | tojson }} {{ {'k': 'é'} | tojson(indent=2) }}
{% if undefined_thing is defined %}no{% elif tools is not none and tools | length > 1 %}tools{% else %}else{% endif %}
{% for i in range(5) %}{% if i == 1 %}{% continue %}{% endif %}{% if i == 3 %}{% break %}{% endif %}{{ i }}{% endfor %}
{% for x in [] %}never{% else %}empty{% endfor %}
{%- for m in messages %}
  {%- set ns.n = ns.n + (m['content'] | length) %}
  {%- set ns.names = ns.names + [m.role] %}
{%- endfor %}
{{ ns.n }} {{ ns.names }} {{ 'user' in ns.names }} {{ 'tool' not in ns.names }} {{ 'ell' in 'hello' }}
{{ messages | selectattr('role', 'equalto', 'user') | map(attribute='content') | list | length }}
{{ messages | rejectattr('role', 'equalto', 'user') | list | length }} {{ d.get('x', 'dflt') }} {{ d.get('y') }}
{{ missing | default('fallback') }} {{ '' | default('empty', true) }} {{ 'abc'[1] }} {{ 'abcdef'[1:4] }}
{{ 'yes' if 1 < 2 <= 2 else 'no' }} {{ 'Start'.startswith('St') and 'End'.endswith('nd') }}
{%+ if true %}  kept indentation{% endif %}
    {% if true -%}
  stripped right
    {%- endif %}
{{ '%s' ~ 5 }} {{ 'a' ~ none }}
"""

MESSAGES_TEXT = [{"role": "user", "content": "  What is in the picture?  "}]
MESSAGES_IMAGE = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the image."}]}]
MESSAGES_TURNS = [
    {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]},
    {"role": "user", "content": [{"type": "text", "text": "And its colour?"}]},
]

CASES = [
    ("llava_image", LLAVA, {"messages": MESSAGES_IMAGE, "add_generation_prompt": True}),
    ("llava_turns", LLAVA, {"messages": MESSAGES_TURNS[1:], "add_generation_prompt": True}),
    ("llava_next_mistral_image", LLAVA_NEXT_MISTRAL, {"messages": MESSAGES_IMAGE, "add_generation_prompt": True}),
    ("llava_next_mistral_turns", LLAVA_NEXT_MISTRAL, {"messages": MESSAGES_TURNS, "add_generation_prompt": False}),
    ("llama3_text", LLAMA3, {"messages": MESSAGES_TEXT, "add_generation_prompt": True, "bos_token": "<|begin_of_text|>"}),
    ("llama3_no_prompt", LLAMA3, {"messages": MESSAGES_TEXT, "add_generation_prompt": False,
                                  "bos_token": "<|begin_of_text|>"}),
    ("chatml_text", CHATML, {"messages": MESSAGES_TEXT, "add_generation_prompt": True}),
    ("qwen2_vl_image", QWEN2_VL_STYLE, {"messages": MESSAGES_IMAGE, "add_generation_prompt": True}),
    ("qwen2_vl_ids", QWEN2_VL_STYLE, {"messages": MESSAGES_TURNS[1:2] * 2, "add_generation_prompt": True,
                                      "add_vision_id": True}),
    ("qwen2_vl_text", QWEN2_VL_STYLE, {"messages": MESSAGES_TEXT, "add_generation_prompt": False}),
    ("walk", WALK, {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
                    "tools": [1, 2], "d": {"x": 1}}),
]

ERRORS = [
    ("raise", LLAVA_NEXT_MISTRAL, {"messages": [{"role": "tool", "content": []}]},
     "Only user, assistant and system roles are supported!"),
]


def main():
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "chat_templates", "cases.json")
    cases = []
    for name, tmpl, ctx in CASES:
        rendered = _compile_jinja_template(tmpl).render(**ctx)
        cases.append({"name": name, "template": tmpl, "context": ctx, "rendered": rendered})
        print("%-26s %4d chars" % (name, len(rendered)))
    errors = []
    for name, tmpl, ctx, must in ERRORS:
        try:
            _compile_jinja_template(tmpl).render(**ctx)
            raise SystemExit(name + ": rendered without an error")
        except Exception as e:  # noqa: BLE001 - HF's TemplateError carries the message
            assert must in str(e), str(e)
        errors.append({"name": name, "template": tmpl, "context": ctx, "message": must})
    with open(out, "w") as f:
        json.dump({"transformers_version": transformers.__version__, "cases": cases, "errors": errors}, f, indent=1,
                  ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    main()
