"""Chat templates render as transformers renders them (actors/runtime/chat_templates.py), for
the template our checkpoints ship, the gateway's built-in fallback, and templates in the style
of Llama 3 and Qwen (written here, into copies of a checkpoint), read from tokenizer_config.json
or chat_template.jinja: same text, same token ids."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from actorserve.actors.runtime.tokenizer import Tokenizer
from actorserve.gateway.chat_template import FALLBACK_TEMPLATE
from actorserve.weights.checkpoints import CHAT_TEMPLATE, ensure_checkpoint

# Llama 3 style: BOS, header tokens, a dated system turn (strftime_now), `trim`, roles checked
# with raise_exception, a tojson with options.
LLAMA3_STYLE = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = strftime_now("%d %b %Y") %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Today Date: " + date_string + "\\n" }}
{{- {"tool": "none", "note": "é<&>"} | tojson(indent=2, sort_keys=true) + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/...') }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {{- message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# Qwen style: a default system turn, a namespace filled by a reverse scan, string methods,
# loop controls, a {% generation %} block, eos_token.
QWEN_STYLE = """{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_user=messages|length - 1, found=false) %}
{%- for message in messages[::-1] %}
    {%- if not ns.found and message.role == 'user' %}
        {%- set ns.last_user = (messages|length - 1) - loop.index0 %}
        {%- set ns.found = true %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'system' %}
        {%- continue %}
    {%- endif %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'assistant' %}
        {%- if '</think>' in content %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\\n' }}
        {%- generation %}
        {{- content.strip() + '<|im_end|>' }}
        {%- endgeneration %}
        {{- '\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- endif %}
    {%- if loop.index0 > ns.last_user and loop.last %}
        {%- break %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- else %}
    {{- eos_token if messages[-1].role == 'assistant' else '' }}
{%- endif %}
"""

# Block tags on lines of their own, indented, without `-`: what trim_blocks and lstrip_blocks
# change (older templates, Llama 2's and Mistral's among them, are written so).
PLAIN_BLOCKS = """{{ bos_token }}
{% for message in messages %}
    {% if message['role'] == 'system' %}
<<SYS>> {{ message['content'] }} <</SYS>>
    {% else %}
[{{ message['role'] | upper }}] {{ message['content'] }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
[ASSISTANT]
{% endif %}
"""

TEMPLATES = {
    "shipped": CHAT_TEMPLATE,
    "builtin_fallback": FALLBACK_TEMPLATE,
    "llama3_style": LLAMA3_STYLE,
    "qwen_style": QWEN_STYLE,
    "plain_blocks": PLAIN_BLOCKS,
}
LLAMA3_TOKENS = {
    "bos_token": "<|begin_of_text|>",
    "eos_token": "<|eot_id|>",
    "additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>"],
}
QWEN_TOKENS = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
CONFIGS = {
    "shipped": {},
    "builtin_fallback": {},
    "llama3_style": LLAMA3_TOKENS,
    "qwen_style": QWEN_TOKENS,
    "plain_blocks": {},
}
SYSTEM = {"role": "system", "content": "You are terse. Réponds en français 🙂"}
CONVERSATIONS = {
    "one_user_turn": [{"role": "user", "content": "Hi there!"}],
    "system_then_user": [SYSTEM, {"role": "user", "content": "  Why is the sky blue?  \n"}],
    "multi_turn": [
        SYSTEM,
        {"role": "user", "content": "def f(x):\n    return x"},
        {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nIt returns x. 東京"},
        {"role": "user", "content": "And <|im_end|> or <s> in text?", "name": None},
    ],
    "ends_with_assistant": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
    ],
}


def checkpoint_with(tmp_path: Path, template: str, config: dict, jinja_file: bool) -> Path:
    """A copy of tiny-llama's tokenizer with `template` in tokenizer_config.json (or in
    chat_template.jinja, tokenizer_config.json's then a decoy) and `config`'s fields."""
    src = ensure_checkpoint("tiny-llama")
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copyfile(src / name, tmp_path / name)
    tokenizer_config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    tokenizer_config.update(config, chat_template=template)
    if jinja_file:
        (tmp_path / "chat_template.jinja").write_text(template)
        tokenizer_config["chat_template"] = "{{ 'the .jinja file wins' }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return tmp_path


@pytest.fixture(params=[False, True], ids=["in_tokenizer_config", "in_chat_template_jinja"])
def where(request) -> bool:
    return request.param


@pytest.mark.parametrize("template", list(TEMPLATES))
@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_a_chat_renders_and_tokenizes_as_in_transformers(
    tmp_path, where, template, conversation, add_generation_prompt
):
    from transformers import AutoTokenizer

    model_dir = checkpoint_with(tmp_path, TEMPLATES[template], CONFIGS[template], where)
    ours, hf = Tokenizer.from_dir(model_dir), AutoTokenizer.from_pretrained(model_dir)
    messages = CONVERSATIONS[conversation]
    expected = hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    text = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert text == expected
    expected_ids = hf.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, return_dict=False
    )
    assert ours.encode(text, add_special_tokens=False) == expected_ids


def test_a_conversation_the_template_refuses_raises_as_in_transformers(tmp_path):
    from jinja2.exceptions import TemplateError
    from transformers import AutoTokenizer

    model_dir = checkpoint_with(tmp_path, LLAMA3_STYLE, LLAMA3_TOKENS, jinja_file=False)
    out_of_order = [{"role": "assistant", "content": "I speak first"}]
    with pytest.raises(TemplateError, match="roles must alternate") as hf_error:
        AutoTokenizer.from_pretrained(model_dir).apply_chat_template(out_of_order, tokenize=False)
    with pytest.raises(TemplateError) as our_error:
        Tokenizer.from_dir(model_dir).apply_chat_template(out_of_order)
    assert str(our_error.value) == str(hf_error.value)


def test_a_template_cannot_reach_python_internals(tmp_path):
    """The sandbox holds: attribute escapes and namespace dunders are refused, as there."""
    from jinja2.exceptions import SecurityError

    ours = Tokenizer.from_dir(checkpoint_with(tmp_path, CHAT_TEMPLATE, {}, jinja_file=False))
    messages = CONVERSATIONS["one_user_turn"]
    escapes = (
        "{{ messages.__class__.__mro__[1].__subclasses__() }}",
        "{% set ns = namespace() %}{% set ns._x = 1 %}",
        "{{ messages.append(1) }}",
    )
    for escape in escapes:
        with pytest.raises(SecurityError):
            ours.apply_chat_template(messages, chat_template=escape)


def test_named_templates_and_a_processor_template_are_found(tmp_path):
    """additional_chat_templates/NAME.jinja beside chat_template.jinja make a dict by name (a
    chat uses "default"), as in transformers; a processor's chat_template.json serves a
    checkpoint whose tokenizer has none."""
    from transformers import AutoTokenizer

    model_dir = checkpoint_with(tmp_path, CHAT_TEMPLATE, {}, jinja_file=True)
    (model_dir / "additional_chat_templates").mkdir()
    (model_dir / "additional_chat_templates" / "tool_use.jinja").write_text("{{ 'tools' }}")
    ours, hf = Tokenizer.from_dir(model_dir), AutoTokenizer.from_pretrained(model_dir)
    named = {"default": CHAT_TEMPLATE, "tool_use": "{{ 'tools' }}"}
    assert ours.chat_template == hf.chat_template == named
    messages = CONVERSATIONS["multi_turn"]
    assert ours.apply_chat_template(messages) == hf.apply_chat_template(messages, tokenize=False)

    (model_dir / "chat_template.jinja").unlink()
    shutil.rmtree(model_dir / "additional_chat_templates")
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    (model_dir / "chat_template.json").write_text(json.dumps({"chat_template": QWEN_STYLE}))
    assert Tokenizer.from_dir(model_dir).chat_template == QWEN_STYLE
