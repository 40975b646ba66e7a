"""Incremental detokenization for one request, one token at a time.

Decoding the whole output at every step is quadratic; decoding only the new token is wrong
for tokenizers whose tokens are byte fragments or carry leading-space markers. This keeps a
small window: text is emitted only once the window decodes to more than it did before and
does not end in an incomplete UTF-8 sequence (U+FFFD).

Stop strings are not handled here: the output processor checks them after every token (so
a stop inside a speculative run cuts the token ids too) and decides what may be streamed.
"""

from __future__ import annotations

from tailserve.model.tokenizer import Tokenizer

_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        self.tokens = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)

    def append(self, token_id: int) -> str:
        """Add one token; return the text it completes ("" while a character is still partial)."""
        self.tokens.append(token_id)
        dec = self.tokenizer.decode
        prefix = dec(self.tokens[self.prefix_offset : self.read_offset], self.skip_special)
        full = dec(self.tokens[self.prefix_offset :], self.skip_special)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.tokens)
            if self.prefix_offset > 64:  # keep the window small: drop what no decode reads again
                drop = self.prefix_offset - _CONTEXT_TOKENS
                del self.tokens[:drop]
                self.prefix_offset -= drop
                self.read_offset -= drop
            return full[len(prefix) :]
        return ""
