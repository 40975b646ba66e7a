"""The data that crosses the scheduler / worker boundary, and the engine core's outputs.

Plain Python data only, so the scheduler is tested with hand-written runner outputs and a
worker in another process (tensor parallelism) can receive it as it is. Nothing here is
shared with live ``Request`` state: lists are copied into tuples when the output is built.

One step's protocol:

- ``SchedulerOutput``: a request's full data once (``NewRequestData``: when admitted, and
  again when resumed after a preemption), then per step only deltas (``CachedRequestData``:
  the blocks added since the last step). ``scheduled`` says what to compute: how many
  tokens per request, which of them are draft tokens to verify, and how many draft tokens
  to propose after this step (``num_lookahead_tokens``: the scheduler reserved their KV
  slots already).
- ``ModelRunnerOutput``: per request the sampled (accepted) token ids, the next round's
  draft token ids, and what the draft model now holds. Draft probabilities never leave the
  worker.
- ``EngineCoreOutput``: per request what the step added, for the output processor.

The seam's other side: a ``ModelExecutor`` (a ``Worker``, or the tensor-parallel executor
over one per rank) executes steps and describes itself once in a frozen ``WorkerInfo``;
the engine core, ``LLMEngine`` and the server read nothing else of it.
"""

from __future__ import annotations

import pathlib
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from tailserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tailserve.engine.plan import TargetPlan
    from tailserve.memory.allocator.control import AllocatorSettings
    from tailserve.memory.kv_sizing import MemoryProfile
    from tailserve.model.config import ModelArchConfig
    from tailserve.speculative.adaptive import VerifyCostProfile
    from tailserve.speculative.suffix import SuffixCacheFigures


@dataclass(frozen=True)
class NewRequestData:
    request_id: str
    token_ids: tuple[int, ...]  # prompt, plus the outputs so far when resumed after a preemption
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: tuple[int, ...]
    num_computed_tokens: int  # prefix-cache hit
    num_draft_computed_tokens: int  # of those, leading tokens whose draft-model K/V is cached too


@dataclass(frozen=True)
class CachedRequestData:
    request_id: str
    new_block_ids: tuple[int, ...]  # appended to the request's block table since the last step
    num_computed_tokens: int  # the worker's view must agree (checked)


@dataclass(frozen=True)
class ScheduledRequest:
    """Compute ``num_tokens`` tokens of the request from position ``start_pos``: its own
    known tokens, followed by ``draft_token_ids`` to verify. Sample after the last one if
    ``sample`` (the prompt is then fully computed)."""

    request_id: str
    start_pos: int
    num_tokens: int
    draft_token_ids: tuple[int, ...]
    sample: bool
    is_prefill: bool
    num_lookahead_tokens: int = 0  # drafts to propose after this step (0: none)


@dataclass
class GrammarBitmask:
    """This step's grammar masks (constrained decoding). ``first_rows[request_id]`` is the
    first of that request's k + 1 consecutive rows (its sampled position, then one after each
    of its k drafts). The engine core computes the bitmask while the forward runs, so
    ``pending`` may be a future: ``array()`` waits for it; a copy sent to another process
    (tensor parallelism) carries the finished array."""

    first_rows: dict[str, int]
    pending: Future | np.ndarray  # (rows, ceil(V / 32)) int32

    def array(self) -> np.ndarray:
        if isinstance(self.pending, Future):
            self.pending = self.pending.result()
        return self.pending

    def __getstate__(self) -> dict:
        return {"first_rows": self.first_rows, "pending": self.array()}


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)  # finished since the previous step
    # (source, destination) block ids whose K/V to copy before this step's forward: the
    # copy-on-write of a fork (parallel sampling).
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # The speculation policy's choice for this step (decoding requests, k, steady: the same
    # k as the previous step, all greedy), reported back with the step's cost
    # (StepCost.spec_round); None where no request samples, or for a quiet step that the
    # policy does not need measured (AdaptiveSpeculation.last_round).
    spec_round: tuple[int, int, bool, bool] | None = None
    grammar: GrammarBitmask | None = None  # masks of the constrained requests that sample

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        """Nothing to compute (a copy owed to a sample that was preempted since is moot)."""
        return not self.scheduled


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[dict[int, float]]] = field(default_factory=dict)
    # Per request whose prompt finished this step and asked for them: one entry per prompt
    # token (None for the first).
    prompt_logprobs: dict[str, list[dict[int, float] | None]] = field(default_factory=dict)
    # Speculative decoding: the next round's drafts, the most each request's proposal could
    # make (its chain may stop sooner), and tokens whose draft-model K/V is now computed.
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    draft_caps: dict[str, int] = field(default_factory=dict)
    num_draft_computed: dict[str, int] = field(default_factory=dict)
    # Costs for the adaptive controller, measured by the worker: the target's forward with its
    # sampling, the whole proposal, and the proposal per steady-state draft step (None when
    # not observed this step) for ``num_drafting`` requests.
    target_forward_s: float = 0.0
    propose_s: float = 0.0
    draft_step_s: float | None = None
    num_drafting: int = 0
    suffix_cache: SuffixCacheFigures | None = None  # suffix decoding's global cache, when it changed


