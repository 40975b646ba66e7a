"""Property-based fuzzing of both generation endpoints against a real server on 127.0.0.1.

Bodies mix valid fields, values of the wrong type or range, unknown fields and wrong shapes.
Whatever arrives, the server answers with a documented status (200, 400, 404, 413, 422,
429), an error body in OpenAI's format when it is not 200, a well-formed SSE stream when it
streams, within a time bound, and still answers /health afterwards. A few hundred cases run
in CI (50 per endpoint and 200 mixed); TAILSERVE_FUZZ_EXAMPLES sets the mixed run's count.
"""

from __future__ import annotations

import json
import os

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tailserve.bench.local_server import LocalServer

ALLOWED = {200, 400, 404, 413, 422, 429}

scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(allow_nan=True),
                    st.text(max_size=20))
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                            st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                           max_leaves=8)
small_ints = st.one_of(st.integers(-3, 8), json_values)
unit = st.one_of(st.floats(-1, 3, allow_nan=False), json_values)
prompts = st.one_of(st.text(max_size=40), st.lists(st.integers(-5, 70000), max_size=12),
                    st.lists(st.text(max_size=10), max_size=3), json_values)
messages = st.one_of(
    st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "bot"]),
                                    "content": st.one_of(st.text(max_size=30), json_values)}), max_size=3),
    json_values)
common = {
    "max_tokens": small_ints, "temperature": unit, "top_p": unit, "top_k": small_ints, "min_p": unit,
    "seed": small_ints, "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3),
                                          json_values),
    "stream": st.one_of(st.booleans(), json_values), "logprobs": st.one_of(st.booleans(), small_ints),
    "n": small_ints, "ignore_eos": st.one_of(st.booleans(), json_values), "model": st.one_of(st.just("fuzz"),
                                                                                            json_values),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), json_values),
    "presence_penalty": unit, "repetition_penalty": unit, "stop_token_ids": st.one_of(
        st.lists(st.integers(-2, 70000), max_size=3), json_values),
}


_valid_common = {
    "temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1), "top_k": st.integers(0, 50),
    "min_p": st.floats(0, 0.5), "seed": st.integers(0, 2**31), "stop": st.lists(st.text(min_size=1, max_size=3),
                                                                              max_size=3),
    "stream": st.booleans(), "ignore_eos": st.booleans(), "model": st.just("fuzz"),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "stop_token_ids": st.lists(st.integers(0, 300), max_size=3), "presence_penalty": st.just(0.0),
}


def valid_bodies(kind: str):
    """Requests a client could send correctly (so the 200 paths are fuzzed too)."""
    if kind == "completions":
        required = {"prompt": st.one_of(st.text(min_size=1, max_size=40),
                                        st.lists(st.integers(0, 300), min_size=1, max_size=12)),
                    "max_tokens": st.integers(1, 8)}
        optional = dict(_valid_common, logprobs=st.integers(0, 5), echo=st.booleans())
    else:
        required = {"messages": st.lists(st.fixed_dictionaries({
            "role": st.sampled_from(["user", "system", "assistant"]), "content": st.text(max_size=30)}),
            min_size=1, max_size=3), "max_tokens": st.integers(1, 8)}
        optional = dict(_valid_common, logprobs=st.booleans(), top_logprobs=st.integers(0, 5))
    return st.fixed_dictionaries(required, optional=optional)


def bodies(kind: str):
    """A third valid, a third valid with one field replaced or added by anything, a third
    anything at all (wrong shapes, unknown fields, wrong types)."""
    fields = dict(common, prompt=prompts) if kind == "completions" else dict(common, messages=messages,
                                                                             top_logprobs=small_ints)
    anything = st.tuples(st.fixed_dictionaries({}, optional=fields),
                         st.dictionaries(st.text(min_size=1, max_size=10), json_values, max_size=2))
    mutated = st.tuples(valid_bodies(kind), st.one_of(st.sampled_from(sorted(fields)), st.text(max_size=10)),
                        json_values)
    return st.one_of(valid_bodies(kind), mutated.map(lambda t: {**t[0], t[1]: t[2]}),
                     anything.map(lambda t: {**t[1], **t[0]}), json_values)


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server  # the session's server (conftest): it also answers to "fuzz"


def _check(server: LocalServer, path: str, body: object) -> None:
    raw = json.dumps(body, allow_nan=True).encode()
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", server.url + path, content=raw, headers={"Content-Type": "application/json"}) as r:
            data = r.read()
        assert r.status_code in ALLOWED, (r.status_code, body, data[:300])
        if r.status_code != 200:
            err = json.loads(data)["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"], err
        elif r.headers.get("content-type", "").startswith("text/event-stream"):
            events = [e for e in data.decode().split("\n\n") if e.strip()]
            assert events[-1] == "data: [DONE]", events[-3:]
            for e in events[:-1]:
                assert e.startswith("data: ")
                obj = json.loads(e[6:])
                assert "error" not in obj, obj
        else:
            assert "choices" in json.loads(data)
        assert c.get(server.url + "/health").status_code == 200


# 50 examples a test by default (real HTTP round trips: ~0.1 s each); the long run's count
# comes from TAILSERVE_FUZZ_EXAMPLES (e.g. 2000 for a soak of the parser).
LONG_EXAMPLES = int(os.environ.get("TAILSERVE_FUZZ_EXAMPLES", "120"))
FUZZ = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                        HealthCheck.function_scoped_fixture])


