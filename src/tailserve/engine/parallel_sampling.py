"""Parallel sampling (``n > 1``, ``best_of``): one request, several samples of one prompt.

The front end fans a request out into ``num_samples`` child requests (``"{i}_{id}"``, as
vLLM names them); the scheduler computes the prompt once, for the first child, and forks
the others from it (shared prompt blocks, copy-on-write of the first block they write: see
``Scheduler._fork``). This module holds what is per parent: each child's sampling
parameters and the aggregation of the children's outputs into the parent's one
``RequestOutput``, with ``n`` completions indexed 0..n-1.

With ``best_of`` > ``n`` nothing is returned until every sample has finished; then the
``n`` with the highest mean token log-probability are returned (OpenAI's definition of
"best"), re-indexed in that order. The children are asked for the sampled token's
log-probability for this even when the caller did not ask for logprobs; it is stripped
from what the caller sees then.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from tailserve.metrics.timeline import RequestMetrics
from tailserve.outputs import CompletionOutput, RequestOutput
from tailserve.sampling_params import SamplingParams


def child_request_id(parent_id: str, index: int) -> str:
    return f"{index}_{parent_id}"


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sample ``index``'s parameters: one sample each; a seed is offset by the index (so the
    samples differ yet the request stays reproducible, as vLLM does); only the first computes
    the prompt, so only it scores the prompt; ranking ``best_of`` needs each sampled token's
    logprob."""
    ranks = params.num_samples > params.n
    return dataclasses.replace(
        params, n=1, best_of=None,
        seed=None if params.seed is None else params.seed + index,
        prompt_logprobs=params.prompt_logprobs if index == 0 else None,
        logprobs=(params.logprobs if params.logprobs is not None else 0) if ranks else params.logprobs)


def mean_logprob(c: CompletionOutput) -> float:
    """The ranking score of a finished sample: mean log-probability of its tokens."""
    if not c.logprobs or not c.token_ids:
        return -math.inf
    total = sum(lp.get(t, -math.inf) for t, lp in zip(c.token_ids, c.logprobs))
    return total / len(c.token_ids)


@dataclass
class ParentRequest:
    request_id: str
    params: SamplingParams
    child_ids: list[str]
    latest: dict[int, RequestOutput] = field(default_factory=dict)  # child index -> its last output
    metrics: list[RequestMetrics] = field(default_factory=list)
    index_of: dict[str, int] = field(init=False)

    def __post_init__(self) -> None:
        self.index_of = {cid: i for i, cid in enumerate(self.child_ids)}

    def request_metrics(self, extra: list[RequestMetrics] = ()) -> RequestMetrics | None:
        """The request's timing: its slowest sample's (the response is complete only then),
        under the request's own id."""
        slowest = max([*self.metrics, *extra], key=lambda m: m.e2el_s, default=None)
        return None if slowest is None else dataclasses.replace(slowest, request_id=self.request_id)

    @property
    def streams(self) -> bool:
        """Whether outputs go out while samples run (not with best_of > n: ranking needs all)."""
        return self.params.num_samples == self.params.n

    @property
    def finished(self) -> bool:
        return len(self.latest) == len(self.child_ids) and all(o.finished for o in self.latest.values())

    def observe(self, index: int, out: RequestOutput) -> None:
        self.latest[index] = out
        if out.metrics is not None:
            self.metrics.append(out.metrics)

    def output(self, touched: set[int]) -> RequestOutput | None:
        """The parent's output after a step in which the children ``touched`` progressed."""
        finished = self.finished
        if not self.streams and not finished:
            return None
        comps: list[CompletionOutput] = []
        for i in range(len(self.child_ids)):
            out = self.latest.get(i)
            if out is None:  # not yet admitted: an empty completion keeps the indices dense
                comps.append(CompletionOutput(i, "", []))
                continue
            c = dataclasses.replace(out.outputs[0], index=i)
            if i not in touched:
                c = dataclasses.replace(c, delta_text="", delta_token_ids=[])
            comps.append(c)
        if not self.streams:
            comps = sorted(comps, key=mean_logprob, reverse=True)[: self.params.n]
            keep_lp = self.params.logprobs is not None
            comps = [dataclasses.replace(c, index=j, logprobs=c.logprobs if keep_lp else None)
                     for j, c in enumerate(comps)]
        first = self.latest.get(0) or next(iter(self.latest.values()))
        slowest = self.request_metrics() if finished else None
        return RequestOutput(
            request_id=self.request_id, prompt=first.prompt, prompt_token_ids=first.prompt_token_ids,
            outputs=comps, finished=finished, num_cached_tokens=self.latest[0].num_cached_tokens if 0 in self.latest
            else 0, num_preemptions=sum(o.num_preemptions for o in self.latest.values()),
            prompt_logprobs=self.latest[0].prompt_logprobs if 0 in self.latest else None,
            delta_text=comps[0].delta_text, delta_token_ids=list(comps[0].delta_token_ids), metrics=slowest)
