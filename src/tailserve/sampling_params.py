"""Per-request sampling parameters: frozen and validated once, on construction."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from tailserve.errors import InvalidRequestError

# Below this a temperature means greedy decoding (vLLM uses the same cut-off).
GREEDY_TEMPERATURE = 1e-5
MAX_SAMPLES = 128  # n and best_of (OpenAI's bound on n)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What a request's output must match, enforced by constrained decoding (``structured/``).

    vLLM's ``structured_outputs`` field: exactly one of ``json`` (a JSON schema, as a dict or
    its text), ``json_object`` (any JSON object), ``regex``, ``choice`` (one of these strings)
    or ``grammar`` (Lark, or GBNF/EBNF as llama.cpp writes it). JSON is generated compactly
    (``disable_any_whitespace``, the default here): with whitespace free between tokens a
    weak model can pad with newlines until max_tokens. ``whitespace_pattern`` (a regex)
    allows exactly that whitespace instead. ``param`` names the request field the errors
    report (``response_format``, ``tool_choice``, ...)."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = True
    whitespace_pattern: str | None = None
    param: str = "structured_outputs"

    def __post_init__(self) -> None:
        p = self.param
        schema = self.json
        if isinstance(schema, dict):
            object.__setattr__(self, "json", json.dumps(schema))  # frozen and hashable: keep the text
        elif schema is not None and not isinstance(schema, str):
            raise InvalidRequestError(f"{p}.json must be a JSON schema (an object), got {type(schema).__name__}", p)
        elif isinstance(schema, str):
            try:
                if not isinstance(json.loads(schema), dict | bool):
                    raise ValueError("not an object")
            except ValueError as e:
                raise InvalidRequestError(f"{p}.json is not a JSON schema object: {e}", p) from None
        choice = self.choice
        if choice is not None:
            if isinstance(choice, str) or not isinstance(choice, Sequence) or not choice:
                raise InvalidRequestError(f"{p}.choice must be a non-empty list of strings", p)
            if not all(isinstance(c, str) and c for c in choice):
                raise InvalidRequestError(f"{p}.choice must contain only non-empty strings", p)
            object.__setattr__(self, "choice", tuple(choice))
        for name in ("regex", "grammar", "whitespace_pattern"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise InvalidRequestError(f"{p}.{name} must be a non-empty string", p)
        if not isinstance(self.json_object, bool) or not isinstance(self.disable_any_whitespace, bool):
            raise InvalidRequestError(f"{p}.json_object and {p}.disable_any_whitespace must be booleans", p)
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object:
            kinds.append("json_object")
        if len(kinds) != 1:
            raise InvalidRequestError(
                f"{p} needs exactly one of json, json_object, regex, choice, grammar; got "
                f"{', '.join(kinds) or 'none'}", p)

    @property
    def kind(self) -> str:
        for k in ("json", "regex", "choice", "grammar"):
            if getattr(self, k) is not None:
                return k
        return "json_object"


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next tokens of one request.

    ``n`` samples are returned (``best_of``: that many generated, the n best returned; see
    ``engine/parallel_sampling.py``). temperature 0 means greedy. ``top_k`` 0 or -1 disables
    top-k; ``top_p`` 1.0 disables nucleus filtering; ``min_p`` 0.0 disables min-p. ``seed`` makes a request's samples
    reproducible whatever else shares its batch. ``stop`` strings end the output (and are
    cut from the text unless ``include_stop_str_in_output``); ``stop_token_ids`` end it
    after that token. ``logprobs`` = k returns the sampled token's log-probability and the
    k most likely tokens' at each step; ``prompt_logprobs`` = k does the same for every prompt
    token after the first (the first has no context to be predicted from), as vLLM's.
    """

    n: int = 1
    # best_of samples are generated and the n with the highest mean token logprob returned
    # (OpenAI's legacy completions); None means n. The samples share the prompt's KV blocks.
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Penalties as OpenAI and vLLM define them (sample/logits_processors.py): presence and
    # frequency over the generated tokens, repetition over prompt and generated tokens.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)  # (token id, bias); dict accepted
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Constrained decoding: the output must match this (a grammar mask at every sampled
    # position, speculative drafts included); logprobs are then the masked distribution's.
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        # Accept a single string / lists for convenience, store tuples (hashable, frozen).
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        elif isinstance(stop, Sequence) and not isinstance(stop, bytes | bytearray):
            stop = tuple(stop)
        else:
            raise InvalidRequestError(f"stop must be a string or a list of strings, got {type(stop).__name__}", "stop")
        for s in stop:
            if not isinstance(s, str):
                raise InvalidRequestError(f"stop must contain only strings, got {type(s).__name__}", "stop")
            if s == "":
                raise InvalidRequestError("stop strings must not be empty", "stop")
        object.__setattr__(self, "stop", stop)

        ids = self.stop_token_ids
        if ids is None:
            ids = ()
        elif isinstance(ids, Sequence) and not isinstance(ids, str | bytes | bytearray):
            ids = tuple(ids)
        else:
            raise InvalidRequestError(
                f"stop_token_ids must be a list of integers, got {type(ids).__name__}", "stop_token_ids")
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise InvalidRequestError(f"stop_token_ids must contain non-negative integers, got {t!r}",
                                          "stop_token_ids")
        object.__setattr__(self, "stop_token_ids", ids)

        for name in ("presence_penalty", "frequency_penalty"):
            _check_number(getattr(self, name), name)
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {getattr(self, name)}", name)
        _check_number(self.repetition_penalty, "repetition_penalty")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise InvalidRequestError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}",
                                      "repetition_penalty")
        bias = self.logit_bias
        if isinstance(bias, dict):
            bias = tuple(bias.items())
        elif bias is None:
            bias = ()
        clean = []
        for item in bias:
            if not (isinstance(item, tuple | list) and len(item) == 2):
                raise InvalidRequestError("logit_bias must map token ids to biases", "logit_bias")
            tok, b = item
            if isinstance(tok, str) and tok.strip().lstrip("-").isdigit():
                tok = int(tok)  # JSON object keys are strings
            if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
                raise InvalidRequestError(f"logit_bias keys must be token ids, got {tok!r}", "logit_bias")
            _check_number(b, "logit_bias")
            if not -100.0 <= b <= 100.0:
                raise InvalidRequestError(f"logit_bias values must be in [-100, 100], got {b}", "logit_bias")
            clean.append((tok, float(b)))
        if len(clean) > 300:
            raise InvalidRequestError("logit_bias takes at most 300 tokens", "logit_bias")
        object.__setattr__(self, "logit_bias", tuple(clean))
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise InvalidRequestError("structured_outputs must be a StructuredOutputsParams", "structured_outputs")

        _check_int(self.n, "n", lo=1)
        if self.n > MAX_SAMPLES:
            raise InvalidRequestError(f"n must be at most {MAX_SAMPLES}, got {self.n}", "n")
        if self.best_of is not None:
            _check_int(self.best_of, "best_of", lo=1)
            if not self.n <= self.best_of <= MAX_SAMPLES:
                raise InvalidRequestError(f"best_of must be in [n, {MAX_SAMPLES}] (n = {self.n}), got {self.best_of}",
                                          "best_of")
        _check_number(self.temperature, "temperature")
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}", "temperature")
        _check_number(self.top_p, "top_p")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        _check_int(self.top_k, "top_k", lo=-1)
        _check_number(self.min_p, "min_p")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        if self.seed is not None:
            _check_int(self.seed, "seed")
        _check_int(self.max_tokens, "max_tokens", lo=1)
        if self.logprobs is not None:
            _check_int(self.logprobs, "logprobs", lo=0)
            if self.logprobs > 20:
                raise InvalidRequestError(f"logprobs must be at most 20, got {self.logprobs}", "logprobs")
        if self.prompt_logprobs is not None:
            _check_int(self.prompt_logprobs, "prompt_logprobs", lo=0)
            if self.prompt_logprobs > 20:
                raise InvalidRequestError(f"prompt_logprobs must be at most 20, got {self.prompt_logprobs}",
                                          "prompt_logprobs")

    @property
    def num_samples(self) -> int:
        """Samples generated for this request: best_of, else n."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def has_logits_processors(self) -> bool:
        """Penalties or a logit bias: the logits depend on the tokens so far."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def effective_top_k(self) -> int:
        """top_k with 'disabled' spelled 0."""
        return 0 if self.top_k in (0, -1) else self.top_k


def _check_int(value: object, name: str, lo: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{name} must be an integer, got {value!r}", name)
    if lo is not None and value < lo:
        raise InvalidRequestError(f"{name} must be >= {lo}, got {value}", name)


def _check_number(value: object, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidRequestError(f"{name} must be a finite number, got {value!r}", name)
