"""Tool calls: what a model wrote -> message content and OpenAI ``tool_calls``.

Two routes, as vLLM has them:

- **Forced** (``tool_choice`` ``"required"`` or a named function): the output is generated
  under a JSON schema (``forced_call_schema``), so it is always a valid call whatever the
  model: for a named function the arguments object itself, under the function's
  ``parameters``; for ``"required"`` an array of ``{"name", "arguments"}`` objects, one
  ``anyOf`` branch per tool. ``ForcedCalls`` reads that back, whole or streamed.
- **Auto** (``--enable-auto-tool-choice --tool-call-parser NAME``): the model writes calls in
  its own markup and a parser finds them: ``hermes`` (Qwen2.5/Qwen3, Hermes:
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``), ``llama3_json`` (a JSON
  object ``{"name", "parameters"}`` at the start of the output, ``;``-separated, after an
  optional ``<|python_tag|>``), ``mistral`` (``[TOOL_CALLS]`` then a JSON array, or
  ``name[ARGS]{...}`` in the v11 tokenizers). Text the parser cannot read as calls stays
  content: nothing is dropped.
- **Auto, constrained** (tool pruning's ``mask`` under ``auto``): the parser's own markup as a
  grammar (``ToolParser.call_grammar``): free text with no call marker in it, or text up to
  the marker and then calls whose JSON names only the allowed tools. The model may still
  answer in prose; what it cannot do is call a tool outside the set. All three parsers
  have one (Mistral's only where ``[TOOL_CALLS]`` is a token, as in every Mistral tokenizer).

Streaming never lets markup into ``delta.content``: text that could be the start of a
call marker is held back until it is known not to be one, and a call is sent (id and name
first, then its arguments) once it is complete.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

# A marker's text -> a grammar reference to the one special token it is, or None (plain text).
TokenRef = Callable[[str], str | None]


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolCallDelta:
    """One streamed piece of a call: the first carries id, type and name; later ones more
    of the arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        fn: dict[str, Any] = {"arguments": self.arguments}
        if self.id is not None:
            out["id"], out["type"] = self.id, "function"
            fn["name"] = self.name
        out["function"] = fn
        return out


def call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _arguments_text(args: Any) -> str | None:
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return json.dumps(args, ensure_ascii=False)


def _call_from(obj: Any, new_id) -> ToolCall | None:
    """{"name": ..., "arguments" | "parameters": {...}} -> a call, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    text = _arguments_text(args)
    return None if text is None else ToolCall(obj["name"], text, new_id())


def _held_back(text: str, marker: str) -> int:
    """How many trailing characters of ``text`` could be the start of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolParser:
    """One model family's tool-call markup. ``extract`` reads a whole output; ``stream``
    returns a ``ToolCallStream`` for one streamed choice."""

    name: ClassVar[str]
    marker: ClassVar[str]
    # The markup is a special token that skip_special_tokens would remove from the text.
    needs_special_tokens: ClassVar[bool] = False

    def new_id(self) -> str:
        return call_id()

    def find_start(self, text: str) -> int | None:
        """Where the calls begin in ``text`` (None: not seen yet)."""
        i = text.find(self.marker)
        return None if i < 0 else i

    def hold_back(self, text: str) -> int:
        """Trailing characters of ``text`` to hold back: they may begin a call."""
        return _held_back(text, self.marker)

    def parse_calls(self, region: str) -> list[ToolCall]:
        """The calls in ``region`` (the text from the marker on); [] if none can be read."""
        raise NotImplementedError

    def complete_calls(self, region: str) -> list[ToolCall]:
        """The calls already complete in a region still being streamed."""
        return []

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        start = self.find_start(text)
        if start is None:
            return text, []
        calls = self.parse_calls(text[start:])
        if not calls:
            return text, []
        content = text[:start].strip()
        return content or None, calls

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)

    def call_grammar(self, tools: list[dict[str, Any]], parallel: bool, token_ref: TokenRef) -> str | None:
        """An llguidance Lark grammar for this markup, prose or calls that name only ``tools``
        (None: this parser cannot have one with this tokenizer). ``token_ref`` writes a
        marker as a special-token reference where the tokenizer has it as one."""
        return None


