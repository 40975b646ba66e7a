"""Chat templates: the model's own Jinja template from tokenizer_config.json, rendered in a
sandbox like transformers' ``apply_chat_template``, or a plain fallback for models without."""

from __future__ import annotations

import logging

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tailserve.model.tokenizer import Tokenizer
from tailserve.server.protocol import APIError

log = logging.getLogger("tailserve.server")

FALLBACK_TEMPLATE = (
    "{% for m in messages %}"
    "{{ '### ' + m['role'] | capitalize }}\n{{ m['content'] }}\n\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}### Assistant\n{% endif %}"
)


class ChatTemplate:
    def __init__(self, tokenizer: Tokenizer) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env.globals["raise_exception"] = raise_exception
        self.has_own_template = bool(tokenizer.chat_template)
        source = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else FALLBACK_TEMPLATE
        if not self.has_own_template:
            log.warning("the model has no chat template (chat_template.jinja or tokenizer_config.json); chat "
                        "requests use the plain '### Role' fallback")
        self.template = env.from_string(source)
        self.tokenizer = tokenizer

    def render(self, messages: list[dict[str, str]]) -> list[int]:
        try:
            text = self.template.render(messages=messages, add_generation_prompt=True,
                                        bos_token=self.tokenizer.bos_token or "",
                                        eos_token=self.tokenizer.eos_token or "")
        except TemplateError as e:
            raise APIError(400, f"chat template rejected the messages: {e}", "messages") from None
        # A model's own template writes its special tokens itself (as transformers assumes);
        # the fallback relies on the tokenizer to add BOS.
        return self.tokenizer.encode(text, add_special_tokens=not self.has_own_template)
