"""Chat templates: the model's own Jinja template (chat_template.jinja or
tokenizer_config.json), or one given with ``--chat-template FILE``, rendered in a sandbox
like transformers' ``apply_chat_template`` (``messages``, ``tools``, ``add_generation_prompt``,
``bos_token``, ``eos_token``; ``tojson`` as transformers defines it), or a plain fallback
for models without one. Tools reach the template as sent (OpenAI's ``{"type": "function",
"function": {...}}``), and so do an assistant message's ``tool_calls`` (with ``arguments`` as
an object) and a ``tool`` message's ``tool_call_id``."""

from __future__ import annotations

import json
import logging
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tailserve.model.tokenizer import Tokenizer
from tailserve.server.protocol import APIError

log = logging.getLogger("tailserve.server")

FALLBACK_TEMPLATE = (
    "{% if tools %}### Tools\nTo call a function, write <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>."
    "\n{% for t in tools %}{{ t | tojson }}{{ '\\n' }}{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}"
    "{{ '### ' + m['role'] | capitalize }}\n{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}"
    "<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>"
    "{% endfor %}{{ '\\n\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}### Assistant\n{% endif %}"
)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    """transformers' ``tojson``: plain JSON, no HTML escaping (Jinja's own escapes < > &)."""
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


class ChatTemplate:
    def __init__(self, tokenizer: Tokenizer, template: str | None = None) -> None:
        """``template``: Jinja source overriding the checkpoint's (``--chat-template``)."""
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = _tojson
        source = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None
        if template is not None:
            source = template
        self.has_own_template = source is not None
        source = source if source is not None else FALLBACK_TEMPLATE
        if not self.has_own_template:
            log.warning("the model has no chat template (chat_template.jinja or tokenizer_config.json); chat "
                        "requests use the plain '### Role' fallback")
        self.template = env.from_string(source)
        self.tokenizer = tokenizer

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        try:
            text = self.template.render(messages=messages, tools=tools, add_generation_prompt=True,
                                        bos_token=self.tokenizer.bos_token or "",
                                        eos_token=self.tokenizer.eos_token or "")
        except TemplateError as e:
            raise APIError(400, f"chat template rejected the messages: {e}", "messages") from None
        # A model's own template writes its special tokens itself (as transformers assumes);
        # the fallback relies on the tokenizer to add BOS.
        return self.tokenizer.encode(text, add_special_tokens=not self.has_own_template)