@dataclass
class EngineCoreOutput:
    """What one step did to one request."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None = None
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_cached_tokens: int | None = None  # prefix-cache hit, on the request's first output
    # With it: the first prompt token no cached block held (the prompt's length: a full hit;
    # -1: the cache was not looked up). See metrics/prefix_break.py.
    prefix_break_token: int = -1
    prompt_logprobs: list[dict[int, float] | None] | None = None  # on the first output, when asked for
    events: list[tuple[str, int]] = field(default_factory=list)  # ("scheduled" | "preempted", ns)
    stop_token: bool = False  # the last new token is the EOS or stop token that ended it


# -- the arithmetic both sides of the seam must agree on ------------------------------------------
def draft_room(max_tokens: int, num_output_tokens: int, max_model_len: int, num_tokens: int) -> int:
    """Draft tokens a round may still propose for a request: room for the bonus token left
    within max_tokens and within the context."""
    return min(max_tokens - num_output_tokens - 1, max_model_len - num_tokens - 1)


def verified(num_scheduled_tokens: int, num_drafts: int, num_emitted: int) -> tuple[int, int]:
    """A sampled step's outcome: (tokens newly computed, drafts accepted). A step that verified
    ``num_drafts`` drafts and emitted ``num_emitted`` tokens accepted ``num_emitted - 1`` of
    them (the last is the correction or the bonus); the rejected drafts' K/V slots are rolled
    back, so only the accepted tokens count as computed."""
    accepted = max(num_emitted - 1, 0) if num_drafts else 0
    return num_scheduled_tokens - (num_drafts - accepted), accepted

@dataclass(frozen=True)
class StepCost:
    """A finished step's measured cost (the engine core's clock: from scheduling to the end
    of output processing), handed to the speculation policy by the next
    ``Scheduler.update``."""

    num_tokens: int  # tokens the target computed
    num_emitted: int  # tokens the step gave its requests
    total_s: float
    target_forward_s: float
    propose_s: float
    spec_round: tuple[int, int, bool, bool] | None = None  # the step's SchedulerOutput.spec_round
    # No prompt tokens in it: only such steps feed the cost model's fit (a prefill chunk's
    # tokens cost more each) and the measured rates' windows; the others are measured apart
    # (speculative/adaptive.py, _with_admissions).
    decode_only: bool = True
    num_rounds: int = 0  # requests that verified drafts in the step
    num_accepted: int = 0  # drafts they accepted (part of num_emitted)


class StepAppliedError(RuntimeError):
    """A step failed after its results were applied to the worker's state (in the proposal):
    it cannot run again, so its requests fail; an error before that point (an out-of-memory
    in the forward) leaves the step re-runnable. Carries the original error as its cause."""


@dataclass(frozen=True)
class WorkerInfo:
    """What the engine needs to know of its worker, given once after it is built."""

    arch: ModelArchConfig
    model_dir: pathlib.Path
    max_model_len: int
    num_blocks: int
    block_size: int
    kv_bytes_per_block: int  # both models' K/V for one block id on this rank
    dtype: torch.dtype
    dtype_reason: str
    device: torch.device
    allocator_settings: AllocatorSettings
    memory_profile: MemoryProfile | None  # CUDA sizing by profiling; None when sized from bytes
    decode_graph_sizes: tuple[int, ...]  # captured decode batch sizes (empty: eager)
    graph_capture_s: float | None
    has_proposer: bool
    plan: TargetPlan
    # The proposer looks drafts up in text (n-gram, suffix; not hybrid, whose draft model
    # catches up): ``AdaptiveSpeculation.hold_beside_prompts``.
    lookup_proposer: bool = False
    num_fused_layers: int = 0
    # Verification's cost by batch size and k, measured at start-up for adaptive speculation
    # (None: no proposer, a fixed k, or tensor parallelism).
    verify_costs: VerifyCostProfile | None = None


class ModelExecutor(Protocol):
    """The worker side of the seam, as the engine core sees it."""

    info: WorkerInfo

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput: ...

    def warm_up(self, decode_batch_sizes: list[int], prefill_lens: list[int],
                prefill_batch_tokens: int = 0) -> None: ...

    def free(self, request_ids: list[str]) -> None: ...

    def check_health(self) -> None: ...

    def shutdown(self) -> None: ...
