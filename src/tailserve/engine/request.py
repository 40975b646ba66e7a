"""One request's state as the scheduler sees it: token ids, KV blocks, progress, status."""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tailserve.engine.scheduler_output import draft_room
from tailserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tailserve.structured.grammar import Matcher

log = logging.getLogger("tailserve.engine")


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


@dataclass(eq=False)
class Request:
    """Invariant: 0 <= num_computed_tokens <= num_tokens, and the request's blocks hold the
    K/V of exactly its first num_computed_tokens tokens (blocks past them are reserved for
    the tokens of the step in flight and for the draft tokens it will propose)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    max_model_len: int
    all_token_ids: list[int] = field(init=False)
    status: RequestStatus = RequestStatus.WAITING
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_registered_blocks: int = 0  # leading blocks already offered to the prefix cache
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first admission; -1 until admitted
    prefix_break_token: int = -1  # at first admission: Scheduler._prefix_break
    kv_pin_s: float = 0.0  # on finishing, pin its cached blocks this long (Scheduler._pin)
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    # What the worker has been sent: None = nothing yet (new, or resumed after a preemption:
    # its full data goes out next step); else the number of block ids it knows.
    num_sent_blocks: int | None = None
    num_draft_cached_tokens: int = 0  # at admission: leading hit tokens whose draft K/V is cached
    # Timeline events ("scheduled" | "preempted", perf_counter_ns) not yet handed to the output
    # processor, and whether the prefix-cache hit has been reported.
    events: list[tuple[str, int]] = field(default_factory=list)
    reported_cached: bool = False
    # Speculative decoding: drafts proposed at the end of the last step, to verify next.
    spec_token_ids: list[int] = field(default_factory=list)
    spec_cap: int = 0  # the most drafts the last proposal could make (its chain may stop sooner)
    num_draft_marked: int = 0  # leading blocks already flagged draft_filled in the pool
    # Tokens whose draft-model K/V the worker last reported (its last proposal); what the
    # draft must catch up on is the rest (``Scheduler._outlook``). 0 until reported.
    num_draft_seen_tokens: int = 0
    # Parallel sampling: the samples waiting to be forked from this one once its prompt is
    # computed, and (on such a sample) the request it waits on.
    fork_children: list[Request] = field(default_factory=list)
    fork_parent: Request | None = None
    # Constrained decoding: the matcher of the output so far (advanced only by accepted
    # tokens, never by drafts); dropped when the request finishes.
    grammar: Matcher | None = None
    stopped_by_token: bool = False  # ended by EOS or a stop token id (its text is not output)
    # perf_counter_ns of its arrival and of its first output token (0: none yet): what the
    # goodput objective of speculative decoding weighs (speculative/adaptive.py).
    arrival_ns: int = 0
    first_token_ns: int = 0

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    @property
    def room_for_drafts(self) -> int:
        """Draft tokens a round may still propose: leave room for the bonus token within
        max_tokens and the context."""
        return draft_room(self.params.max_tokens, self.num_output_tokens, self.max_model_len, self.num_tokens)

    def append_output(self, token_id: int) -> bool:
        """Append a sampled token; return True if it ends the request (status set)."""
        self.all_token_ids.append(token_id)
        p = self.params
        if (not p.ignore_eos and token_id in self.eos_token_ids) or token_id in p.stop_token_ids:
            self.status = RequestStatus.FINISHED_STOPPED
            self.stop_reason = token_id if token_id in p.stop_token_ids else None
            self.stopped_by_token = True
            return True
        g = self.grammar
        if g is not None:
            if not g.consume_token(token_id):
                # The masks allow only what the grammar does, so this is a bug: say so and end
                # the request rather than return output the grammar refused.
                log.error("request %s: the grammar refused accepted token %d (%s)", self.request_id, token_id,
                          g.get_error())
                self.status = RequestStatus.FINISHED_ABORTED
                return True
            if g.is_stopped():  # the grammar is complete: nothing but EOS could follow
                self.status = RequestStatus.FINISHED_STOPPED
                return True
        if self.num_output_tokens >= p.max_tokens or self.num_tokens >= self.max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False
