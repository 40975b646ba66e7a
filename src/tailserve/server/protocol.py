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

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any

from tailserve.errors import InvalidRequestError
from tailserve.sampling_params import SamplingParams, StructuredOutputsParams


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
    "include_stop_str_in_output", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
    "structured_outputs"})
CHAT_FIELDS = frozenset({
    "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
    "stop", "stop_token_ids", "ignore_eos", "logprobs", "top_logprobs", "stream", "stream_options", "n", "user",
    "response_format", "skip_special_tokens", "include_stop_str_in_output", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "logit_bias", "structured_outputs", "tools", "tool_choice", "parallel_tool_calls",
    "tool_pruning"})
# Accepted only at the value that asks for nothing (None is always neutral).
NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "best_of": (1,), "min_tokens": (0,), "spaces_between_special_tokens": (True,), "add_special_tokens": (True,),
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
    so = structured_outputs(body, chat)
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
            structured_outputs=so,
        )
    except InvalidRequestError as e:
        raise APIError(400, str(e), e.param) from None
    return params, logprobs, score_only


STRUCTURED_OUTPUTS_KEYS = frozenset({"json", "json_object", "regex", "choice", "grammar", "disable_any_whitespace",
                                     "whitespace_pattern", "disable_fallback"})


def structured_outputs(body: dict[str, Any], chat: bool) -> StructuredOutputsParams | None:
    """OpenAI's ``response_format`` (chat) or vLLM's ``structured_outputs`` (both endpoints)."""
    so = field(body, "structured_outputs", "dict", None)
    fmt = field(body, "response_format", "dict", None) if chat else None
    if fmt is not None and fmt.get("type") == "text" and len(fmt) == 1:
        fmt = None
    if so is not None and fmt is not None:
        raise APIError(400, "send either response_format or structured_outputs, not both", "response_format")
    try:
        if fmt is not None:
            return _response_format(fmt)
        if so is None:
            return None
        for key in so:
            if key not in STRUCTURED_OUTPUTS_KEYS:
                raise APIError(400, f"structured_outputs.{key} is not supported (supported: "
                                    f"{', '.join(sorted(STRUCTURED_OUTPUTS_KEYS))})", "structured_outputs",
                               code="unsupported_field")
        # disable_fallback: there is one grammar engine and never a fallback, so either value holds.
        kw = {k: v for k, v in so.items() if k != "disable_fallback" and v is not None}
        if kw.get("json_object") is False:
            kw.pop("json_object")
        return StructuredOutputsParams(**kw, param="structured_outputs")
    except InvalidRequestError as e:
        raise APIError(400, str(e), e.param) from None


def _response_format(fmt: dict[str, Any]) -> StructuredOutputsParams:
    kind = fmt.get("type")
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True, param="response_format")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise APIError(400, "response_format.json_schema must be an object with 'name' and 'schema'",
                           "response_format")
        unknown = set(spec) - {"name", "schema", "strict", "description"}
        if unknown:
            raise APIError(400, f"response_format.json_schema.{sorted(unknown)[0]} is not a field OpenAI defines",
                           "response_format")
        schema = spec.get("schema")
        if schema is None:  # no schema given: any JSON object
            return StructuredOutputsParams(json_object=True, param="response_format")
        if not isinstance(schema, dict):
            raise APIError(400, "response_format.json_schema.schema must be a JSON schema object", "response_format")
        return StructuredOutputsParams(json=schema, param="response_format")
    raise APIError(400, f"response_format type {json.dumps(kind)} is not supported (text, json_object, json_schema)",
                   "response_format", code="unsupported_field")


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


@dataclass
class ChatRequest:
    messages: list[dict[str, Any]]
    greq: GenerationRequest
    tools: list[dict[str, Any]] | None  # OpenAI's {"type": "function", "function": {...}} entries
    tool_choice: str | None  # "none" | "auto" | "required" | a function name; None without tools
    parallel_tool_calls: bool
    tool_pruning: object = None  # the body's tool_pruning, as sent (server/tool_pruning.py reads it)

    @property
    def forced_function(self) -> str | None:
        return None if self.tool_choice in (None, "none", "auto", "required") else self.tool_choice


