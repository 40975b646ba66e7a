"""Tool calling and structured outputs over HTTP: the parsers and forced-call readers alone,
the chat template with tools, then the official ``openai`` client against ``tailserve serve``
(the chat checkpoint: random weights, a Qwen-style template, auto tool choice with the
hermes parser) and an OpenAI Agents SDK tool loop."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import jsonschema
import pytest

from tailserve.structured.tool_parsers import (
    ForcedCalls,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    forced_call_schema,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 16},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                                       "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}}}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _stream_through(stream, text: str, step: int = 3):
    content, deltas = "", []
    for i in range(0, len(text), step):
        c, d = stream.feed(text[i : i + step])
        content += c
        deltas += d
    c, d = stream.finish()
    return content + c, deltas + d


def _reassemble(deltas) -> list[tuple[str, str]]:
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if d.id is not None:
            calls[d.index] = [d.name, ""]
        calls[d.index][1] += d.arguments
    return [tuple(calls[i]) for i in sorted(calls)]


# -- parsers, alone ----------------------------------------------------------------------------
HERMES_TEXT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
               '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')


@pytest.mark.parametrize("parser, text, content", [
    (HermesToolParser(), HERMES_TEXT, "Let me check."),
    (Llama3JsonToolParser(), '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": '
                             '"celsius"}}; {"name": "get_time", "parameters": {"zone": "CET"}}', None),
    (MistralToolParser(), 'Sure [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
                          '"celsius"}}, {"name": "get_time", "arguments": {"zone": "CET"}}]', "Sure"),
    (MistralToolParser(), '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}'
                          '[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}', None),
])
def test_parsers_extract_calls_whole_and_streamed(parser, text, content):
    want = [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"zone": "CET"})]
    got_content, calls = parser.extract(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == want
    assert len({c.id for c in calls}) == 2
    streamed, deltas = _stream_through(parser.stream(), text)
    assert streamed.strip() == (content or "")
    assert "<tool_call>" not in streamed and "[TOOL_CALLS]" not in streamed and "python_tag" not in streamed
    assert [(n, json.loads(a)) for n, a in _reassemble(deltas)] == want
    if isinstance(parser, MistralToolParser):
        assert all(re.fullmatch(r"[A-Za-z0-9]{9}", c.id) for c in calls)


@pytest.mark.parametrize("parser, text", [
    (HermesToolParser(), "no calls here, just <tool_ text"),
    (HermesToolParser(), "<tool_call>{not json}</tool_call>"),
    (Llama3JsonToolParser(), "The answer is {\"name\": 3}"),
    (Llama3JsonToolParser(), '{"city": "Paris"}'),
    (MistralToolParser(), "[TOOL_CALLS] oops"),
])
def test_text_that_is_not_a_call_stays_content(parser, text):
    assert parser.extract(text) == (text, [])
    streamed, deltas = _stream_through(parser.stream(), text, step=2)
    assert streamed == text and deltas == []


def test_forced_calls_read_back_whole_and_streamed():
    text = ('[{"name":"get_weather","arguments":{"city":"a}b\\"{","unit":"celsius"}},'
            '{"name":"get_time","arguments":{"zone":"UTC"}}]')
    want = [("get_weather", {"city": 'a}b"{', "unit": "celsius"}), ("get_time", {"zone": "UTC"})]
    assert [(c.name, json.loads(c.arguments)) for c in ForcedCalls(None).calls(text)] == want
    fc = ForcedCalls(None)
    deltas = []
    for i in range(0, len(text), 2):
        deltas += fc.feed(text[i : i + 2])
    assert [(n, json.loads(a)) for n, a in _reassemble(deltas)] == want
    assert deltas[0].id is not None and deltas[0].name == "get_weather"  # id and name before any argument
    named = ForcedCalls("get_time")
    deltas = named.feed("") + named.feed('{"zone":') + named.feed('"UTC"}')
    assert _reassemble(deltas) == [("get_time", '{"zone":"UTC"}')]
    # Cut by max_tokens: the calls completed so far; a named call's unfinished arguments: none.
    cut = ForcedCalls(None).calls('[{"name":"get_time","arguments":{"zone":"UTC"}},{"name":"get_weather","argu')
    assert [(c.name, json.loads(c.arguments)) for c in cut] == [("get_time", {"zone": "UTC"})]
    assert ForcedCalls("get_time").calls('{"zone":"UT') == []


def test_forced_schema_allows_one_call_unless_parallel():
    one = forced_call_schema(TOOLS, None, parallel=False)
    assert one["maxItems"] == 1 and len(one["items"]["anyOf"]) == 2
    assert "maxItems" not in forced_call_schema(TOOLS, None, parallel=True)
    assert forced_call_schema(TOOLS, "get_time", parallel=True) == SCHEMAS["get_time"]


def test_template_renders_tools_and_the_round_trip(chat_checkpoint):
    from tailserve.model.tokenizer import Tokenizer
    from tailserve.server.chat import ChatTemplate
    from tailserve.server.protocol import chat_request

    tok = Tokenizer(chat_checkpoint)
    creq = chat_request({"messages": [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}], "tools": TOOLS, "tool_choice": "none"})
    text = tok.decode(ChatTemplate(tok).render(creq.messages, creq.tools), skip_special_tokens=False)
    assert '"name": "get_weather"' in text and '"maxLength": 16' in text  # the tool list, as JSON
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")


# -- over HTTP, with the official client ----------------------------------------------------------
@pytest.fixture(scope="module")
def client(tool_server):
    from openai import OpenAI

    return OpenAI(base_url=tool_server.url + "/v1", api_key="none", max_retries=0)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_a_named_tool_choice_returns_schema_valid_arguments(client, seed):
    r = client.chat.completions.create(model="qwen-tiny", messages=ASK, tools=TOOLS, temperature=1.0, seed=seed,
                                       max_tokens=80, tool_choice={"type": "function",
                                                                   "function": {"name": "get_weather"}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_weather"])


# Seeds whose sampled call (a random tiny model at temperature 1) ends within max_tokens;
# seed 2 writes a string argument past 120 tokens since seeded sampling became a race.
@pytest.mark.parametrize("seed", [0, 1, 3])
def test_required_tool_choice_calls_some_tool_with_valid_arguments(client, seed):
    r = client.chat.completions.create(model="qwen-tiny", messages=ASK, tools=TOOLS, temperature=1.0, seed=seed,
                                       max_tokens=120, tool_choice="required", parallel_tool_calls=True)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and calls
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_a_streamed_call_reassembles_to_the_same_call(client, tool_choice):
    kw = dict(model="qwen-tiny", messages=ASK, tools=TOOLS, temperature=1.0, seed=5, max_tokens=120,
              tool_choice=tool_choice, parallel_tool_calls=False)
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls[0]
    name, args, ids, content, finish = None, "", set(), "", None
    for chunk in client.chat.completions.create(**kw, stream=True):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            assert tc.index == 0
            if tc.id is not None:
                assert name is None and args == ""  # id and name come first, then the arguments
                ids.add(tc.id)
                name = tc.function.name
            args += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert content == "" and finish == "tool_calls" and len(ids) == 1
    assert name == whole.function.name and json.loads(args) == json.loads(whole.function.arguments)


def test_response_format_json_schema_and_json_object_parse(client):
    schema = {"type": "object", "additionalProperties": False, "required": ["answer", "score"],
              "properties": {"answer": {"type": "string", "maxLength": 20}, "score": {"type": "integer"}}}
    r = client.chat.completions.create(model="qwen-tiny", messages=ASK, max_tokens=80, seed=0, temperature=1.0,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "reply", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    assert r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(model="qwen-tiny", messages=ASK, max_tokens=200, seed=1, temperature=0.8,
                                       response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # cut by max_tokens: still a prefix of a JSON object
        assert r.choices[0].message.content.startswith("{")


def test_structured_outputs_choice_and_regex_on_both_endpoints(client):
    r = client.chat.completions.create(model="qwen-tiny", messages=ASK, max_tokens=10, temperature=1.0, seed=2,
                                       extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert r.choices[0].message.content in ("yes", "no")
    r = client.completions.create(model="qwen-tiny", prompt="Mail: ", max_tokens=30, temperature=1.0, seed=3, n=3,
                                  extra_body={"structured_outputs": {"regex": r"[a-z]{3,6}@[a-z]{3}\.com"}})
    for c in r.choices:
        assert re.fullmatch(r"[a-z]{3,6}@[a-z]{3}\.com", c.text), c.text


def test_logprobs_of_tokens_a_grammar_forbids_are_valid_json(client):
    # Under a grammar the masked tokens have probability zero: -inf, which JSON cannot carry (a
    # 500 before). They read -9999.0, as in vLLM's OpenAI server, and the top list keeps its length.
    so = {"structured_outputs": {"choice": ["yes"]}}
    r = client.chat.completions.create(model="qwen-tiny", messages=ASK, max_tokens=10, temperature=0, logprobs=True,
                                       top_logprobs=5, extra_body=so)
    content = r.choices[0].logprobs.content
    assert r.choices[0].message.content == "yes" and content
    for e in content:
        assert e.logprob == pytest.approx(0.0, abs=1e-5) and len(e.top_logprobs) == 5
        assert [t.logprob for t in e.top_logprobs[1:]] == [-9999.0] * 4
    chunks = client.chat.completions.create(model="qwen-tiny", messages=ASK, max_tokens=10, temperature=0,
                                            logprobs=True, top_logprobs=3, extra_body=so, stream=True)
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert all(t.logprob == -9999.0 for e in streamed for t in e.top_logprobs[1:])
    r = client.completions.create(model="qwen-tiny", prompt="Answer: ", max_tokens=10, temperature=0, logprobs=3,
                                  extra_body=so)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == "yes" and all(v == pytest.approx(0.0, abs=1e-5) for v in lp.token_logprobs)
    assert all(sorted(top.values())[:2] == [-9999.0, -9999.0] for top in lp.top_logprobs)


def test_streamed_structured_output_concatenates_to_valid_json(client):
    schema = {"type": "object", "required": ["n"], "additionalProperties": False,
              "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}}}
    text = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        model="qwen-tiny", messages=ASK, max_tokens=40, stream=True, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}) if ch.choices)
    jsonschema.validate(json.loads(text), schema)


def test_a_tool_round_trip_renders_and_answers(client):
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                           "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    r = client.chat.completions.create(model="qwen-tiny", messages=messages, tools=TOOLS, max_tokens=12,
                                       temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    # The call and its result were rendered into the prompt, beyond the question and the tools.
    alone = client.chat.completions.create(model="qwen-tiny", messages=ASK, tools=TOOLS, max_tokens=1,
                                           temperature=0, tool_choice="none")
    assert r.usage.prompt_tokens > alone.usage.prompt_tokens + 20
    assert r.usage.completion_tokens > 0 and choice.message.content is not None


def test_auto_returns_content_and_never_drops_unreadable_markup(client, tool_server):
    r = client.chat.completions.create(model="qwen-tiny", messages=ASK, tools=TOOLS, max_tokens=16, temperature=1.0,
                                       seed=0, extra_body={"skip_special_tokens": False})
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    # Push the model to open a call it cannot write: the text stays content, markup included.
    tok = httpx.post(tool_server.url + "/tokenize", json={"prompt": "<tool_call>", "add_special_tokens": False}).json()
    (tc,) = tok["tokens"]
    r = client.chat.completions.create(model="qwen-tiny", messages=ASK, tools=TOOLS, max_tokens=8, temperature=0,
                                       logit_bias={str(tc): 100})
    assert r.choices[0].message.content.startswith("<tool_call>") and r.choices[0].message.tool_calls is None


@pytest.mark.parametrize("body, param, message", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not in tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice", "has no tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objec"}}}],
      "tool_choice": "required"}, "tools", "invalid JSON schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", "invalid JSON schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}},
     "response_format", "Unimplemented keys"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "invalid regex"),
    ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs", "invalid grammar"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs", "not supported"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"choice": ["a"]}}, "response_format",
     "not both"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot be combined"),
])
def test_bad_tool_and_format_requests_get_a_400_naming_the_field(tool_server, body, param, message):
    r = httpx.post(tool_server.url + "/v1/chat/completions", json={"model": "qwen-tiny", "messages": ASK, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and message in err["message"], err


def test_auto_tool_choice_without_the_server_flag_says_what_to_do(tiny_server):
    r = httpx.post(tiny_server.url + "/v1/chat/completions",
                   json={"model": "tiny", "messages": ASK, "tools": TOOLS, "max_tokens": 4})
    assert r.status_code == 400 and "--enable-auto-tool-choice" in r.json()["error"]["message"]
    # Forced calls need no parser: they are generated under the schema.
    r = httpx.post(tiny_server.url + "/v1/chat/completions",
                   json={"model": "tiny", "messages": ASK, "tools": [TIME], "tool_choice": "required",
                         "max_tokens": 60, "temperature": 0})
    assert r.status_code == 200, r.text
    for call in r.json()["choices"][0]["message"]["tool_calls"]:
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])


# -- an agent framework -----------------------------------------------------------------------------
def test_an_agents_sdk_tool_loop_runs_against_the_server(tool_server):
    """OpenAI Agents SDK, chat-completions model: turn one must call the tool (tool_choice
    required), the SDK runs it and sends the result back; turn two (the SDK resets
    tool_choice to auto after a call) answers in text."""
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    seen: list[str] = []

    # An enum keeps the random model's argument short (an unbounded string it may never close).
    @agents.function_tool
    def get_weather(city: Literal["Paris", "London", "Tokyo"]) -> str:
        """The weather in a city."""
        seen.append(city)
        return f"sunny in {city}"

    model = agents.OpenAIChatCompletionsModel(
        model="qwen-tiny", openai_client=AsyncOpenAI(base_url=tool_server.url + "/v1", api_key="none", max_retries=0))
    agent = agents.Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather], model=model,
                         model_settings=agents.ModelSettings(tool_choice="required", max_tokens=160, temperature=1.0,
                                                                       parallel_tool_calls=False,
                                                                       extra_body={"seed": 0}))
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4)
    assert len(seen) == 1 and seen[0] in ("Paris", "London", "Tokyo")
    assert isinstance(result.final_output, str)
    kinds = [type(item).__name__ for item in result.new_items]
    assert "ToolCallItem" in kinds and "ToolCallOutputItem" in kinds and kinds[-1] == "MessageOutputItem"
