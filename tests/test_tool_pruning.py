"""Cache-aware tool pruning: relevance ranking alone, then through real HTTP (the official
``openai`` client against the shared tool server): ``prune`` renders the kept tools only,
``mask`` keeps the catalogue and constrains the call, bad values are 400s."""

from __future__ import annotations

import json
import uuid

import httpx
import pytest
from tokenizers import Tokenizer

from tailserve.bench.agentic import ACTIONS, SERVICES
from tailserve.sampling_params import StructuredOutputsParams as SO
from tailserve.server.tool_pruning import ToolPruning, ToolRanker, relevance_query
from tailserve.structured.tool_parsers import get_tool_parser

BS = 16


def _catalogue(n: int = 40) -> list[dict]:
    """Compact tools named and described after services (40 fit the test model's context)."""
    tools = []
    for service, words in SERVICES:
        for action, _ in ACTIONS:
            tools.append({"type": "function", "function": {
                "name": f"{service}_{action}", "description": f"{action} {service} {words[0]}",
                "parameters": {"type": "object", "properties": {words[1]: {"type": "string"}}}}})
    return tools[:n]


CATALOGUE = _catalogue()
ASK = "What is the weather forecast and the temperature in Paris?"


def test_the_relevant_tools_are_kept_in_the_catalogues_order():
    ranker = ToolRanker()
    msgs = [{"role": "user", "content": ASK}]
    r = ranker.select(CATALOGUE, msgs, ToolPruning("prune", 5))
    assert len(r.kept) == 5 and r.dropped == 35 and list(r.kept) == sorted(r.kept)
    assert {n for n in r.names if n.startswith("weather_")} == {f"weather_{a}" for a, _ in ACTIONS}
    # A tool result after the last user message counts too.
    msgs += [{"role": "assistant", "content": "checking"}, {"role": "tool", "content": "git commit branch merged"}]
    assert relevance_query(msgs).endswith("git commit branch merged")
    assert any(n.startswith("git_") for n in ranker.select(CATALOGUE, msgs, ToolPruning("prune", 8)).names)
    # tool_choice naming a tool keeps it; max_tools past the catalogue keeps everything.
    assert "maps_update" in ranker.select(CATALOGUE, msgs[:1], ToolPruning("prune", 5), must_keep="maps_update").names
    assert ranker.select(CATALOGUE, msgs, ToolPruning("prune", 99)).dropped == 0


@pytest.fixture(scope="module")
def client(tool_server):
    from openai import OpenAI

    return OpenAI(base_url=tool_server.url + "/v1", api_key="none", max_retries=0)


def _chat(client, messages, pruning=None, tool_choice="none", tools=CATALOGUE, **kw):
    extra = {"tool_pruning": pruning} if pruning is not None else None
    return client.chat.completions.create(model="qwen-tiny", messages=messages, tools=tools, tool_choice=tool_choice,
                                          max_tokens=kw.pop("max_tokens", 2), temperature=0, extra_body=extra, **kw)


def _messages(*more: dict) -> list[dict]:
    return [{"role": "system", "content": f"Agent {uuid.uuid4().hex}."}, {"role": "user", "content": ASK}, *more]


def test_prune_keeps_the_relevant_tool_cuts_the_prompt_and_keeps_the_prefix_across_turns(client):
    messages = _messages()
    full = _chat(client, messages)
    r = _chat(client, messages, {"mode": "prune", "max_tools": 4})
    tp = r.tool_pruning
    assert tp["mode"] == "prune" and tp["dropped"] == 36 and any(n.startswith("weather_") for n in tp["kept"])
    assert r.usage.prompt_tokens < full.usage.prompt_tokens / 2
    assert tp["prompt_tokens_saved"] == full.usage.prompt_tokens - r.usage.prompt_tokens
    # The next turn (the answer and a tool result appended) keeps the same tools: the cache holds.
    turn2 = [*messages, {"role": "assistant", "content": "Let me look."},
             {"role": "user", "content": "The weather forecast result: rain, temperature 12."}]
    r2 = _chat(client, turn2, {"mode": "prune", "max_tools": 4})
    assert r2.tool_pruning["kept"] == tp["kept"]
    assert r2.usage.prompt_tokens_details.cached_tokens >= (r.usage.prompt_tokens - 1) // BS * BS - BS


