"""``LLMEngine``: the three stages composed, one step at a time.

``Processor`` (validate, tokenize; any thread) -> ``EngineCore`` (schedule, execute,
update) -> ``OutputProcessor`` (detokenize, stop strings, logprobs, outputs, metrics).
``add_request`` validates and queues; ``step`` runs one engine-core step and returns the
outputs of the requests that progressed; ``abort_request`` ends a request and frees its
blocks. The server's async engine and the offline ``LLM`` both drive this loop.
"""

from __future__ import annotations

import itertools
import logging
import pathlib
import time
from collections.abc import Callable
from typing import Any

import torch

from tailserve.assets import resolve_model_path
from tailserve.config import EngineConfig
from tailserve.engine.core import EngineCore, EngineStepError
from tailserve.engine.cpu_threads import make_governor
from tailserve.engine.kv_event_publisher import KVEventPublisher
from tailserve.engine.output_processor import OutputProcessor
from tailserve.engine.parallel_sampling import child_params, child_request_id
from tailserve.engine.processor import PreparedRequest, Processor, Prompt
from tailserve.engine.request import RequestStatus
from tailserve.errors import ConfigError, InvalidRequestError
from tailserve.memory.allocator.monitor import AllocatorMonitor
from tailserve.memory.allocator.snapshot import cuda_snapshot
from tailserve.memory.kv_figures import KVCacheFigures
from tailserve.metrics.prefix_break import PromptSegment
from tailserve.metrics.prometheus import PrometheusMetrics
from tailserve.metrics.timeline import RequestMetrics
from tailserve.model.linear import native_rows
from tailserve.model.tokenizer import Tokenizer
from tailserve.outputs import RequestOutput
from tailserve.sampling_params import SamplingParams
from tailserve.structured.grammar import GrammarCompiler

__all__ = ["EngineStepError", "LLMEngine", "PreparedRequest", "Prompt"]

