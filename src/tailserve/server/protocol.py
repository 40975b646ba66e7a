"""Parsing and validating OpenAI-style request bodies into engine requests.

Type errors (a string where a number belongs) are HTTP 422; values out of range and
semantic problems are HTTP 400; both come back in OpenAI's error format, naming the field.

The field rule (docs/server.md lists every field): a body may carry only the fields its
endpoint reads. A field this server does not implement is rejected with 400 naming it,
never accepted and ignored, with one exception: a sampling field at its neutral value
(``tools: []``, ``best_of: 1`` on chat, ...) asks for nothing, so it is accepted.
Unknown fields are rejected the same way, as OpenAI's API does.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from tailserve.errors import InvalidRequestError
from tailserve.sampling_params import SamplingParams


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, err_type: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.err_type = err_type or _default_type(status)
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": self.code}}


def _default_type(status: int) -> str:
    return {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}.get(
        status, "server_error" if status >= 500 else "invalid_request_error")


def parse_json_body(raw: bytes) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise APIError(400, "request body is not valid UTF-8", code="invalid_encoding") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise APIError(400, f"request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}",
                       code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    return body


# Fields each endpoint reads (besides the neutral ones below).
COMPLETION_FIELDS = frozenset({
    "model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
    "ignore_eos", "logprobs", "echo", "stream", "stream_options", "n", "best_of", "user", "skip_special_tokens",
    "include_stop_str_in_output", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias"})
CHAT_FIELDS = frozenset({
    "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
    "stop", "stop_token_ids", "ignore_eos", "logprobs", "top_logprobs", "stream", "stream_options", "n", "user",
    "response_format", "skip_special_tokens", "include_stop_str_in_output", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "logit_bias"})
# Accepted only at the value that asks for nothing (None is always neutral).
NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "best_of": (1,), "tools": ([],), "tool_choice": ("none",), "parallel_tool_calls": (False,),
    "min_tokens": (0,), "spaces_between_special_tokens": (True,), "add_special_tokens": (True,),
}
STREAM_OPTIONS = frozenset({"include_usage"})


def check_fields(body: dict[str, Any], allowed: frozenset[str]) -> None:
    for name, value in body.items():
        if name in allowed or value is None:
            continue
        neutral = NEUTRAL_VALUES.get(name)
        if neutral is not None:
            if any(value == v and type(value) is type(v) for v in neutral):
                continue
            raise APIError(400, f"'{name}' is not supported by this server (only {json.dumps(neutral[0])}, which "
                                "asks for nothing, is accepted)", name, code="unsupported_field")
        raise APIError(400, f"'{name}' is not a field this server implements for this endpoint (see docs/server.md);"
                            " it is rejected rather than ignored", name, code="unsupported_field")


_KINDS = {"int": (int,), "number": (int, float), "bool": (bool,), "str": (str,), "dict": (dict,), "list": (list,)}


def field(body: dict[str, Any], name: str, kind: str, default: Any = None, required: bool = False) -> Any:
    if name not in body or body[name] is None:
        if required:
            raise APIError(400, f"missing required field '{name}'", name, code="missing_field")
        return default
    v = body[name]
    ok = isinstance(v, _KINDS[kind]) and not (kind in ("int", "number") and isinstance(v, bool))
    if kind == "number" and ok and not math.isfinite(v):
        ok = False
    if not ok:
        raise APIError(422, f"'{name}' must be {'a ' if kind != 'int' else 'an '}{kind}, got {json.dumps(v)[:40]}",
                       name, code="invalid_type")
    return v


@dataclass
class GenerationRequest:
    prompts: list[str | list[int]]
    params: SamplingParams
    stream: bool
    include_usage: bool
    echo: bool
    model: str | None
    logprobs: int | None
    # max_tokens 0 with echo: score the prompt, generate nothing. The engine samples one
    # token it then drops (a prefill produces one anyway); the response carries none of it.
    score_only: bool = False


def sampling_params(body: dict[str, Any], chat: bool) -> tuple[SamplingParams, int | None, bool]:
    """(params, logprobs, score_only)."""
    if chat:
        max_tokens = field(body, "max_completion_tokens", "int", None)
        if max_tokens is None:
            max_tokens = field(body, "max_tokens", "int", None)
        want_lp = field(body, "logprobs", "bool", False)
        top_lp = field(body, "top_logprobs", "int", 0)
        logprobs = top_lp if want_lp else None
    else:
        max_tokens = field(body, "max_tokens", "int", None)
        logprobs = field(body, "logprobs", "int", None)
    echo = not chat and field(body, "echo", "bool", False)
    score_only = max_tokens == 0 and echo
    if max_tokens == 0 and not echo:
        raise APIError(400, "max_tokens 0 generates nothing; it is meaningful only with echo (scoring a prompt)",
                       "max_tokens")
    if score_only:
        max_tokens = 1
    temperature = field(body, "temperature", "number", 1.0)
    if temperature > 2.0:
        raise APIError(400, f"temperature must be in [0, 2], got {temperature}", "temperature")
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str | list):
        raise APIError(422, "'stop' must be a string or a list of strings", "stop", code="invalid_type")
    if isinstance(stop, list) and not all(isinstance(s, str) for s in stop):
        raise APIError(422, "'stop' must contain only strings", "stop", code="invalid_type")
    n = field(body, "n", "int", 1)
    best_of = None if chat else field(body, "best_of", "int", None)
    if best_of is not None and best_of > n and field(body, "stream", "bool", False):
        raise APIError(400, f"best_of ({best_of}) > n ({n}) cannot stream: the best samples are known only "
                            "when all have finished", "best_of")
    field(body, "user", "str", None)
    if logprobs is not None and not 0 <= logprobs <= 20:
        raise APIError(400, f"logprobs must be in [0, 20], got {logprobs}", "logprobs")
    try:
        params = SamplingParams(
            n=n,
            best_of=best_of,
            temperature=temperature,
            top_p=field(body, "top_p", "number", 1.0),
            top_k=field(body, "top_k", "int", 0),
            min_p=field(body, "min_p", "number", 0.0),
            seed=field(body, "seed", "int", None),
            max_tokens=max_tokens if max_tokens is not None else 16,
            stop=stop or (),
            stop_token_ids=field(body, "stop_token_ids", "list", ()),
            ignore_eos=field(body, "ignore_eos", "bool", False),
            logprobs=logprobs,
            # echo with logprobs returns the prompt tokens' logprobs too (OpenAI's legacy API).
            prompt_logprobs=logprobs if echo and logprobs is not None else None,
            skip_special_tokens=field(body, "skip_special_tokens", "bool", True),
            presence_penalty=field(body, "presence_penalty", "number", 0.0),
            frequency_penalty=field(body, "frequency_penalty", "number", 0.0),
            repetition_penalty=field(body, "repetition_penalty", "number", 1.0),
            logit_bias=field(body, "logit_bias", "dict", {}),
            include_stop_str_in_output=field(body, "include_stop_str_in_output", "bool", False),
        )
    except InvalidRequestError as e:
        raise APIError(400, str(e), e.param) from None
    return params, logprobs, score_only


def completion_request(body: dict[str, Any]) -> GenerationRequest:
    check_fields(body, COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if prompt is None:
        raise APIError(400, "missing required field 'prompt'", "prompt", code="missing_field")
    prompts: list[str | list[int]]
    is_ids = isinstance(prompt, list) and bool(prompt) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    if isinstance(prompt, str) or is_ids:
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(
            isinstance(p, str) or (isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                                                 for t in p)) for p in prompt):
        prompts = list(prompt)
    elif isinstance(prompt, list) and not prompt:
        raise APIError(400, "prompt must not be empty", "prompt")
    else:
        raise APIError(422, "'prompt' must be a string, a list of token ids, or a list of those", "prompt",
                       code="invalid_type")
    params, logprobs, score_only = sampling_params(body, chat=False)
    greq = _common(body, prompts, params, logprobs)
    greq.score_only = score_only
    return greq


def _common(body, prompts, params, logprobs) -> GenerationRequest:
    stream = field(body, "stream", "bool", False)
    opts = field(body, "stream_options", "dict", {})
    for key, value in opts.items():
        if key not in STREAM_OPTIONS and value not in (None, False):
            raise APIError(400, f"stream_options.{key} is not supported (only include_usage)", "stream_options",
                           code="unsupported_field")
    include_usage = bool(opts.get("include_usage", False))
    return GenerationRequest(prompts, params, stream, include_usage, field(body, "echo", "bool", False),
                             field(body, "model", "str", None), logprobs)


def chat_request(body: dict[str, Any]) -> tuple[list[dict[str, str]], GenerationRequest]:
    check_fields(body, CHAT_FIELDS)
    fmt = field(body, "response_format", "dict", None)
    if fmt is not None and fmt.get("type") != "text":
        raise APIError(400, f"response_format {json.dumps(fmt)[:60]} is not supported (only {{\"type\": \"text\"}})",
                       "response_format", code="unsupported_field")
    messages = field(body, "messages", "list", required=True)
    if not messages:
        raise APIError(400, "messages must not be empty", "messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(422, f"messages[{i}] must be an object with a string 'role'", "messages",
                           code="invalid_type")
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(400, f"messages[{i}]: only text content parts are supported", "messages")
                parts.append(part["text"])
            content = "".join(parts)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise APIError(422, f"messages[{i}].content must be a string or a list of text parts", "messages",
                           code="invalid_type")
        if m["role"] not in ("system", "user", "assistant", "tool", "developer"):
            raise APIError(400, f"messages[{i}].role {m['role']!r} is not one of system, user, assistant, tool",
                           "messages")
        clean.append({"role": m["role"], "content": content})
    params, logprobs, _ = sampling_params(body, chat=True)
    return clean, _common(body, [], params, logprobs)