@FUZZ
@given(body=bodies("completions"))
def test_fuzz_completions(server, body):
    _check(server, "/v1/completions", body)


@FUZZ
@given(body=bodies("chat"))
def test_fuzz_chat(server, body):
    _check(server, "/v1/chat/completions", body)


@pytest.mark.slow
@settings(max_examples=LONG_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(body=st.one_of(bodies("completions"), bodies("chat")), chat=st.booleans())
def test_fuzz_both_endpoints_longer(server, body, chat):
    _check(server, "/v1/chat/completions" if chat else "/v1/completions", body)


# -- structured outputs and tool calling: random schemas, regexes, grammars, tool lists -----------
_names = st.text(alphabet="abcdefgh_", min_size=1, max_size=6)
_leaf_schemas = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["string", "integer", "number", "boolean", "null", "strin"])},
                          optional={"maxLength": st.integers(-1, 6), "minLength": st.integers(0, 3),
                                    "minimum": st.integers(-5, 5), "maximum": st.integers(-5, 50),
                                    "pattern": st.text(alphabet="ab[]()*+?^$|\\.", max_size=6),
                                    "format": st.sampled_from(["date", "email", "uuid", "bogus"])}),
    st.fixed_dictionaries({"enum": st.lists(st.one_of(st.text(max_size=4), st.integers(0, 9)), max_size=3)}),
    st.fixed_dictionaries({"const": json_values}), st.just({}), st.just({"not": {}}),
    st.fixed_dictionaries({"$ref": st.sampled_from(["#/$defs/x", "#", "#/nope"])}),
)
schemas = st.recursive(_leaf_schemas, lambda inner: st.one_of(
    st.fixed_dictionaries({"type": st.just("object"), "properties": st.dictionaries(_names, inner, max_size=3)},
                          optional={"required": st.lists(_names, max_size=3),
                                    "additionalProperties": st.one_of(st.booleans(), inner)}),
    st.fixed_dictionaries({"type": st.just("array"), "items": inner},
                          optional={"maxItems": st.integers(0, 3), "minItems": st.integers(0, 2)}),
    st.fixed_dictionaries({"anyOf": st.lists(inner, min_size=1, max_size=3)}),
    st.fixed_dictionaries({"oneOf": st.lists(inner, min_size=1, max_size=2)})), max_leaves=6)
regexes = st.one_of(st.text(alphabet="ab01()[]{}*+?|\\.^$-,dws", max_size=12),
                    st.sampled_from([r"[a-z]{2,5}", r"(ab|cd)+e?", r"\d{1,3}(\.\d+)?", r"a{1000}{1000}", r"(a*)*b"]))
grammars = st.one_of(st.text(max_size=30), st.sampled_from([
    'root ::= "yes" | "no"', 'root ::= [a-c]+ "!"', "start: /[0-9]+/ (\",\" /[0-9]+/)*", "root ::= (", "start: x"]))
tools = st.lists(st.one_of(
    st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
        {"name": _names}, optional={"parameters": schemas, "description": st.text(max_size=10)})}),
    json_values), max_size=3)
tool_choices = st.one_of(st.sampled_from(["none", "auto", "required", "bogus"]), json_values,
                         st.fixed_dictionaries({"type": st.just("function"),
                                                "function": st.fixed_dictionaries({"name": _names})}))
structured = st.one_of(
    st.fixed_dictionaries({}, optional={"json": st.one_of(schemas, json_values), "regex": regexes,
                                        "choice": st.one_of(st.lists(st.text(max_size=5), max_size=3), json_values),
                                        "grammar": grammars, "json_object": st.booleans(),
                                        "disable_any_whitespace": st.one_of(st.booleans(), json_values)}),
    json_values)
response_formats = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["json_object", "json_schema", "text", "grammar"])},
                          optional={"json_schema": st.fixed_dictionaries(
                              {"name": st.text(max_size=5)}, optional={"schema": schemas, "strict": st.booleans()})}),
    json_values)


def structured_bodies(chat: bool):
    base = {"max_tokens": st.integers(1, 12), "model": st.just("qwen-tiny")}
    if chat:
        base["messages"] = st.just([{"role": "user", "content": "hi"}])
        optional = {"tools": tools, "tool_choice": tool_choices, "parallel_tool_calls": st.booleans(),
                    "response_format": response_formats, "structured_outputs": structured,
                    "stream": st.booleans(), "temperature": st.floats(0, 1.5), "seed": st.integers(0, 99),
                    "n": st.integers(1, 2)}
    else:
        base["prompt"] = st.text(min_size=1, max_size=12)
        optional = {"structured_outputs": structured, "stream": st.booleans(), "temperature": st.floats(0, 1.5),
                    "seed": st.integers(0, 99)}
    return st.fixed_dictionaries(base, optional=optional)


@FUZZ
@given(body=structured_bodies(chat=True))
def test_fuzz_tool_calls_and_structured_outputs_chat(tool_server, body):
    _check(tool_server, "/v1/chat/completions", body)


@FUZZ
@given(body=structured_bodies(chat=False))
def test_fuzz_structured_outputs_completions(tool_server, body):
    _check(tool_server, "/v1/completions", body)
