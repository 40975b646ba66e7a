"""What callers of the engine get back for each request."""

from __future__ import annotations

from dataclasses import dataclass, field

from tailserve.metrics.timeline import RequestMetrics


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[dict[int, float]] | None = None
    # What this step added to this completion (streaming several samples: ``n`` > 1).
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)


@dataclass
class RequestOutput:
    """Cumulative state of one request; ``delta_*`` hold what this step added to its first
    completion (streaming). With ``n`` > 1, ``outputs`` holds n completions (index 0..n-1)
    and each carries its own delta."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    # With SamplingParams(prompt_logprobs=k): per prompt token, its logprob and the k most
    # likely at that position (None for the first token).
    prompt_logprobs: list[dict[int, float] | None] | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    metrics: RequestMetrics | None = None  # set on the final output when metrics are on

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens of every completion returned."""
        return sum(len(c.token_ids) for c in self.outputs)