# Whitespace between the markup's parts is bounded, and the calls' JSON is written the way the
# chat templates render calls (``tojson``: ", " and ": "): a model that kept writing spaces
# would otherwise never reach the end of its call.
_WS = "/\\s{0,4}/"
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _lark_json(schema: dict[str, Any]) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": _JSON_LAYOUT}, separators=(",", ":"))


class HermesToolParser(ToolParser):
    name = "hermes"
    marker = "<tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def _blocks(self, region: str, complete_only: bool) -> list[ToolCall]:
        calls = []
        ends = 0
        for m in self._BLOCK.finditer(region):
            ends = m.end()
            try:
                call = _call_from(json.loads(m.group(1)), self.new_id)
            except ValueError:
                call = None
            if call is not None:
                calls.append(call)
        if not complete_only:
            rest = region[ends:]
            i = rest.find(self.marker)
            if i >= 0:  # an unterminated last call (the output ended inside it)
                try:
                    call = _call_from(json.loads(rest[i + len(self.marker):].strip()), self.new_id)
                except ValueError:
                    call = None
                if call is not None:
                    calls.append(call)
        return calls

    def parse_calls(self, region: str) -> list[ToolCall]:
        return self._blocks(region, complete_only=False)

    def complete_calls(self, region: str) -> list[ToolCall]:
        return self._blocks(region, complete_only=True)

    def call_grammar(self, tools: list[dict[str, Any]], parallel: bool, token_ref: TokenRef) -> str | None:
        more = " more*" if parallel else ""
        close = token_ref("</tool_call>") or '"</tool_call>"'
        open_ = token_ref(self.marker)
        if open_ is not None:  # Qwen: the markers are tokens, which TEXT's regex can never produce
            head = [f"start: TEXT | TEXT {open_} call{more} {_WS}", "TEXT: /(.|\\n)*/", f"more: {_WS} {open_} call"]
        else:
            # TEXT: a whole answer with no marker in it. Else the text up to the marker (a stop:
            # the marker ends it, generated but not part of it), then the call.
            head = [f"start: TEXT | text call{more} {_WS}", "TEXT: /(.|\\n)*/ & ~/(.|\\n)*<tool_call>(.|\\n)*/",
                    "text[stop=/<tool_call>/]: /(.|\\n)*/", f'more: {_WS} "<tool_call>" call']
        return "\n".join((*head, f"call: {_WS} call_json {_WS} {close}",
                          "call_json: " + _lark_json(call_object_schema(tools, "arguments"))))


def _json_sequence(text: str, separator: str) -> list[Any] | None:
    """JSON values one after another, ``separator`` (and whitespace) between them; None if
    anything else is in the text."""
    dec = json.JSONDecoder()
    values, i, n = [], 0, len(text)
    while True:
        while i < n and text[i].isspace():
            i += 1
        if i >= n:
            return values or None
        try:
            value, i = dec.raw_decode(text, i)
        except ValueError:
            return None
        values.append(value)
        while i < n and text[i].isspace():
            i += 1
        if i < n:
            if not text.startswith(separator, i):
                return None
            i += len(separator)


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    marker = "<|python_tag|>"
    needs_special_tokens = True

    def find_start(self, text: str) -> int | None:
        # Calls are the whole output: a JSON object (or the python tag) first thing.
        stripped = text.lstrip()
        if stripped.startswith(self.marker) or stripped.startswith("{"):
            return len(text) - len(stripped)
        return None

    def hold_back(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or self.marker.startswith(stripped):
            return len(text)  # nothing yet, or maybe the tag: wait
        return 0

    def parse_calls(self, region: str) -> list[ToolCall]:
        region = region.strip()
        if region.startswith(self.marker):
            region = region[len(self.marker):]
        values = _json_sequence(region, ";")
        if not values:
            return []
        calls = [_call_from(v, self.new_id) for v in values]
        return [] if any(c is None for c in calls) else calls  # type: ignore[misc]

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self, only_at_start=True)

    def call_grammar(self, tools: list[dict[str, Any]], parallel: bool, token_ref: TokenRef) -> str | None:
        # Calls are the whole output (Meta's JSON format names the arguments "parameters"),
        # after the python tag where the tokenizer has it; TEXT is any answer that does not
        # open with a JSON object.
        tag = token_ref(self.marker)
        more = " (/\\s{0,4};\\s{0,4}/ call_json)*" if parallel else ""
        return "\n".join((
            f"start: TEXT | {_WS} {tag + '? ' if tag else ''}call_json{more} {_WS}",
            "TEXT: /(.|\\n)*/ & ~/\\s*\\{(.|\\n)*/",
            "call_json: " + _lark_json(call_object_schema(tools, "parameters"))))


