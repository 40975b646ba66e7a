"""A thin wrapper over a Hugging Face ``tokenizer.json`` (the ``tokenizers`` library).

Reads ``tokenizer_config.json`` for the special tokens and the chat template. Encoding
adds special tokens the way the tokenizer's own post-processor says (BOS for Llama, none
for Qwen), exactly as ``AutoTokenizer`` does.
"""

from __future__ import annotations

import pathlib
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from tailserve.errors import CheckpointFormatError
from tailserve.model.config import read_json


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # AddedToken serialisation
        value = value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    def __init__(self, model_dir: pathlib.Path) -> None:
        path = model_dir / "tokenizer.json"
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises a bare Exception on bad files
            raise CheckpointFormatError(f"{path}: cannot load tokenizer ({e})") from None
        cfg_path = model_dir / "tokenizer_config.json"
        self.config: dict[str, Any] = read_json(cfg_path) if cfg_path.is_file() else {}
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        # transformers >= 4.43 saves the template beside the tokenizer as chat_template.jinja
        # (and prefers it on load); older checkpoints keep it in tokenizer_config.json.
        jinja = model_dir / "chat_template.jinja"
        template = self.config.get("chat_template")
        if jinja.is_file():
            try:
                template = jinja.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise CheckpointFormatError(f"{jinja}: cannot read the chat template ({e})") from None
        self.chat_template: str | None = template if isinstance(template, str) else None
        self.vocab_size = self._tok.get_vocab_size()

    @classmethod
    def maybe_load(cls, model_dir: pathlib.Path) -> Tokenizer | None:
        return cls(model_dir) if (model_dir / "tokenizer.json").is_file() else None

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text (what llguidance reads)."""
        return self._tok.to_str()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_with_offsets(self, text: str, add_special_tokens: bool = True) -> tuple[list[int], list[int]]:
        """Token ids and, per token, the character offset where it ends in ``text`` (0 for
        a special token the tokenizer added)."""
        enc = self._tok.encode(text, add_special_tokens=add_special_tokens)
        return enc.ids, [end for _, end in enc.offsets]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
