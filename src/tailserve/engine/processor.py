"""The input stage: validate and tokenize a request, without touching engine state.

Thread-safe (it only reads the tokenizer and fixed limits), so the server calls it on its
event loop, off the engine thread, and bad input is rejected before anything is queued.
"""

from __future__ import annotations

from dataclasses import dataclass

from tailserve.errors import InvalidRequestError
from tailserve.metrics.prefix_break import PromptSegment
from tailserve.model.tokenizer import Tokenizer
from tailserve.sampling_params import SamplingParams
from tailserve.structured.grammar import CompiledGrammar, GrammarCompiler

Prompt = str | list[int]


@dataclass(frozen=True)
class PreparedRequest:
    """A validated, tokenized request, ready for ``LLMEngine.add_prepared``."""

    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    grammar: CompiledGrammar | None = None  # validated, for params.structured_outputs
    # A chat prompt's parts by first token (the tools, each message), for the prefix-break
    # report; empty for a completions prompt.
    prompt_segments: tuple[PromptSegment, ...] = ()
    # When it finishes, keep its cached blocks the last to be evicted for this long (an agent's
    # turn that may end in a tool call: the next turn sends the same prefix); 0: no pin.
    kv_pin_s: float = 0.0


class Processor:
    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, max_model_len: int, block_size: int,
                 num_blocks: int, model_dir: str, grammar_compiler: GrammarCompiler | None = None) -> None:
        self.tokenizer = tokenizer
        self.grammar_compiler = grammar_compiler
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.model_dir = model_dir

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt must not be empty", "prompt")
            if self.tokenizer is None:
                raise InvalidRequestError(f"{self.model_dir} has no tokenizer.json; pass token ids instead of text",
                                          "prompt")
            return prompt, self.tokenizer.encode(prompt)
        if not isinstance(prompt, list | tuple):
            raise InvalidRequestError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}",
                                      "prompt")
        if not prompt:
            raise InvalidRequestError("prompt must not be empty", "prompt")
        vocab = self.vocab_size
        for t in prompt:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab}), got {t!r}", "prompt")
        return None, list(prompt)

    def process(self, prompt: Prompt, params: SamplingParams | None = None,
                segments: tuple[PromptSegment, ...] = ()) -> PreparedRequest:
        """``segments``: a rendered chat prompt's parts (the server's), carried to the report
        of where the prompt left the prefix cache."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("sampling params must be a SamplingParams", "sampling_params")
        text, ids = self.tokenize(prompt)
        # One rule for the server and the offline API (vLLM's): the prompt and every token
        # asked for must fit the context, else the request is refused with both numbers.
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens but the model's context (max_model_len) is {self.max_model_len}; "
                "at least one token must be left to generate", "prompt", code="context_length_exceeded")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"this model's context (max_model_len) is {self.max_model_len} tokens, but {len(ids)} prompt tokens "
                f"+ max_tokens {params.max_tokens} = {len(ids) + params.max_tokens}; lower max_tokens to at most "
                f"{self.max_model_len - len(ids)}", "max_tokens", code="context_length_exceeded")
        total = len(ids) + params.max_tokens
        need_blocks = -(-total // self.block_size)
        if need_blocks > self.num_blocks:
            raise InvalidRequestError(
                f"prompt + max_tokens needs {need_blocks} KV blocks but the cache holds "
                f"{self.num_blocks}; raise --kv-cache-memory or lower max_tokens", "max_tokens")
        for t, _ in params.logit_bias:
            if t >= self.vocab_size:
                raise InvalidRequestError(f"logit_bias token id {t} is outside the vocabulary ({self.vocab_size})",
                                          "logit_bias")
        for t in params.stop_token_ids:
            if t >= self.vocab_size:
                raise InvalidRequestError(f"stop token id {t} is outside the vocabulary ({self.vocab_size})",
                                          "stop_token_ids")
        if self.tokenizer is None and params.stop:
            raise InvalidRequestError("stop strings need a tokenizer; this model has none", "stop")
        grammar = None
        so = params.structured_outputs
        if so is not None:
            if self.grammar_compiler is None:
                raise InvalidRequestError(f"structured outputs need the model's tokenizer; {self.model_dir} has no "
                                          "tokenizer.json", so.param)
            grammar = self.grammar_compiler.compile(so)  # an invalid schema / regex / grammar: here, a 400
        return PreparedRequest(text, ids, params, grammar, segments)