class MistralToolParser(ToolParser):
    name = "mistral"
    marker = "[TOOL_CALLS]"
    needs_special_tokens = True
    _ALNUM = string.ascii_letters + string.digits

    def new_id(self) -> str:
        return "".join(secrets.choice(self._ALNUM) for _ in range(9))  # Mistral's templates check 9

    def parse_calls(self, region: str) -> list[ToolCall]:
        body = region[len(self.marker):].strip()
        if body.startswith("["):  # v3: [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]
            try:
                values = json.loads(body)
            except ValueError:
                return []
            calls = [_call_from(v, self.new_id) for v in (values if isinstance(values, list) else [values])]
            return [] if not calls or any(c is None for c in calls) else calls  # type: ignore[misc]
        calls = []  # v11: [TOOL_CALLS]name[ARGS]{...}[TOOL_CALLS]name[ARGS]{...}
        for part in body.split(self.marker):
            name, sep, args = part.partition("[ARGS]")
            text = _arguments_text(args.strip()) if sep else None
            if not name.strip() or text is None:
                return []
            calls.append(ToolCall(name.strip(), text, self.new_id()))
        return calls

    def call_grammar(self, tools: list[dict[str, Any]], parallel: bool, token_ref: TokenRef) -> str | None:
        # [TOOL_CALLS] is a control token in every Mistral tokenizer; a grammar cannot write it
        # as text. Tokenizers with [ARGS] (v11) write name[ARGS]{...} per call, the older ones
        # one JSON array of {"name", "arguments"}.
        calls, args = token_ref(self.marker), token_ref("[ARGS]")
        if calls is None:
            return None
        if args is None:
            body = [f"start: TEXT | TEXT {calls} {_WS} calls_json",
                    "calls_json: " + _lark_json(forced_call_schema(tools, None, parallel))]
        else:
            more = f" ({calls} call)*" if parallel else ""
            branches = " | ".join(f"call_{i}" for i in range(len(tools)))
            body = [f"start: TEXT | TEXT {calls} call{more}", f"call: {branches}",
                    *(f"call_{i}: {json.dumps(t['function']['name'])} {args} {_lark_json(function_parameters(t))}"
                      for i, t in enumerate(tools))]
        return "\n".join((*body, "TEXT: /(.|\\n)*/"))


TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesToolParser, Llama3JsonToolParser,
                                                                  MistralToolParser)}


def get_tool_parser(name: str) -> ToolParser:
    cls = TOOL_PARSERS.get(name)
    if cls is None:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(sorted(TOOL_PARSERS))}")
    return cls()


@dataclass
class ToolCallStream:
    """One streamed choice through a parser: ``feed(delta)`` and, at the end, ``finish()``
    each return (content delta, tool-call deltas)."""

    parser: ToolParser
    only_at_start: bool = False
    _pending: str = ""  # content held back (it may begin a call)
    _region: str | None = None  # from the call marker on
    _sent: int = 0  # calls already streamed
    _content_seen: bool = False
    calls: list[ToolCall] = field(default_factory=list)

    def _deltas(self, calls: list[ToolCall]) -> list[ToolCallDelta]:
        out = []
        for call in calls[self._sent:]:
            i = len(self.calls)
            self.calls.append(call)
            out.append(ToolCallDelta(i, call.id, call.name, ""))
            out.append(ToolCallDelta(i, arguments=call.arguments))
        self._sent = len(calls)
        return out

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        if self._region is not None:
            self._region += delta
            return "", self._deltas(self.parser.complete_calls(self._region))
        text = self._pending + delta
        if self.only_at_start and self._content_seen:
            return text, []
        start = self.parser.find_start(text)
        if start is not None:
            self._pending, self._region = "", text[start:]
            content = text[:start]
            return content, self._deltas(self.parser.complete_calls(self._region))
        hold = self.parser.hold_back(text)
        self._pending = text[len(text) - hold:] if hold else ""
        content = text[: len(text) - hold]
        if content.strip():
            self._content_seen = True
        return content, []

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        if self._region is None:
            content, self._pending = self._pending, ""
            return content, []
        calls = self.parser.parse_calls(self._region)
        if len(calls) > self._sent:
            return "", self._deltas(calls)
        if not self._sent:  # nothing in the region reads as a call: it was content after all
            return self._region, []
        return "", []


