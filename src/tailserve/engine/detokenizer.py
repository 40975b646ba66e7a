"""Incremental detokenization and stop-string detection for one request.

Decoding the whole output at every step is quadratic; decoding only the new token is wrong
for tokenizers whose tokens are byte fragments or carry leading-space markers. This keeps a
small window: text is emitted only once the window decodes to more than it did before and
does not end in an incomplete UTF-8 sequence (U+FFFD).
"""

from __future__ import annotations

from tailserve.model.tokenizer import Tokenizer

_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True,
                 stop: tuple[str, ...] = (), include_stop_str_in_output: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        self.tokens = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.text = ""
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.max_stop_len = max((len(s) for s in stop), default=0)

    def append(self, token_ids: list[int]) -> tuple[str, str | None]:
        """Add tokens; return (new text, the stop string hit or None). After a hit the text
        is cut at the stop string (kept when include_stop_str_in_output)."""
        start = len(self.text)
        for tok in token_ids:
            self.tokens.append(tok)
            dec = self.tokenizer.decode
            prefix = dec(self.tokens[self.prefix_offset : self.read_offset], self.skip_special)
            full = dec(self.tokens[self.prefix_offset :], self.skip_special)
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                self.text += full[len(prefix) :]
                self.prefix_offset = self.read_offset
                self.read_offset = len(self.tokens)
        hit = None
        if self.stop and len(self.text) > start:
            search_from = max(0, start - self.max_stop_len + 1)
            best = -1
            for s in self.stop:
                idx = self.text.find(s, search_from)
                if idx != -1 and (best == -1 or idx < best):
                    best, hit = idx, s
            if hit is not None:
                self.text = self.text[: best + len(hit) if self.include_stop else best]
        return self.text[start:], hit
