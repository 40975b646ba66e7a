"""Chat templates: the model's own Jinja template (chat_template.jinja or
tokenizer_config.json), or one given with ``--chat-template FILE``, rendered in a sandbox
like transformers' ``apply_chat_template`` (``messages``, ``tools``, ``add_generation_prompt``,
``bos_token``, ``eos_token``; ``tojson`` as transformers defines it), or a plain fallback
for models without one. Tools reach the template as sent (OpenAI's ``{"type": "function",
"function": {...}}``), and so do an assistant message's ``tool_calls`` (with ``arguments`` as
an object) and a ``tool`` message's ``tool_call_id``."""

from __future__ import annotations

import bisect
import json
import logging
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tailserve.metrics.prefix_break import PromptSegment, role_kind
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


def _common_prefix_len(a: str, b: str) -> int:
    """Length of the common start of two strings, by bisection over slice compares (C speed:
    a rendered prompt with a tool catalogue is tens of thousands of characters)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


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

    def _text(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
              add_generation_prompt: bool = True) -> str:
        try:
            return self.template.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                        bos_token=self.tokenizer.bos_token or "",
                                        eos_token=self.tokenizer.eos_token or "")
        except TemplateError as e:
            raise APIError(400, f"chat template rejected the messages: {e}", "messages") from None

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        # A model's own template writes its special tokens itself (as transformers assumes);
        # the fallback relies on the tokenizer to add BOS.
        return self.tokenizer.encode(self._text(messages, tools), add_special_tokens=not self.has_own_template)

    def render_segments(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
                        ) -> tuple[list[int], tuple[PromptSegment, ...]]:
        """The prompt's token ids and its parts by first token: ``messages[i]`` from where the
        template starts message i (the render of messages[:i] is a prefix of the whole one),
        and ``tools`` over what the tool definitions add (the render without them differs
        there only), wherever the template puts them. A boundary the template does not keep
        stable (a prefix render that is not a prefix) is left out: that part counts to the
        message before it."""
        text = self._text(messages, tools)
        ids, ends = self.tokenizer.encode_with_offsets(text, add_special_tokens=not self.has_own_template)
        starts: list[tuple[int, str, str]] = [(0, "messages[0]", role_kind(messages[0].get("role")))]
        for i in range(1, len(messages)):
            try:
                prefix = self._text(messages[:i], tools, add_generation_prompt=False)
            except APIError:
                continue  # a template that refuses a partial conversation: no boundary here
            if text.startswith(prefix):
                starts.append((len(prefix), f"messages[{i}]", role_kind(messages[i].get("role"))))
        if tools:
            bare = self._text(messages, None)
            lo = _common_prefix_len(text, bare)
            line = text.rfind("\n", 0, lo) + 1
            if not any(ch.isalnum() for ch in text[line:lo]):
                lo = line  # "### Tools" against "### System": the shared "### " opens the tools' line
            limit = min(len(text), len(bare)) - lo
            hi = len(text) - _common_prefix_len(text[::-1][:limit], bare[::-1][:limit])
            if hi > lo:
                # Messages that start inside the tools' text start after it; the message the
                # tools interrupt (a system block that embeds them) resumes after them.
                starts = [(max(c, hi) if lo <= c < hi else c, label, kind) for c, label, kind in starts]
                resume = max((s for s in starts if s[0] <= hi), key=lambda s: s[0])
                starts += [(lo, "tools", "tools"), (hi, resume[1], resume[2])]
        segments: list[PromptSegment] = []
        for c, label, kind in sorted(starts, key=lambda s: s[0]):
            tok = 0 if c == 0 else bisect.bisect_right(ends, c)  # the first token ending past c
            if tok >= len(ids):
                continue
            if segments and segments[-1].start >= tok:
                segments.pop()  # a later part starting at the same token names it
            if not segments or segments[-1].label != label:
                segments.append(PromptSegment(tok, label, kind))
        return ids, tuple(segments)
