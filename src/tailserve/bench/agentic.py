"""The agentic workload: tool-using sessions whose prompts grow turn by turn.

Agents send a long system prompt, a catalogue of tools and every turn's tool results, about
a hundred prompt tokens for each token they get back; whether their latency is low depends
on the prefix cache. Each session here is a task about one or two services (weather, git,
tickets, ...): its first turn is the system prompt (shared by every session) and the task;
each later turn is sent after the previous answer, with that answer and a synthetic result
of the tool it concerns appended (a ``tool`` message answering the model's call when it made
one, else a ``user`` message carrying the result), after a think time that stands for the
tool running. The catalogue is the same for every session, in the same order, as an agent
framework sends it; its tools are named and described after the services, so that relevance
ranking (tool pruning) has something to find.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

from tailserve.model.tokenizer import Tokenizer

# Services, and the words their tasks, tool descriptions and results use.
SERVICES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("weather", ("forecast", "temperature", "rain", "wind", "humidity", "city")),
    ("calendar", ("event", "meeting", "schedule", "attendees", "room", "agenda")),
    ("email", ("message", "inbox", "sender", "subject", "thread", "attachment")),
    ("files", ("path", "directory", "document", "folder", "upload", "permissions")),
    ("database", ("sql", "table", "query", "rows", "schema", "index")),
    ("git", ("commit", "branch", "diff", "repository", "merge", "tag")),
    ("web", ("url", "page", "crawl", "http", "link", "headline")),
    ("maps", ("route", "distance", "address", "location", "traffic", "travel")),
    ("finance", ("stock", "price", "portfolio", "currency", "invoice", "budget")),
    ("tickets", ("issue", "bug", "priority", "assignee", "status", "sprint")),
    ("crm", ("customer", "account", "contact", "deal", "pipeline", "renewal")),
    ("docs", ("documentation", "guide", "api", "reference", "install", "tutorial")),
)
ACTIONS: tuple[tuple[str, str], ...] = (
    ("search", "Search {service} {a} and {b} records by keywords; returns the best matches"),
    ("get", "Get one {service} {a} by its id, with its {b} and {c}"),
    ("list", "List the most recent {service} {a} entries, newest first, filtered by {b}"),
    ("create", "Create a new {service} {a} with the given {b} and {c}"),
    ("update", "Update the {b} of an existing {service} {a}"),
)
_SYSTEM_RULES = (
    "You are an operations agent working for a mid-sized software company.",
    "Use the tools to look things up instead of guessing, and call one tool at a time.",
    "Before you change anything, read the current state with a search, get or list call.",
    "Quote the ids that tools return exactly; never invent an id, a date or an amount.",
    "When a tool fails, explain the error and try a narrower query before giving up.",
    "Keep answers short: the result first, then at most three lines of explanation.",
    "Treat every customer record, message and document as confidential.",
    "If a request is ambiguous, pick the most recent matching record and say so.",
)


@dataclass(frozen=True)
class AgenticConfig:
    num_turns: int = 6  # requests per session
    num_tools: int = 50  # tools in the catalogue (at most len(SERVICES) * len(ACTIONS))
    tool_result_len: int = 200  # tokens of each synthetic tool result
    think_time_s: float = 0.5  # between an answer and the next turn (the tool running)
    system_len: int = 512  # tokens of the shared system prompt


def catalogue(num_tools: int, seed: int = 0) -> list[dict]:
    """``num_tools`` OpenAI-format tool definitions, in a fixed order (seeded): the same
    catalogue for every session of a run, as one agent sends it."""
    rng = random.Random(seed)
    tools = []
    for service, words in SERVICES:
        for action, text in ACTIONS:
            a, b, c = rng.sample(words, 3)
            props = {b: {"type": "string", "description": f"the {b} to match"},
                     c: {"type": "string", "description": f"the {c}"}}
            if action in ("get", "update"):
                props = {"id": {"type": "string", "description": f"the {service} {a} id"}, **props}
            tools.append({"type": "function", "function": {
                "name": f"{service}_{action}", "description": text.format(service=service, a=a, b=b, c=c),
                "parameters": {"type": "object", "properties": props, "required": list(props)[:1]}}})
    rng.shuffle(tools)
    return tools[:num_tools]


def _fit(tok: Tokenizer, text: str, n: int) -> str:
    """``text`` cut to at most ``n`` tokens (whole words)."""
    words = text.split(" ")
    lo, hi = 0, len(words)
    while lo < hi:  # the most words whose tokens fit
        mid = (lo + hi + 1) // 2
        if len(tok.encode(" ".join(words[:mid]), add_special_tokens=False)) <= n:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(words[:lo])


def system_prompt(tok: Tokenizer, n: int, seed: int = 0) -> str:
    """The shared system prompt: the rules, then numbered policy lines, ``n`` tokens."""
    rng = random.Random(seed)
    lines = list(_SYSTEM_RULES)
    i = 1
    while len(tok.encode(" ".join(lines), add_special_tokens=False)) < n:
        service, words = rng.choice(SERVICES)
        lines.append(f"Policy {i}: for {service} work, check the {rng.choice(words)} and the "
                     f"{rng.choice(words)} before reporting a {rng.choice(words)}.")
        i += 1
    return _fit(tok, " ".join(lines), n)


@dataclass(frozen=True)
class Session:
    task: str  # the first user message
    services: tuple[str, ...]
    tool_results: tuple[str, ...]  # one per later turn
    tool_names: tuple[str, ...]  # the tool each result comes from (when the model called none)


def sessions(tok: Tokenizer, cfg: AgenticConfig, num_sessions: int, tools: list[dict], rng: random.Random
             ) -> list[Session]:
    names = [t["function"]["name"] for t in tools]
    words = dict(SERVICES)
    out = []
    for s in range(num_sessions):
        present = sorted({n.split("_")[0] for n in names})
        services = tuple(rng.sample(present, min(2, len(present))))
        w0, w1 = rng.sample(words[services[0]], 2)
        task = (f"Ticket {rng.randrange(10_000, 99_999)}: find the latest {services[0]} {w0} about "
                f"{w1}, then use {services[-1]} to record what you found.")
        results, used = [], []
        for turn in range(1, cfg.num_turns):
            service = services[turn % len(services)]
            tool = rng.choice([n for n in names if n.startswith(service + "_")])
            rows = []
            while len(tok.encode(json.dumps(rows), add_special_tokens=False)) < cfg.tool_result_len:
                rows.append({"id": f"{service[:3]}-{rng.randrange(10**5)}", rng.choice(words[service]):
                             rng.choice(words[service]) + f" {rng.randrange(100)}", "session": s})
            results.append(_fit(tok, json.dumps(rows), cfg.tool_result_len))
            used.append(tool)
        out.append(Session(task, services, tuple(results), tuple(used)))
    return out
