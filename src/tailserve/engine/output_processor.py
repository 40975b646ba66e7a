"""The output stage: engine-core results -> what callers see.

Per request it keeps the output token ids, the text (incremental detokenizer), logprobs and
the request's timeline, and for every step's new tokens it

- detokenizes **one token at a time** and searches the stop strings after each: a stop
  ends the output at the token that completed it, so token ids, text and usage are cut
  there even when a speculative step accepted tokens past it (they are dropped, and the
  engine core is told to finish the request);
- streams only text that the final text will contain: while a request runs, the last
  (longest stop string - 1) characters are held back, since they could still turn out to
  be the start of a stop string. Concatenated ``delta_text`` always equals the final text;
- builds ``RequestOutput`` deltas, and on finish the request's ``RequestMetrics``;
- merges the samples of an ``n`` > 1 / ``best_of`` request (child requests in the engine
  core) into the request's one output (``parallel_sampling.ParentRequest``).

A caller that reads only finished outputs (``final_only``: ``LLM.generate``, as vLLM's offline
``LLM`` asks for ``RequestOutputKind.FINAL_ONLY``, and a server response that is not streamed)
gets no output per step, and where no stop string needs the text per token, its text is
detokenized once, at the finish, by the same incremental detokenizer over the same tokens (so
the same text). Per token during the run that detokenizing cost ~25 us here (2 AVX2 cores, a
batch-1 step of ~1 ms, its caches cold after the forward) against ~2.4 us in one pass at the
end: batch-1 offline decode 3.6-5.0% faster, measured (docs/benchmarks.md, session 39).

It never touches the scheduler, blocks or tensors.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from tailserve.engine.detokenizer import IncrementalDetokenizer
from tailserve.engine.parallel_sampling import ParentRequest
from tailserve.engine.scheduler_output import EngineCoreOutput
from tailserve.metrics.prefix_break import PrefixBreak, PromptSegment, locate_break
from tailserve.metrics.prometheus import PrometheusMetrics
from tailserve.metrics.timeline import RequestMetrics, RequestTimeline
from tailserve.model.tokenizer import Tokenizer
from tailserve.outputs import CompletionOutput, RequestOutput
from tailserve.sampling_params import SamplingParams


def find_stop(text: str, stops: tuple[str, ...], search_from: int) -> tuple[int, str] | None:
    """The earliest stop string in ``text[search_from:]`` (index, string), or None."""
    best: tuple[int, str] | None = None
    for s in stops:
        idx = text.find(s, search_from)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, s)
    return best


@dataclass
class _State:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    timeline: RequestTimeline | None
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    text: str = ""
    num_streamed_chars: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    spec: tuple[int, int, int] = (0, 0, 0)  # drafts, draft tokens, accepted tokens
    max_stop_len: int = 0
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # A sample of a parent request: the parent observes one finished request, not n.
    observe_finish: bool = True
    prompt_segments: tuple[PromptSegment, ...] = ()
    prefix_break: PrefixBreak | None = None
    # The caller reads only the finished output and no stop string needs the text per token:
    # no output per step, the text detokenized at the finish (the module's docstring).
    final_only: bool = False


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, prometheus: PrometheusMetrics | None = None) -> None:
        self.tokenizer = tokenizer
        self.prometheus = prometheus
        self._states: dict[str, _State] = {}  # by engine-core id (a sample's own id under a parent)
        self._parents: dict[str, ParentRequest] = {}
        self._parent_of: dict[str, ParentRequest] = {}  # sample id -> its parent

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._parents or (request_id in self._states and request_id not in self._parent_of)

    def __len__(self) -> int:
        return len(self._parents) + len(self._states) - len(self._parent_of)

    def request_ids(self) -> list[str]:
        """The callers' request ids in flight (a parent once, not its samples)."""
        return list(self._parents) + [r for r in self._states if r not in self._parent_of]

    def core_ids(self, request_id: str) -> list[str]:
        """The engine-core requests behind a caller's request: its samples, or itself."""
        parent = self._parents.get(request_id)
        return list(parent.child_ids) if parent is not None else [request_id]

    def owner_of(self, core_id: str) -> str:
        """The caller's request id that an engine-core request belongs to."""
        parent = self._parent_of.get(core_id)
        return parent.request_id if parent is not None else core_id

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_ns: int | None, samples: list[tuple[str, SamplingParams]] | None = None,
                    segments: tuple[PromptSegment, ...] = (), final_only: bool = False) -> None:
        """Track a request; ``samples`` (engine-core id, params) when it is fanned out;
        ``segments``: its chat prompt's parts, to name where it left the prefix cache;
        ``final_only``: the caller reads only its finished output (the module's docstring)."""
        if arrival_ns is not None and self.prometheus is not None:
            self.prometheus.observe_accepted()  # the same condition under which its finish is counted
        if not samples:
            self._add_state(request_id, prompt, prompt_token_ids, params, arrival_ns, observe_finish=True,
                            segments=segments, final_only=final_only)
            return
        parent = ParentRequest(request_id, params, [cid for cid, _ in samples])
        self._parents[request_id] = parent
        for cid, cparams in samples:
            self._add_state(cid, prompt, prompt_token_ids, cparams, arrival_ns, observe_finish=False,
                            segments=segments, final_only=final_only)
            self._parent_of[cid] = parent

    def _add_state(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                   arrival_ns: int | None, observe_finish: bool, segments: tuple[PromptSegment, ...] = (),
                   final_only: bool = False) -> None:
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens)
        self._states[request_id] = _State(
            request_id, prompt, prompt_token_ids, params, detok,
            RequestTimeline(arrival_ns) if arrival_ns is not None else None, [],
            [] if params.logprobs is not None else None,
            max_stop_len=max((len(s) for s in params.stop), default=0), observe_finish=observe_finish,
            prompt_segments=segments, final_only=final_only and not params.stop)

    def abort_request(self, request_id: str, events: dict[str, list[tuple[str, int]]] | None = None
                      ) -> RequestMetrics | None:
        """Forget an aborted request (all its samples); ``events``: each engine-core
        request's unreported timeline events. Returns its metrics (if recorded)."""
        events = events or {}
        parent = self._parents.pop(request_id, None)
        if parent is None:
            st = self._states.pop(request_id, None)
            if st is None:
                return None
            self._apply_events(st, events.get(request_id, ()))
            return self._finish_metrics(st, "abort")
        metrics = []
        for cid in parent.child_ids:
            self._parent_of.pop(cid, None)
            st = self._states.pop(cid, None)
            if st is None:
                continue
            self._apply_events(st, events.get(cid, ()))
            m = self._finish_metrics(st, "abort")
            if m is not None:
                metrics.append(m)
        slowest = parent.request_metrics(metrics)
        if slowest is not None and self.prometheus is not None:
            self.prometheus.observe_finished(slowest)
        return slowest

    def process(self, outputs: list[EngineCoreOutput], now_ns: int) -> tuple[list[RequestOutput], list[str]]:
        """Returns (request outputs, engine-core ids of requests a stop string ended that the
        engine core still runs: the caller finishes them there)."""
        results, to_stop = [], []
        touched: dict[str, set[int]] = {}  # parent id -> indices of its samples that progressed
        for co in outputs:
            st = self._states.get(co.request_id)
            if st is None:
                continue  # aborted while its step ran
            out, stopped_here = self._process_one(st, co, now_ns)
            if stopped_here and not co.finished:
                to_stop.append(co.request_id)
            if out is None:
                continue
            parent = self._parent_of.get(co.request_id)
            if parent is None:
                results.append(out)
                continue
            index = parent.index_of[co.request_id]
            parent.observe(index, out)
            touched.setdefault(parent.request_id, set()).add(index)
            if out.finished:
                self._parent_of.pop(co.request_id, None)
        for pid, indices in touched.items():
            parent = self._parents[pid]
            pout = parent.output(indices)
            if parent.finished:
                del self._parents[pid]
                if pout is not None and pout.metrics is not None and self.prometheus is not None:
                    self.prometheus.observe_finished(pout.metrics)
            if pout is not None:
                results.append(pout)
        return results, to_stop

    # -- one request -----------------------------------------------------------------------
    def _apply_events(self, st: _State, events) -> None:
        tl = st.timeline
        if tl is None:
            return
        for kind, ns in events:
            if kind == "scheduled":
                tl.on_scheduled(ns)
            elif kind == "preempted":
                tl.preempted_ns.append(ns)
                st.num_preemptions += 1

    def _process_one(self, st: _State, co: EngineCoreOutput, now_ns: int) -> tuple[RequestOutput | None, bool]:
        self._apply_events(st, co.events)
        if co.num_cached_tokens is not None:
            st.num_cached_tokens = co.num_cached_tokens
            if co.prefix_break_token >= 0:
                st.prefix_break = locate_break(len(st.prompt_token_ids), co.num_cached_tokens,
                                               co.prefix_break_token, st.prompt_segments)
        if co.prompt_logprobs is not None:
            st.prompt_logprobs = co.prompt_logprobs
        if co.num_draft_tokens:
            d, t, a = st.spec
            st.spec = (d + 1, t + co.num_draft_tokens, a + co.num_accepted_tokens)
            if self.prometheus is not None:
                self.prometheus.observe_spec(co.num_draft_tokens, co.num_accepted_tokens)
        if st.final_only:
            return self._process_final_only(st, co, now_ns), False
        stop_hit: str | None = None
        kept = 0
        # The EOS or stop token that ended the request stays in token_ids but not in the text
        # (as vLLM's detokenizer does; with skip_special_tokens off it would print "</s>"),
        # unless include_stop_str_in_output.
        last_silent = len(co.new_token_ids) - 1 if co.stop_token and not st.params.include_stop_str_in_output else -1
        for j, tok in enumerate(co.new_token_ids):
            st.token_ids.append(tok)
            kept = j + 1
            if st.detokenizer is None or j == last_silent:
                continue
            piece = st.detokenizer.append(tok)
            if not piece:
                continue
            before = len(st.text)
            st.text += piece
            if st.params.stop:
                hit = find_stop(st.text, st.params.stop, max(0, before - st.max_stop_len + 1))
                if hit is not None:
                    idx, stop_hit = hit
                    st.text = st.text[: idx + len(stop_hit) if st.params.include_stop_str_in_output else idx]
                    break
        new_ids = list(co.new_token_ids[:kept])
        self._count_tokens(st, co, kept, now_ns)
        finished = co.finished or stop_hit is not None
        if stop_hit is not None:
            finish_reason, stop_reason = "stop", stop_hit
        else:
            finish_reason, stop_reason = co.finish_reason, co.stop_reason
        # Hold back what could still be the start of a stop string (nothing once finished).
        hold = 0 if finished or not st.params.stop else st.max_stop_len - 1
        upto = max(len(st.text) - hold, st.num_streamed_chars)
        delta_text = st.text[st.num_streamed_chars : upto]
        st.num_streamed_chars = upto
        return self._output(st, finished, finish_reason, stop_reason, delta_text, new_ids, now_ns), stop_hit is not None

    def _process_final_only(self, st: _State, co: EngineCoreOutput, now_ns: int) -> RequestOutput | None:
        """A ``final_only`` request's step: its tokens kept, nothing detokenized or built
        until it finishes (no stop string can end it here: the engine core decides)."""
        st.token_ids.extend(co.new_token_ids)
        self._count_tokens(st, co, len(co.new_token_ids), now_ns)
        if not co.finished:
            return None
        if st.detokenizer is not None:
            # The stop token that ended it is not in the text (as in ``_process_one``).
            silent = len(st.token_ids) - 1 if co.stop_token and not st.params.include_stop_str_in_output else -1
            append = st.detokenizer.append
            st.text = "".join([append(t) for i, t in enumerate(st.token_ids) if i != silent])
        # The output is the whole of it: its "delta" is everything since the caller's last one.
        return self._output(st, True, co.finish_reason, co.stop_reason, st.text, list(st.token_ids), now_ns)

    def _count_tokens(self, st: _State, co: EngineCoreOutput, kept: int, now_ns: int) -> None:
        """The step's first ``kept`` tokens into the logprobs, the timeline and Prometheus."""
        if st.logprobs is not None and co.new_logprobs:
            st.logprobs.extend(co.new_logprobs[:kept])
        if st.timeline is not None:
            st.timeline.on_tokens(now_ns, kept)
        if self.prometheus is not None and kept:
            self.prometheus.observe_tokens(kept)

    def _output(self, st: _State, finished: bool, finish_reason: str | None, stop_reason: int | str | None,
                delta_text: str, new_ids: list[int], now_ns: int) -> RequestOutput:
        metrics = None
        if finished:
            self._states.pop(st.request_id, None)
            if st.timeline is not None and st.timeline.finished_ns is None:
                st.timeline.finished_ns = now_ns
            metrics = self._finish_metrics(st, finish_reason)
        completion = CompletionOutput(
            index=0,
            text=st.text,
            token_ids=list(st.token_ids),
            finish_reason=finish_reason if finished else None,
            stop_reason=stop_reason if finished else None,
            logprobs=st.logprobs,
            delta_text=delta_text,
            delta_token_ids=new_ids,
        )
        out = RequestOutput(
            request_id=st.request_id,
            prompt=st.prompt,
            prompt_token_ids=st.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            num_cached_tokens=max(st.num_cached_tokens, 0),
            num_preemptions=st.num_preemptions,
            prompt_logprobs=st.prompt_logprobs,
            delta_text=delta_text,
            delta_token_ids=new_ids,
            metrics=metrics,
        )
        return out

    def _finish_metrics(self, st: _State, finish_reason: str | None) -> RequestMetrics | None:
        if st.timeline is None:
            return None
        if st.timeline.finished_ns is None:
            st.timeline.finished_ns = time.perf_counter_ns()
        rm = RequestMetrics.from_timeline(st.request_id, st.timeline, len(st.prompt_token_ids),
                                          st.num_cached_tokens, finish_reason, st.spec, st.prefix_break)
        if self.prometheus is not None and st.observe_finish:
            self.prometheus.observe_finished(rm)
        return rm