# -- forced calls: generated under a schema ----------------------------------------------------------
def function_parameters(tool: dict[str, Any]) -> dict[str, Any]:
    params = tool["function"].get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object", "properties": {}}


def call_object_schema(tools: list[dict[str, Any]], arguments_key: str = "arguments") -> dict[str, Any]:
    """The JSON schema of one call to any of ``tools``: ``{"name", arguments_key}``, one
    ``anyOf`` branch per tool, so the arguments always match the named tool's parameters."""
    branches = [{"type": "object", "additionalProperties": False, "required": ["name", arguments_key],
                 "properties": {"name": {"const": t["function"]["name"]}, arguments_key: function_parameters(t)}}
                for t in tools]
    return branches[0] if len(branches) == 1 else {"anyOf": branches}


def forced_call_schema(tools: list[dict[str, Any]], name: str | None, parallel: bool) -> dict[str, Any]:
    """The JSON schema a forced output is generated under: the named function's parameters,
    or for ``"required"`` an array (of one call unless ``parallel``) of calls to any tool."""
    if name is not None:
        tool = next(t for t in tools if t["function"]["name"] == name)
        return function_parameters(tool)
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": call_object_schema(tools)}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _top_level_elements(text: str) -> list[tuple[str, bool]]:
    """The array's elements so far, each (text, complete), for compact JSON ``[{...},{...}]``."""
    out: list[tuple[str, bool]] = []
    depth, in_str, esc, start = 0, False, False, -1
    for i, ch in enumerate(text):
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
            continue
        if ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            if depth == 2:
                start = i
        elif ch in "]}":
            if depth == 2 and start >= 0:
                out.append((text[start : i + 1], True))
                start = -1
            depth -= 1
    if start >= 0:
        out.append((text[start:], False))
    return out


_CALL_HEAD = re.compile(r'\{"name":("(?:[^"\\]|\\.)*"),"arguments":')


@dataclass
class ForcedCalls:
    """Reads back a forced output: ``name`` set for a named function (the output is its
    arguments), else the ``"required"`` array."""

    name: str | None
    _text: str = ""
    _ids: list[str] = field(default_factory=list)
    _sent_args: list[int] = field(default_factory=list)  # argument characters streamed per call

    def calls(self, text: str) -> list[ToolCall]:
        """The calls of a whole output. Cut by max_tokens, a named call's arguments are not
        JSON ([]); a ``"required"`` array keeps the calls it completed."""
        try:
            value = json.loads(text)
        except ValueError:
            if self.name is not None:
                return []
            value = []
            for elem, complete in _top_level_elements(text):
                if complete:
                    try:
                        value.append(json.loads(elem))
                    except ValueError:
                        break
        if self.name is not None:
            return [ToolCall(self.name, json.dumps(value, ensure_ascii=False), self._id(0))]
        calls = [_call_from(v, call_id) for v in value] if isinstance(value, list) else []
        return [ToolCall(c.name, c.arguments, self._id(i)) for i, c in enumerate(calls) if c is not None]

    def _id(self, i: int) -> str:
        while len(self._ids) <= i:
            self._ids.append(call_id())
        return self._ids[i]

    def feed(self, delta: str) -> list[ToolCallDelta]:
        """Streamed: the call's id and name as soon as they are known, then its arguments as
        they are generated."""
        self._text += delta
        out: list[ToolCallDelta] = []
        if self.name is not None:
            if not self._sent_args:
                self._sent_args.append(0)
                out.append(ToolCallDelta(0, self._id(0), self.name, ""))
            if delta:
                out.append(ToolCallDelta(0, arguments=delta))
            return out
        for i, (elem, complete) in enumerate(_top_level_elements(self._text)):
            m = _CALL_HEAD.match(elem)
            if m is None:
                continue
            if i >= len(self._sent_args):
                self._sent_args.append(0)
                out.append(ToolCallDelta(i, self._id(i), json.loads(m.group(1)), ""))
            args = elem[m.end():]
            if complete:
                args = args[:-1]  # the call object's own closing brace
            new = args[self._sent_args[i]:]
            if new:
                self._sent_args[i] = len(args)
                out.append(ToolCallDelta(i, arguments=new))
        return out
