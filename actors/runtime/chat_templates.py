"""Chat templates: found in a checkpoint's files and rendered with Jinja as transformers does.

Where a template lives, in transformers' order: chat_template.jinja (plus named ones in
additional_chat_templates/*.jinja) takes priority over tokenizer_config.json's `chat_template`
(a string, or a list of {"name", "template"}); a processor's chat_template.json
({"chat_template": ...}), which AutoTokenizer does not read but AutoProcessor does, is the
last resort. Several templates make a dict by name, "default" the one a chat uses.

Rendering copies transformers/utils/chat_template_utils.py (`_compile_jinja_template`,
`render_jinja_template`): an ImmutableSandboxedEnvironment (templates come from the Hub: they
are untrusted code) with trim_blocks and lstrip_blocks, the loopcontrols extension and a
`{% generation %}` block (transformers marks assistant spans with it; here it only renders its
body), a `tojson` filter that escapes no HTML and takes indent / separators / sort_keys, and
the globals raise_exception, strftime_now, dict and a namespace that refuses underscore names.
The template sees `messages` (each message without its None-valued keys), `tools` and
`documents` (None), `add_generation_prompt` and the named special tokens (bos_token, ...).

Jinja is imported on the first render: the Engine loads a tokenizer but renders no chat.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Any

CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
PROCESSOR_TEMPLATE_FILE = "chat_template.json"
COMPILED_TEMPLATES = 8  # a process renders one template, or the fallback beside it


def find_chat_template(model_dir: Path, tokenizer_config: dict) -> str | dict[str, str] | None:
    """The checkpoint's chat template: one string, several by name, or None."""
    templates = {}
    if (model_dir / CHAT_TEMPLATE_FILE).is_file():
        templates["default"] = (model_dir / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    if (model_dir / CHAT_TEMPLATE_DIR).is_dir():
        for path in sorted((model_dir / CHAT_TEMPLATE_DIR).glob("*.jinja")):
            templates[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if templates:
        return templates["default"] if list(templates) == ["default"] else templates
    found = tokenizer_config.get("chat_template")
    if found is None and (model_dir / PROCESSOR_TEMPLATE_FILE).is_file():
        text = (model_dir / PROCESSOR_TEMPLATE_FILE).read_text(encoding="utf-8")
        found = json.loads(text).get("chat_template")
    if isinstance(found, list):
        return {entry["name"]: entry["template"] for entry in found}
    return found or None


def render_chat(
    template: str,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    special_tokens: dict[str, str],
) -> str:
    """`messages` rendered by `template`; jinja2's TemplateError when the template refuses
    them (raise_exception) or cannot be parsed."""
    plain = [{k: v for k, v in message.items() if v is not None} for message in messages]
    return _compiled(template).render(
        messages=plain,
        tools=None,
        documents=None,
        add_generation_prompt=add_generation_prompt,
        **special_tokens,
    )


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@functools.lru_cache(maxsize=COMPILED_TEMPLATES)
def _compiled(template: str):
    """The template compiled in transformers' environment (built once per template, as there:
    its classes close over jinja2, imported here on first use)."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.utils
    from jinja2.exceptions import SecurityError, TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}`: its body, unmarked."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_body")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class TemplateDict:
        """`dict(...)` and `dict.fromkeys(...)` without the type itself (no attribute escapes)."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        """jinja2's namespace, refusing underscore-prefixed names (a way to CPython's inside)."""

        def __init__(*args, **kwargs):  # jinja2's signature trick: namespace(self=...) works
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise SecurityError(
                    f"Chat templates cannot store underscore-prefixed attributes on a namespace, "
                    f"but got {name!r}. Please rename the attribute."
                )

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(template)