def test_mask_keeps_the_prompt_and_its_cache_and_a_required_call_names_a_kept_tool(client):
    messages = _messages()
    full = _chat(client, messages)
    bounded = [{**t, "function": {**t["function"], "parameters": {
        "type": "object", "additionalProperties": False, "properties": {}}}} for t in CATALOGUE]
    r = _chat(client, messages, {"mode": "mask", "max_tools": 3}, tool_choice="required", tools=bounded,
              max_tokens=64)
    assert r.usage.prompt_tokens == _chat(client, messages, tools=bounded).usage.prompt_tokens
    assert r.tool_pruning["prompt_tokens_saved"] == 0 and len(r.tool_pruning["kept"]) == 3
    assert r.choices[0].finish_reason == "tool_calls"
    assert all(c.function.name in r.tool_pruning["kept"] for c in r.choices[0].message.tool_calls)
    masked = _chat(client, messages, {"mode": "mask", "max_tools": 3})
    assert masked.usage.prompt_tokens == full.usage.prompt_tokens
    assert masked.usage.prompt_tokens_details.cached_tokens == (full.usage.prompt_tokens - 1) // BS * BS


def test_mask_under_auto_keeps_the_prompt_and_lets_a_call_name_only_a_kept_tool(client, chat_checkpoint):
    # The random-weight model is pushed to open a call (its marker is one token here); what it
    # may write after the marker is the grammar's business.
    marker = Tokenizer.from_file(str(chat_checkpoint / "tokenizer.json")).token_to_id("<tool_call>")
    messages = _messages()
    bounded = [{**t, "function": {**t["function"], "parameters": {
        "type": "object", "additionalProperties": False, "properties": {}}}} for t in CATALOGUE]
    r = _chat(client, messages, {"mode": "mask", "max_tools": 3}, tool_choice="auto", tools=bounded, max_tokens=96,
              parallel_tool_calls=False, logit_bias={str(marker): 100})
    assert r.usage.prompt_tokens == _chat(client, messages, tools=bounded, tool_choice="auto").usage.prompt_tokens
    calls = r.choices[0].message.tool_calls
    assert calls and len(calls) == 1 and calls[0].function.name in r.tool_pruning["kept"], r.choices[0]
    assert r.choices[0].finish_reason == "tool_calls"
    chunks = list(_chat(client, messages, {"mode": "mask", "max_tools": 3}, tool_choice="auto", tools=bounded,
                        max_tokens=96, parallel_tool_calls=False, logit_bias={str(marker): 100}, stream=True))
    names = [tc.function.name for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []
             if tc.function and tc.function.name]
    assert names == [calls[0].function.name]
    # Without the bias the same request may answer in prose: the grammar does not force a call.
    plain = _chat(client, messages, {"mode": "mask", "max_tools": 3}, tool_choice="auto", tools=bounded, max_tokens=8)
    assert plain.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_a_named_tool_choice_keeps_a_tool_pruning_would_drop(client):
    r = _chat(client, _messages(), {"mode": "prune", "max_tools": 2}, max_tokens=64,
              tool_choice={"type": "function", "function": {"name": "maps_update"}})
    assert "maps_update" in r.tool_pruning["kept"] and len(r.tool_pruning["kept"]) == 2


@pytest.mark.parametrize("body, message", [
    ({"tool_pruning": {"mode": "sometimes"}}, "must be one of off, prune, mask"),
    ({"tool_pruning": {"mode": "prune", "max_tools": 0}}, "positive integer"),
    ({"tool_pruning": "prune"}, "must be an object"),
    ({"tool_pruning": {"mode": "prune", "keep": 3}}, "unknown field"),
    ({"tool_pruning": {"mode": "mask", "max_tools": 1}, "response_format": {"type": "json_object"}},
     "cannot be combined"),
    ({"tool_pruning": {"mode": "prune"}, "tools": None}, "needs tools"),
])
def test_bad_tool_pruning_is_a_400_naming_the_field(tool_server, body, message):
    req = {"model": "qwen-tiny", "messages": [{"role": "user", "content": ASK}], "tools": CATALOGUE[:3], **body}
    r = httpx.post(tool_server.url + "/v1/chat/completions", json=req)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "tool_pruning" and message in err["message"]


