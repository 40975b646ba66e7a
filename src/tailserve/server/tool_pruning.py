"""Cache-aware dynamic tool pruning: send the model only the tools a turn is likely to need.

An agent sends its whole catalogue on every turn; most of it is irrelevant to the turn, and
costs prompt tokens. Pruning that changes the prompt from one turn to the next breaks the
prefix cache, though, and can cost more than it saves. Two cache-aware modes:

- ``prune``: only the kept tools are rendered, always in the catalogue's order, so two turns
  that keep the same set share their prefix;
- ``mask``: the whole catalogue stays in the prompt (its prefix stays stable across turns) and
  the call grammar allows only the kept tools: the forced call's schema under ``"required"``
  or a named function, the tool-call parser's grammar under ``"auto"`` (prose stays free).

Relevance is BM25 (the ``bm25s`` package: a well-kept, numpy-only implementation, fast enough
to index a catalogue per request; the index of a catalogue is kept for the next turn) of each
tool's name (split into words), description and parameter names against the conversation's
last user message and the tool results after it. A tool that ``tool_choice`` names is always
kept.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import bm25s

from tailserve.server.protocol import APIError

MODES = ("off", "prune", "mask")
DEFAULT_MAX_TOOLS = 8
_FIELDS = frozenset({"mode", "max_tools"})


@dataclass(frozen=True)
class ToolPruning:
    """A request's pruning (the server's ``--tool-pruning`` / ``--tool-pruning-max-tools``
    unless the request's ``tool_pruning`` says otherwise)."""

    mode: str = "off"
    max_tools: int = DEFAULT_MAX_TOOLS

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"tool pruning mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if isinstance(self.max_tools, bool) or not isinstance(self.max_tools, int) or self.max_tools < 1:
            raise ValueError(f"tool pruning max_tools must be a positive integer, got {self.max_tools!r}")


def parse_tool_pruning(value: object, default: ToolPruning) -> ToolPruning:
    """The request body's ``tool_pruning`` object over the server's default (400 on bad values)."""
    if value is None:
        return default
    if not isinstance(value, dict):
        raise APIError(400, 'tool_pruning must be an object: {"mode": "prune" | "mask" | "off", "max_tools": N}',
                       "tool_pruning")
    unknown = sorted(set(value) - _FIELDS)
    if unknown:
        raise APIError(400, f"tool_pruning: unknown field(s) {', '.join(unknown)} (known: mode, max_tools)",
                       "tool_pruning")
    try:
        return ToolPruning(value.get("mode", default.mode), value.get("max_tools", default.max_tools))
    except ValueError as e:
        raise APIError(400, str(e), "tool_pruning") from None


@dataclass(frozen=True)
class PruningResult:
    mode: str
    kept: tuple[int, ...]  # indices into the catalogue, in its order
    names: tuple[str, ...]  # the kept tools' names
    dropped: int

    def to_wire(self, prompt_tokens_saved: int) -> dict[str, Any]:
        return {"mode": self.mode, "kept": list(self.names), "dropped": self.dropped,
                "prompt_tokens_saved": prompt_tokens_saved}


_WORD_SPLIT = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|[_\-.]+")


def _words(name: str) -> str:
    """``get_weather`` / ``getWeather`` -> ``get weather``."""
    return " ".join(w for w in _WORD_SPLIT.split(name) if w)


def tool_document(tool: dict[str, Any]) -> str:
    fn = tool["function"]
    params = fn.get("parameters") or {}
    props = params.get("properties") if isinstance(params, dict) else None
    names = " ".join(_words(p) for p in props) if isinstance(props, dict) else ""
    return f"{_words(fn['name'])} {fn.get('description') or ''} {names}"


def _text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def relevance_query(messages: list[dict[str, Any]]) -> str:
    """The last user message and the tool results that came after it."""
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=-1)
    parts = [_text(messages[last_user].get("content"))] if last_user >= 0 else []
    parts += [_text(m.get("content")) for m in messages[last_user + 1 :] if m.get("role") == "tool"]
    return " ".join(p for p in parts if p)


class ToolRanker:
    """BM25 over tool documents; the index of the last few catalogues is kept (an agent sends
    the same one every turn)."""

    def __init__(self, cache_size: int = 32) -> None:
        self._indexes: OrderedDict[str, bm25s.BM25] = OrderedDict()
        self.cache_size = cache_size

    def _index(self, tools: list[dict[str, Any]]) -> bm25s.BM25:
        key = json.dumps(tools, sort_keys=True)
        index = self._indexes.get(key)
        if index is None:
            index = bm25s.BM25()
            index.index(bm25s.tokenize([tool_document(t) for t in tools], stopwords="en", show_progress=False),
                        show_progress=False)
            self._indexes[key] = index
            if len(self._indexes) > self.cache_size:
                self._indexes.popitem(last=False)
        else:
            self._indexes.move_to_end(key)
        return index

    def scores(self, tools: list[dict[str, Any]], query: str) -> list[float]:
        tokens = bm25s.tokenize([query], stopwords="en", show_progress=False, return_ids=False)[0]
        if not tokens:
            return [0.0] * len(tools)
        return [float(s) for s in self._index(tools).get_scores(tokens)]

    def select(self, tools: list[dict[str, Any]], messages: list[dict[str, Any]], pruning: ToolPruning,
               must_keep: str | None = None) -> PruningResult:
        """The ``max_tools`` most relevant tools (ties and no match at all: the catalogue's
        order), plus ``must_keep``; returned in the catalogue's order."""
        n = len(tools)
        if pruning.max_tools >= n:
            kept = tuple(range(n))
        else:
            scores = self.scores(tools, relevance_query(messages))
            order = sorted(range(n), key=lambda i: (-scores[i], i))
            top = order[: pruning.max_tools]
            if must_keep is not None:
                forced = next(i for i, t in enumerate(tools) if t["function"]["name"] == must_keep)
                if forced not in top:
                    top = [*top[:-1], forced]
            kept = tuple(sorted(top))
        return PruningResult(pruning.mode, kept, tuple(tools[i]["function"]["name"] for i in kept), n - len(kept))