def parse_tools(body: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, str | None, bool]:
    """(tools, tool_choice, parallel_tool_calls), checked against each other."""
    tools = field(body, "tools", "list", None)
    choice = body.get("tool_choice")
    parallel = field(body, "parallel_tool_calls", "bool", True)
    if tools == []:
        tools = None
    names: list[str] = []
    for i, t in enumerate(tools or []):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise APIError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise APIError(400, f"tools[{i}].function.name must be a non-empty string", "tools")
        if name in names:
            raise APIError(400, f"tools[{i}]: function {name!r} is defined twice", "tools")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        names.append(name)
    if choice is None:
        return tools, ("auto" if tools else None), parallel
    if isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise APIError(400, 'tool_choice must be "none", "auto", "required" or {"type": "function", '
                                '"function": {"name": ...}}', "tool_choice")
        choice = fn["name"]
        if not tools:
            raise APIError(400, f"tool_choice names function {choice!r} but the request has no tools; send the "
                                "function in 'tools'", "tool_choice")
        if choice not in names:
            raise APIError(400, f"tool_choice names function {choice!r}, which is not in tools "
                                f"({', '.join(names)})", "tool_choice")
        return tools, choice, parallel
    if choice not in ("none", "auto", "required"):
        raise APIError(400, f'tool_choice must be "none", "auto", "required" or a function, got {json.dumps(choice)}',
                       "tool_choice")
    if choice != "none" and not tools:
        raise APIError(400, f'tool_choice "{choice}" needs tools; send them in \'tools\' (or drop tool_choice)',
                       "tool_choice")
    return tools, (choice if tools else None), parallel


def _message(i: int, m: Any) -> dict[str, Any]:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise APIError(422, f"messages[{i}] must be an object with a string 'role'", "messages", code="invalid_type")
    role = m["role"]
    if role not in ("system", "user", "assistant", "tool", "developer"):
        raise APIError(400, f"messages[{i}].role {role!r} is not one of system, user, assistant, tool", "messages")
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
    out: dict[str, Any] = {"role": role, "content": content}
    calls = m.get("tool_calls")
    if calls is not None:
        if role != "assistant" or not isinstance(calls, list):
            raise APIError(400, f"messages[{i}].tool_calls belongs on an assistant message, as a list", "messages")
        clean = []
        for j, c in enumerate(calls):
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(
                    fn.get("arguments", ""), str):
                raise APIError(400, f"messages[{i}].tool_calls[{j}] must have function.name and function.arguments "
                                    "(a JSON string)", "messages")
            args = fn.get("arguments") or "{}"
            try:
                parsed = json.loads(args)
            except ValueError:
                raise APIError(400, f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON",
                               "messages") from None
            # Templates differ on whether they print the arguments as a string or as an object
            # (transformers' convention: a mapping); both views travel.
            clean.append({"id": c.get("id"), "type": "function",
                          "function": {"name": fn["name"], "arguments": parsed if isinstance(parsed, dict) else args}})
        out["tool_calls"] = clean
    for key in ("tool_call_id", "name"):
        v = m.get(key)
        if v is not None:
            if not isinstance(v, str):
                raise APIError(422, f"messages[{i}].{key} must be a string", "messages", code="invalid_type")
            out[key] = v
    return out


def chat_request(body: dict[str, Any]) -> ChatRequest:
    check_fields(body, CHAT_FIELDS)
    tools, tool_choice, parallel = parse_tools(body)
    messages = field(body, "messages", "list", required=True)
    if not messages:
        raise APIError(400, "messages must not be empty", "messages")
    clean = [_message(i, m) for i, m in enumerate(messages)]
    params, logprobs, _ = sampling_params(body, chat=True)
    if tool_choice not in (None, "none", "auto") and params.structured_outputs is not None:
        raise APIError(400, f"tool_choice {json.dumps(tool_choice)} constrains the output to a tool call; it cannot "
                            "be combined with response_format or structured_outputs", "tool_choice")
    pruning = body.get("tool_pruning")
    if pruning is not None and not tools:
        raise APIError(400, "tool_pruning needs tools to choose from; the request has none", "tool_pruning")
    return ChatRequest(clean, _common(body, [], params, logprobs), tools, tool_choice, parallel, pruning)


def with_structured_outputs(greq: GenerationRequest, so: StructuredOutputsParams | None,
                            skip_special_tokens: bool | None = None) -> None:
    """Constrain a parsed request (a forced tool call) after the fact; None changes nothing."""
    kw: dict[str, Any] = {}
    if so is not None:
        kw["structured_outputs"] = so
    if skip_special_tokens is not None:
        kw["skip_special_tokens"] = skip_special_tokens
    if not kw:
        return
    try:
        greq.params = dataclasses.replace(greq.params, **kw)
    except InvalidRequestError as e:
        raise APIError(400, str(e), e.param) from None