# -- the call grammar that "mask" uses under tool_choice "auto" ---------------------------------
@pytest.fixture(scope="module")
def builtin_compiler():
    """llguidance over the built-in model's tokenizer, where "<tool_call>" is several tokens."""
    from tailserve.assets import DEFAULT_TARGET_DIR
    from tailserve.structured.grammar import GrammarCompiler

    path = DEFAULT_TARGET_DIR / "tokenizer.json"
    return GrammarCompiler(path.read_text, 4096, [1]), Tokenizer.from_file(str(path))


def _walk(compiler_and_tok, grammar: str, text: str) -> str:
    """'accepted' when the grammar takes ``text`` then the end of the output, else where it refused."""
    compiler, tok = compiler_and_tok
    m = compiler.compile(SO(grammar=grammar, param="tools")).start()
    ids = tok.encode(text, add_special_tokens=False).ids
    for i, t in enumerate(ids):
        if not m.consume_token(t):
            return f"refused after {tok.decode(ids[:i])!r}"
    return "accepted" if m.consume_token(1) else "refused the end"


KEPT = [t for t in CATALOGUE if t["function"]["name"] in ("weather_search", "weather_update")]


def _call(name: str, key: str = "arguments") -> str:
    return json.dumps({"name": name, key: {"city": "Paris"}})


def test_the_hermes_call_grammar_leaves_prose_free_and_calls_to_the_kept_tools(builtin_compiler):
    hermes, ref = get_tool_parser("hermes"), builtin_compiler[0].token_ref
    assert ref("<tool_call>") is None  # spelled out: the grammar's stop, not a token reference
    one, many = hermes.call_grammar(KEPT, False, ref), hermes.call_grammar(KEPT, True, ref)
    assert _walk(builtin_compiler, one, "It rains in Paris, 12 degrees.\nNo tool needed.") == "accepted"
    call = f"<tool_call>\n{_call('weather_search')}\n</tool_call>"
    assert _walk(builtin_compiler, one, "Let me check. " + call + "\n") == "accepted"
    # Negative controls: a tool outside the kept set, junk after the marker, a marker left open.
    assert _walk(builtin_compiler, one, f"<tool_call>\n{_call('git_search')}\n</tool_call>").startswith("refused")
    assert _walk(builtin_compiler, one, "x <tool_call> never mind").startswith("refused")
    assert _walk(builtin_compiler, one, "x <tool_call>") == "refused the end"
    two = call + f"\n<tool_call>\n{_call('weather_update')}\n</tool_call>"
    assert _walk(builtin_compiler, one, two).startswith("refused")
    assert _walk(builtin_compiler, many, two) == "accepted"
    # The grammar's calls read back through the parser they were written for.
    assert [c.name for c in hermes.extract(two)[1]] == ["weather_search", "weather_update"]


def test_the_llama3_json_call_grammar_takes_prose_or_calls_to_the_kept_tools(builtin_compiler):
    ref = builtin_compiler[0].token_ref
    g = get_tool_parser("llama3_json").call_grammar(KEPT, True, ref)
    assert _walk(builtin_compiler, g, "The forecast says rain.") == "accepted"
    assert _walk(builtin_compiler, g, _call("weather_update", "parameters")) == "accepted"
    assert _walk(builtin_compiler, g, f"{_call('weather_update', 'parameters')}; "
                                      f"{_call('weather_search', 'parameters')}") == "accepted"
    assert _walk(builtin_compiler, g, _call("git_search", "parameters")).startswith("refused")
    assert get_tool_parser("mistral").call_grammar(KEPT, True, ref) is None  # no [TOOL_CALLS] token here