# Decode batch sizes warmed at start-up: every size up to this one (each its own shape).
WARMUP_MAX_BATCH = 32


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        model_dir = pathlib.Path(resolve_model_path(config.model))
        self.tokenizer = Tokenizer.maybe_load(model_dir)
        tok_eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        # KV events: sockets opened before the model loads, so a port in use fails at once.
        self.kv_events: KVEventPublisher | None = None
        if config.kv_events_config is not None and config.kv_events_config.enabled:
            self.kv_events = KVEventPublisher(config.kv_events_config,
                                              medium="GPU" if config.device.startswith("cuda") else "CPU")
        try:
            self.core = EngineCore(config, frozenset() if tok_eos is None else frozenset({tok_eos}))
        except BaseException:
            if self.kv_events is not None:
                self.kv_events.shutdown()
            raise
        info = self.info = self.core.info
        self.model_dir = info.model_dir
        self.max_model_len = self.core.max_model_len
        tokenizer = self.tokenizer
        self.grammar_compiler = None if tokenizer is None else GrammarCompiler(
            tokenizer.to_json, info.arch.vocab_size, sorted(self.core.eos_token_ids))
        self.processor = Processor(self.tokenizer, info.arch.vocab_size, self.max_model_len, config.block_size,
                                   info.num_blocks, str(self.model_dir), self.grammar_compiler)
        self.model_name = config.served_model_name or self.model_dir.name
        self.metrics_enabled = config.enable_metrics
        self.prometheus = PrometheusMetrics(self.model_name, config.custom_histogram_buckets) \
            if config.enable_metrics else None  # type: ignore[arg-type]
        if self.prometheus is not None and config.gateway_metrics:
            self.prometheus.enable_gateway_metrics(config.block_size, info.num_blocks, config.enable_prefix_caching,
                                                   str(info.plan.kv_dtype).removeprefix("torch."))
        self.output_processor = OutputProcessor(self.tokenizer, self.prometheus)
        self.allocator_settings = info.allocator_settings
        self.dtype, self.dtype_reason = info.dtype, info.dtype_reason
        if self.prometheus is not None:
            a = self.allocator_settings
            self.prometheus.alloc_conf_info.labels(self.model_name, a.text or "default", a.source).set(1)
        self._ids = itertools.count()
        if config.speculative_synthetic_acceptance is not None:
            logging.getLogger("tailserve.engine").warning(
                "synthetic acceptance %.2f: drafts accepted at random, outputs are NOT the model's (benchmarks only)",
                config.speculative_synthetic_acceptance)
        self.warmup_s: float | None = None
        if config.warmup:
            self.warmup_s = self.warm_up()
        self.allocator_monitor: AllocatorMonitor | None = None
        self.thread_governor = make_governor(torch.get_num_threads()) if info.plan.adapt_threads else None
        # Where memory snapshots come from: the CUDA allocator, or nothing on a CPU.
        self.snapshot_source: Callable[[], dict[str, Any]] | None = cuda_snapshot if info.device.type == "cuda" \
            else None
        if info.device.type == "cuda":
            device = info.device
            self.attach_allocator_monitor(AllocatorMonitor(lambda: torch.cuda.memory_stats(device)))

    def attach_allocator_monitor(self, monitor: AllocatorMonitor) -> None:
        """Sample the CUDA caching allocator with ``monitor`` after steps (every N steps or T
        seconds); its figures go to Prometheus and ``health()``."""
        if self.prometheus is not None:
            prom = self.prometheus
            monitor.on_sample = lambda m: prom.observe_allocator(m.figures())
        self.allocator_monitor = monitor

    def warm_up(self) -> float:
        """Pay the kernels' one-time costs per shape before serving (see EngineConfig.warmup);
        returns the seconds it took."""
        t0 = time.perf_counter()
        c = self.config
        decode = list(range(1, min(c.max_num_seqs, WARMUP_MAX_BATCH) + 1))
        lengths = (16, 32, 64, 128, 256, 512)
        if self.info.plan.model.linear.native_large_batches:
            # Native (oneDNN) prompt products set up a primitive per row count, padded to
            # native_rows' buckets: each bucket up to 512 rows now, or a prompt of a length in
            # a bucket not seen yet paid 2-4 ms more (2 AVX-512 bf16 + AMX cores, built-in target).
            lengths = tuple(sorted({16, *(native_rows(n) for n in range(17, 513))}))
        prefill = [n for n in lengths if n <= c.max_num_batched_tokens and n < self.max_model_len]
        # The burst a server meets first: 128-token prompts filling a step (at most 2,048 tokens).
        burst = min(c.max_num_batched_tokens, 2048) if self.max_model_len > 128 else 0
        self.core.worker.warm_up(decode, prefill, burst)
        return time.perf_counter() - t0

    def attach_snapshot_source(self, source: Callable[[], dict[str, Any]] | None) -> None:
        """Take memory snapshots from ``source`` (a stand-in where no CUDA device exists)."""
        self.snapshot_source = source

    def memory_snapshot(self) -> dict[str, Any]:
        """The CUDA caching allocator's snapshot now, as plain data (``_dump_snapshot``'s
        dict; with ``record_memory_history`` it has the allocation history and sites)."""
        if self.snapshot_source is None:
            raise ConfigError(f"memory snapshots are of the CUDA caching allocator; this engine runs on "
                              f"{self.info.device}, which has none")
        return self.snapshot_source()

    def health(self) -> dict[str, object]:
        """``{"status": "ok" | "degraded", ...}``: degraded while the allocator monitor alerts."""
        out: dict[str, object] = {"status": "ok", "cuda_allocator": self.allocator_settings.as_dict(),
                                  "plan": self.info.plan.describe()}
        if self.config.speculative_synthetic_acceptance is not None:
            out["synthetic_acceptance"] = self.config.speculative_synthetic_acceptance  # LOSSY: say so
        if self.allocator_monitor is not None:
            out.update(self.allocator_monitor.health())
            out["cuda_memory"] = self.allocator_monitor.figures()
        return out

    # -- read-only views of the stages, for callers, tests and benchmarks ----------------------
    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def block_pool(self):
        return self.core.block_pool

    @property
    def runner(self):
        """Rank 0's model runner (white-box view: in-process only)."""
        return self.core.worker.local.runner

    @property
    def proposer(self):
        return self.core.worker.local.runner.proposer

    @property
    def spec_stats(self):
        return self.core.scheduler.spec_stats

    @property
    def spec_controller(self):
        return self.core.scheduler.speculation

    @property
    def arch(self):
        return self.info.arch

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.core.eos_token_ids

    @property
    def step_log(self):
        return self.core.step_log

    @property
    def num_steps(self) -> int:
        return self.core.num_steps

    # -- requests ------------------------------------------------------------------------
    def prepare_request(self, prompt: Prompt, params: SamplingParams | None = None,
                        segments: tuple[PromptSegment, ...] = ()) -> PreparedRequest:
        """Tokenize and validate without touching engine state (safe from another thread);
        ``segments``: a rendered chat prompt's parts (``Processor.process``)."""
        return self.processor.process(prompt, params, segments)

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_ns: int | None = None, final_only: bool = False) -> str:
        """Validate and queue a request. ``arrival_ns`` (perf_counter_ns) lets a server stamp
        the moment the request arrived rather than when it reached the engine; with
        ``final_only`` ``step()`` returns only its finished output (vLLM's ``FINAL_ONLY``)."""
        return self.add_prepared(self.processor.process(prompt, params), request_id, arrival_ns, final_only)

    def add_prepared(self, prepared: PreparedRequest, request_id: str | None = None,
                     arrival_ns: int | None = None, final_only: bool = False) -> str:
        arrival_ns = time.perf_counter_ns() if arrival_ns is None else arrival_ns
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.output_processor:
            raise InvalidRequestError(f"request id {rid!r} is already in use", "request_id")
        params = prepared.params
        samples = None
        if params.num_samples > 1:  # parallel sampling: samples forked from one computed prompt
            samples = [(child_request_id(rid, i), child_params(params, i)) for i in range(params.num_samples)]
            self.core.add_samples(prepared, samples, arrival_ns)
        else:
            self.core.add_request(rid, prepared, arrival_ns)
        self.output_processor.add_request(rid, prepared.prompt, prepared.prompt_token_ids, params,
                                          arrival_ns if self.metrics_enabled else None, samples,
                                          prepared.prompt_segments, final_only)
        return rid

    def unpin_request(self, request_id: str, num_samples: int = 1) -> None:
        """A finished request's answer was final: end the pin its ``kv_pin_s`` set (each of its
        ``num_samples`` samples: ``SamplingParams.num_samples``)."""
        self.core.unpin([request_id] if num_samples == 1 else
                        [child_request_id(request_id, i) for i in range(num_samples)])

    def abort_request(self, request_id: str) -> RequestMetrics | None:
        """End a request (all its samples) now and free its blocks; returns its metrics (if
        recorded)."""
        events = self.core.finish_requests(self.output_processor.core_ids(request_id), RequestStatus.FINISHED_ABORTED)
        return self.output_processor.abort_request(request_id, events)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def check_health(self) -> None:
        """Raise ``EngineDeadError`` if the engine cannot go on (a tensor-parallel worker died)."""
        self.core.worker.check_health()

    def shutdown(self) -> None:
        """Stop what outlives the engine object (tensor-parallel worker processes, the KV
        event publisher)."""
        self.core.worker.shutdown()
        if self.kv_events is not None:
            self.kv_events.shutdown()

    def request_ids(self) -> list[str]:
        """Requests in flight, by the ids callers gave them."""
        return self.output_processor.request_ids()

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.output_processor)

    # -- figures ---------------------------------------------------------------------------
    def kv_figures(self) -> KVCacheFigures:
        """The KV cache's figures right now (a pass over the blocks: not for every step)."""
        return self.core.scheduler.kv_figures(self.info.kv_bytes_per_block)

    def metrics_exposition(self, num_waiting: int | None = None) -> bytes:
        """Prometheus text with the live gauges refreshed (``num_waiting`` from a caller
        that queues requests before they reach the scheduler)."""
        if self.prometheus is None:
            raise RuntimeError("metrics are disabled")
        sched = self.core.scheduler
        self.prometheus._c["running"].set(sched.num_running)
        self.prometheus._c["waiting"].set(sched.num_waiting if num_waiting is None else num_waiting)
        self.prometheus.observe_kv(self.kv_figures())
        if sched.suffix_cache is not None:
            self.prometheus.observe_suffix_cache(sched.suffix_cache.num_requests, sched.suffix_cache.nbytes)
        return self.prometheus.exposition()

    # -- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine step. A failure that is not a ``TailserveError`` raises
        ``EngineStepError`` naming the requests of that step, which are aborted; every
        other request goes on at the next step."""
        if self.thread_governor is not None:
            self.thread_governor.on_step()
        try:
            core_outputs = self.core.step()
        except EngineStepError as e:
            # A failed sample fails its whole request: its other samples are aborted too.
            owners = list(dict.fromkeys(self.output_processor.owner_of(rid) for rid in e.request_ids))
            for rid in owners:
                self.abort_request(rid)
            raise EngineStepError(str(e), owners) from e.__cause__
        outputs, to_stop = self.output_processor.process(core_outputs, time.perf_counter_ns())
        if to_stop:
            self.core.finish_requests(to_stop, RequestStatus.FINISHED_STOPPED)
        self.core.end_step()
        if self.kv_events is not None:
            events = self.core.block_pool.events
            if events:
                self.kv_events.publish(events.drain())
        if self.allocator_monitor is not None:
            self.allocator_monitor.maybe_sample(self.core.num_steps)
        if self.prometheus is not None and core_outputs and self.core.step_log:
            ps = self.core.block_pool.stats
            self.prometheus.observe_step(self.core.step_log[-1], ps.queries_tokens, ps.hits_tokens)
            ctl = self.core.scheduler.speculation
            if ctl is not None and ctl.num_goodput_overrides:
                self.prometheus.observe_goodput_overrides(ctl.num_goodput_overrides)
        return outputs
