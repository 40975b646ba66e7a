"""Tool calling on chat completions: a request's ``tools`` and ``tool_choice`` become a
constraint (forced calls) or a parser (``auto``), and each choice's text becomes content and
``tool_calls``, whole or streamed (``structured/tool_parsers.py`` has the formats).

- ``"none"``, or tools without ``tool_choice`` on a server without auto tool choice: no
  tool handling (``"none"``: the template still sees the tools, as vLLM renders them);
- ``"auto"``: needs ``--enable-auto-tool-choice --tool-call-parser NAME``; the parser reads
  what the model wrote, and content comes back when it wrote no call; under tool pruning's
  ``mask`` the output is also generated under the parser's call grammar, so prose stays free
  and a call can name only a kept tool;
- ``"required"`` / a named function: the output is generated under the calls' JSON schema
  (enforced, so the arguments always validate), whichever parser the server has.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tailserve.config import DEFAULT_TOOL_CALL_KV_TTL_S
from tailserve.sampling_params import StructuredOutputsParams
from tailserve.server.protocol import APIError, ChatRequest
from tailserve.server.tool_pruning import ToolPruning
from tailserve.structured.tool_parsers import (
    ForcedCalls,
    TokenRef,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    forced_call_schema,
    get_tool_parser,
)


@dataclass(frozen=True)
class ToolCallingConfig:
    """The server's flags: ``--enable-auto-tool-choice`` and ``--tool-call-parser``."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    # --tool-call-kv-ttl: a request that can call a tool keeps its cached blocks the last to be
    # evicted this long after it ends in a tool call (the agent's next turn, after the tool
    # runs, sends the same prefix again); 0 turns it off.
    tool_call_kv_ttl_s: float = DEFAULT_TOOL_CALL_KV_TTL_S
    # --tool-pruning / --tool-pruning-max-tools: the default for requests without tool_pruning.
    tool_pruning: ToolPruning = field(default_factory=ToolPruning)

    def __post_init__(self) -> None:
        if not self.tool_call_kv_ttl_s >= 0:
            raise ValueError(f"--tool-call-kv-ttl must be >= 0 seconds, got {self.tool_call_kv_ttl_s}")
        if self.tool_call_parser is not None:
            get_tool_parser(self.tool_call_parser)  # ValueError naming the choices
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes, llama3_json, mistral)")


class ToolMode:
    """How one request's choices are read: ``forced`` (a named function or ``"required"``),
    ``parser`` (``auto``), or neither (plain content)."""

    def __init__(self, creq: ChatRequest, config: ToolCallingConfig,
                 callable_tools: list[dict] | None = None, constrain_auto: TokenRef | None = None) -> None:
        """``callable_tools``: the tools a call may name (tool pruning's kept ones; default all).
        ``constrain_auto``: constrain ``"auto"`` too, writing markers through this token
        reference (``mask``: the prompt shows more tools than a call may name, so only the
        grammar keeps the call to the kept ones)."""
        self.forced: ForcedCalls | None = None
        self.parser: ToolParser | None = None
        self.structured: StructuredOutputsParams | None = None
        self.parallel = creq.parallel_tool_calls
        choice = creq.tool_choice
        # A request that can end in a tool call pins its KV on finishing, provisionally: the
        # server ends the pin when the answer turns out not to be one.
        self.kv_pin_s = config.tool_call_kv_ttl_s if creq.tools and choice not in (None, "none") else 0.0
        if choice is None or choice == "none":
            return
        tools = callable_tools if callable_tools is not None else creq.tools or []
        if choice == "auto":
            if not config.enable_auto_tool_choice:
                raise APIError(400, 'tool_choice "auto" (the default when tools are sent) needs the server started '
                                    "with --enable-auto-tool-choice --tool-call-parser NAME; or send tool_choice "
                                    '"required", a named function, or "none"', "tool_choice")
            self.parser = get_tool_parser(config.tool_call_parser or "")
            if constrain_auto is not None:
                grammar = self.parser.call_grammar(tools, self.parallel, constrain_auto)
                if grammar is None:
                    raise APIError(400, f'tool pruning "mask" under tool_choice "auto" needs a call grammar for the '
                                        f"server's --tool-call-parser {self.parser.name}, which this tokenizer "
                                        f"cannot have (its call marker is not a token here); use \"prune\", or "
                                        f'tool_choice "required" or a named function', "tool_pruning")
                if creq.greq.params.structured_outputs is not None:
                    raise APIError(400, 'tool pruning "mask" under tool_choice "auto" constrains the output to the '
                                        "tool-call grammar; it cannot be combined with response_format or "
                                        "structured_outputs", "tool_pruning")
                self.structured = StructuredOutputsParams(grammar=grammar, param="tools")
            return
        name = creq.forced_function
        self.forced = ForcedCalls(name)
        # Compact JSON under the schema (param "tools": a bad parameters schema is the tools' fault).
        self.structured = StructuredOutputsParams(json=forced_call_schema(tools, name, self.parallel), param="tools")

    @property
    def skip_special_tokens(self) -> bool | None:
        """False where the parser's markup is a special token (it must survive detokenizing)."""
        return False if self.parser is not None and self.parser.needs_special_tokens else None

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.forced is not None:
            calls = self.forced.calls(text)
            return (None, calls) if calls else (text, [])
        if self.parser is not None:
            content, calls = self.parser.extract(text)
            return content, calls if self.parallel else calls[:1]
        return text, []

    def stream(self) -> ChoiceStream:
        return ChoiceStream(self)


class ChoiceStream:
    """One streamed choice: ``feed(delta)`` / ``finish()`` -> (content delta, tool-call deltas)."""

    def __init__(self, mode: ToolMode) -> None:
        self.mode = mode
        self.forced = ForcedCalls(mode.forced.name) if mode.forced is not None else None
        self.parsed = mode.parser.stream() if mode.parser is not None else None
        self.num_calls = 0

    def _count(self, deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
        if not self.mode.parallel:
            deltas = [d for d in deltas if d.index == 0]
        self.num_calls = max([self.num_calls, *(d.index + 1 for d in deltas)])
        return deltas

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        if self.forced is not None:
            return "", self._count(self.forced.feed(delta))
        if self.parsed is not None:
            content, deltas = self.parsed.feed(delta)
            return content, self._count(deltas)
        return delta, []

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        if self.parsed is not None:
            content, deltas = self.parsed.finish()
            return content, self._count(deltas)
        return "", []
