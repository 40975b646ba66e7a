"""Engine configuration: frozen dataclasses, validated once on construction.

Names follow vLLM's where the concept is the same (block_size, max_num_seqs,
max_num_batched_tokens, enable_prefix_caching, max_model_len).
"""

from __future__ import annotations

import os
import pathlib
from dataclasses import dataclass

from tailserve.errors import ConfigError

DEFAULT_KV_CACHE_MEMORY_BYTES = 1 << 30  # 1 GiB on the CPU
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # CUDA without kv_cache_memory_bytes: as vLLM
_SIZE_SUFFIXES = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
                  "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}
# tailserve serve --tool-call-kv-ttl (server/tools.py): seconds a tool call's KV stays the last to go.
DEFAULT_TOOL_CALL_KV_TTL_S = 5.0


def parse_bytes(text: str | int) -> int:
    """'2GiB', '512M', '1048576' -> bytes (binary units)."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    s = str(text).strip().lower().replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    suffix = s[len(num):]
    try:
        value = float(num)
    except ValueError:
        raise ConfigError(f"cannot read {text!r} as a size in bytes (e.g. 2GiB, 512MiB, 1000000)") from None
    if suffix not in _SIZE_SUFFIXES:
        raise ConfigError(f"unknown size unit {suffix!r} in {text!r} (use KiB, MiB or GiB)")
    return int(value * _SIZE_SUFFIXES[suffix])


SLO_KEYS = {"p99_tpot_ms": "tpot_s", "p99_ttft_ms": "ttft_s"}


@dataclass(frozen=True)
class SloBounds:
    """Latency bounds a request should meet (seconds; None: no bound on that figure)."""

    tpot_s: float | None = None
    ttft_s: float | None = None


def parse_slo(text: str) -> SloBounds:
    """``"p99_tpot_ms<=40,p99_ttft_ms<=500"`` -> SloBounds(0.04, 0.5). Either key may be left
    out, not both; each at most once."""
    if not isinstance(text, str):
        raise ConfigError(f"slo must be a string such as \"p99_tpot_ms<=40,p99_ttft_ms<=500\", got {text!r}")
    bounds: dict[str, float] = {}
    for item in text.split(","):
        key, sep, value = item.strip().partition("<=")
        key = key.strip()
        if not sep or key not in SLO_KEYS:
            raise ConfigError(f"slo: expected KEY<=MS with KEY in {', '.join(SLO_KEYS)}, got {item.strip()!r}")
        if SLO_KEYS[key] in bounds:
            raise ConfigError(f"slo: {key} is given twice")
        try:
            ms = float(value)
        except ValueError:
            raise ConfigError(f"slo: {item.strip()!r}: the bound must be a number of milliseconds") from None
        if not 0 < ms < float("inf"):
            raise ConfigError(f"slo: {item.strip()!r}: the bound must be a positive number of milliseconds")
        bounds[SLO_KEYS[key]] = ms / 1000.0
    return SloBounds(**bounds)


# At admission, keep free the KV blocks that each running request needs for its next this
# many tokens (at most what its max_tokens and the context leave). 0 admits while any block is
# free and preempts (recomputes) when blocks run out, vLLM V1's rule. Measured with
# benchmarks/bench_kv_capacity.py (96 mixed requests, 24-96 MiB, 2 AVX-512 cores): 64 took the
# preemptions from 12-33 to 0 and paged throughput up 5-19% (docs/benchmarks.md).
DEFAULT_ADMISSION_RESERVE_TOKENS = 64


# vLLM V0's default for what counts as a long prompt: 4% of the context length.
LONG_PREFILL_FRACTION = 0.04


def long_prefill_threshold(max_model_len: int) -> int:
    """Prompt tokens above which a prefill counts against ``max_long_partial_prefills``."""
    return max(1, int(max_model_len * LONG_PREFILL_FRACTION))


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    admission_reserve_tokens: int = DEFAULT_ADMISSION_RESERVE_TOKENS
    # vLLM V0's --max-long-partial-prefills: at most this many requests with more than
    # long_prefill_token_threshold prompt tokens still to compute get prompt tokens in one
    # step (0: no limit). Shorter prompts are not limited.
    max_long_partial_prefills: int = 0
    long_prefill_token_threshold: int = 81  # 4% of 2,048; EngineCore sets it from max_model_len
    # vLLM V0's --max-num-partial-prefills: at most this many requests with more than one
    # token still to compute get prompt tokens in one step, whatever their length (0: no
    # limit); max_long_partial_prefills limits the long ones among them further.
    max_num_partial_prefills: int = 0

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")
        for name in ("admission_reserve_tokens", "max_long_partial_prefills", "max_num_partial_prefills"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"{name} must be an integer >= 0, got {v!r}")


# Measured on the built-in pair over held-out prompts (docs/benchmarks.md): drafts whose
# top-1 minus top-2 margin was under 0.02 were accepted 43% of the time, those over 0.1
# about 90%. Stopping there costs nothing at batch 1 with the CPU's NumPy draft step and
# gains at batch 16, where every wasted draft is verified for 16 rows.
DEFAULT_DRAFT_STOP_MARGIN = 0.02


def decode_graph_batch_sizes(max_num_seqs: int, largest: int = 256) -> list[int]:
    """The batch sizes decodes are captured at (vLLM's buckets: 1, 2, 4, then every 8), up to
    max_num_seqs; a step of B decodes replays the smallest bucket >= B, padded."""
    cap = min(max_num_seqs, largest)
    sizes = [b for b in (1, 2, 4) if b <= cap] + list(range(8, cap + 1, 8))
    if cap not in sizes:
        sizes.append(cap)
    return sizes


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's ``--kv-events-config`` (same JSON fields and defaults): publish the prefix cache's
    block events over ZMQ for KV-aware routers (engine/kv_event_publisher.py)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" or "null"; None: zmq when events are enabled
    endpoint: str = "tcp://*:5557"  # PUB socket: bound when it has * or :: (or ipc/inproc), else connected
    replay_endpoint: str | None = None  # ROUTER socket for resync: batches from a sequence number on
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark
    max_queue_size: int = 100_000  # batches queued for the publisher thread
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in ("zmq", "null"):
            raise ConfigError(f"kv events: publisher must be zmq or null, got {self.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"kv events: {name} must be a positive integer, got {v!r}")
        for name in ("endpoint", "replay_endpoint"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v.startswith(("tcp://", "ipc://", "inproc://"))):
                raise ConfigError(f"kv events: {name} must be a ZMQ address (tcp://, ipc:// or inproc://), got {v!r}")
        if not isinstance(self.enable_kv_cache_events, bool) or not isinstance(self.topic, str):
            raise ConfigError("kv events: enable_kv_cache_events is a boolean and topic a string")

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """The JSON object vLLM's flag takes; an unknown field is an error, not ignored."""
        import json

        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--kv-events-config: not JSON ({e.msg} at character {e.pos})") from None
        if not isinstance(obj, dict):
            raise ConfigError("--kv-events-config: a JSON object, e.g. "
                              '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}\'')
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(obj) - known)
        if unknown:
            raise ConfigError(f"--kv-events-config: unknown field(s) {', '.join(unknown)} (known: "
                              f"{', '.join(sorted(known))})")
        return cls(**obj)


PREFIX_CACHING_HASH_ALGOS = ("builtin", "sha256_cbor_64bit")
ENGINE_LOOPS = ("auto", "inline", "thread")

# The histogram families of vLLM's --custom-histogram-buckets (vllm/v1/metrics/buckets.py's
# names) that tailserve has, and the histograms each covers (metrics/prometheus.py; the
# vllm:* mirrors under --gateway-metrics follow theirs).
HISTOGRAM_FAMILIES = {
    "request_latency": "e2e latency, queue, prefill, decode and inference time",
    "time_to_first_token": "time to first token",
    "inter_token_latency": "inter-token latency and time per output token",
    "request_tokens": "prompt and generation tokens per request",
    "engine_step": "engine step duration (tailserve's own)",
}
# vLLM families with no tailserve histogram: named in the error rather than ignored.
_VLLM_ONLY_FAMILIES = ("iteration_tokens", "request_params_n", "kv_cache_residency")


def parse_histogram_buckets(text: str) -> tuple[tuple[str, tuple[float, ...]], ...]:
    """vLLM's ``--custom-histogram-buckets`` JSON: ``{"family": [upper bounds, ...]}``; a
    listed family replaces its default buckets in every histogram of the family."""
    import itertools
    import json
    import math

    flag = "--custom-histogram-buckets"
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{flag}: not JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(obj, dict) or not obj:
        raise ConfigError(f'{flag}: a JSON object of families, e.g. \'{{"request_latency": [0.01, 0.05, 0.1, 1]}}\'')
    out = []
    for family, bounds in obj.items():
        if family in _VLLM_ONLY_FAMILIES:
            raise ConfigError(f"{flag}: tailserve has no {family} histogram (families: "
                              f"{', '.join(HISTOGRAM_FAMILIES)})")
        if family not in HISTOGRAM_FAMILIES:
            raise ConfigError(f"{flag}: unknown family {family!r} (families: {', '.join(HISTOGRAM_FAMILIES)})")
        if not isinstance(bounds, list) or not bounds or not all(
                isinstance(b, int | float) and not isinstance(b, bool) and math.isfinite(b) and b > 0
                for b in bounds) or any(a >= b for a, b in itertools.pairwise(bounds)):
            raise ConfigError(f"{flag}: {family} needs a non-empty list of positive, finite, increasing upper "
                              f"bounds, got {bounds!r}")
        out.append((family, tuple(float(b) for b in bounds)))
    return tuple(out)


KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32")


# --speculative-draft-quantization: weight-only int8, int8 weights and activations, or the draft's own.
DRAFT_QUANTIZATIONS = ("int8", "w8a8_int8", "none")


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = "auto"
    device: str = "cpu"
    block_size: int = 16
    # The target's KV-cache element type (vLLM's --kv-cache-dtype): "auto" takes the model's
    # dtype, except that the float32 CPU model --dtype auto makes over a bf16/fp16 checkpoint's
    # compact weights stores its K/V in the checkpoint's dtype (what the model computes in natively; half the
    # bytes); "bfloat16", "float16" or "float32" choose. The draft model keeps its own.
    kv_cache_dtype: str = "auto"
    # KV-cache bytes (per rank). None: DEFAULT_KV_CACHE_MEMORY_BYTES on the CPU; on CUDA what
    # gpu_memory_utilization leaves after a profiling pass (memory/kv_sizing.py).
    kv_cache_memory_bytes: int | str | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    admission_reserve_tokens: int = DEFAULT_ADMISSION_RESERVE_TOKENS  # (see SchedulerConfig)
    # Long prompts prefilled per step (see SchedulerConfig; long: more than 4% of
    # max_model_len). 0: no limit (vLLM V1's behaviour, and the offline default here);
    # None: the plan decides (plan_partial_prefills: 1 on the CPU; tailserve serve's default).
    max_long_partial_prefills: int | None = 0
    # Prompts of any length prefilled per step (see SchedulerConfig): 0, no limit; None, the
    # plan decides (plan_partial_prefills: 2 on the CPU; tailserve serve's default).
    max_num_partial_prefills: int | None = 0
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    seed: int = 0
    # Attention kernels: "auto" (the PyTorch reference for now), "torch", or "triton" (the
    # paged Triton kernel, attention/triton_paged.py; needs pip install triton).
    attention_backend: str = "auto"
    # Quantisation of the target's projections and LM head: None, "int8" (weight-only,
    # model/linear.py Int8WeightOnlyLinearMethod) or "w8a8_int8" (int8 weights and per-row int8
    # activations, Int8DynamicActivationLinearMethod; CPU with the compiled kernels). The draft
    # model keeps its own precision (--speculative-draft-quantization).
    quantization: str | None = None
    # Compiled CPU kernels (kernels/cpu: compact-weight products for decode, built with
    # the system C compiler on first use): for int8 weights with float32 activations, and for
    # a bf16/fp16 checkpoint that --dtype auto computes in float32. False: PyTorch's kernels.
    cpu_kernels: bool = True
    # Reorder projection weights for oneDNN on the CPU (much faster GEMV; see model/linear.py).
    cpu_onednn: bool = True
    # Record request timelines, step figures and Prometheus metrics.
    enable_metrics: bool = True
    # Also export the load gauges Kubernetes inference gateways read, under vLLM's names
    # (vllm:num_requests_waiting, ...; metrics/prometheus.py GATEWAY_GAUGES).
    gateway_metrics: bool = False
    # Name reported by /v1/models and in metric labels (default: the model folder's name).
    served_model_name: str | None = None
    # Speculative decoding. speculative_model: a checkpoint folder or "builtin"; method
    # "draft_model" (implied by a model), "ngram", or "hybrid" (n-gram lookup where it finds
    # a match of >= ngram_min tokens, the draft model elsewhere). num_speculative_tokens fixes k; without
    # it k is chosen per step (adaptive, up to speculative_max_tokens).
    speculative_model: str | None = None
    speculative_method: str | None = None
    num_speculative_tokens: int | None = None
    speculative_max_tokens: int = 8
    # The draft model's dtype. "auto": float32 when the draft's steps run in NumPy (see
    # speculative_draft_numpy) or, on the CPU, through the compiled kernels over a bf16/fp16
    # checkpoint's compact weights; else the target's. Any dtype keeps decoding lossless: only
    # acceptance depends on q.
    speculative_draft_dtype: str = "auto"
    # int8 for the draft model's projections (vLLM: the speculative config's "quantization"):
    # "int8" weight-only; "w8a8_int8" (SGLang's name) int8 weights and int8 activations,
    # quantised per row inside the compiled CPU kernels' products (CPU only). Lossless like any
    # draft (only acceptance depends on q). On a CPU a draft step then reads half its bf16
    # bytes, and the draft pushes fewer of the target's weights out of the cache between target
    # steps (docs/speculative.md, "Against the analytical limit"); w8a8_int8 also drops the
    # widening of every weight. None: what the plan finds measured faster (``plan_draft``), else
    # the draft's own weights; "none": never.
    speculative_draft_quantization: str | None = None
    # Run a single sequence's draft-chain steps in NumPy (CPU, float32 draft, no sliding
    # window; see speculative/numpy_draft.py). None: when possible, the draft is small (up to
    # NUMPY_DRAFT_MAX_PARAMETERS) and the compiled kernels cannot take it (they are faster on a
    # bf16/fp16 draft checkpoint); True: required; False: off.
    speculative_draft_numpy: bool | None = None
    # A request's draft chain stops after a draft whose top-1 minus top-2 probability (in the
    # draft's own q) is below this; 0 = always draft k tokens. None: DEFAULT_DRAFT_STOP_MARGIN
    # when k is adaptive, 0 when num_speculative_tokens fixes it. See DraftModelProposer.
    speculative_draft_stop_margin: float | None = None
    ngram_min: int = 1
    ngram_max: int = 4
    # Suffix decoding (speculative_method "suffix", and hybrid's first source;
    # speculative/suffix.py): the longest suffix matched, drafts at most factor x the match
    # length, stop below this cumulative probability, finished requests kept in the global cache.
    suffix_max_depth: int = 24
    suffix_max_spec_factor: float = 1.0
    suffix_min_token_prob: float = 0.1
    suffix_cache_max_requests: int = 4096
    # LOSSY benchmark mode (vLLM's synthetic acceptance): every draft is accepted with this
    # probability whatever the target says, so speed can be measured for any acceptance rate.
    # Refused unless TAILSERVE_BENCHMARK=1 is set; never a request field.
    speculative_synthetic_acceptance: float | None = None
    # How drafts are verified: "token" (token by token, Leviathan et al.) or "block" (the
    # draft block as a whole, Sun et al. 2025: the same distribution, at least as many
    # drafts accepted on average). See sample/rejection.py.
    speculative_verification: str = "token"
    # What adaptive k maximises: "throughput" (tokens/s) or "goodput" (tokens/s of the
    # requests that meet the latency bounds in slo, e.g. "p99_tpot_ms<=40,p99_ttft_ms<=500";
    # see speculative/adaptive.py). Goodput needs slo; slo needs goodput.
    speculative_objective: str = "throughput"
    slo: str | None = None
    # PYTORCH_CUDA_ALLOC_CONF for this process (validated, applied before CUDA initialises;
    # see memory/allocator/control.py). Without kv_cache_memory_bytes, the KV cache takes what
    # gpu_memory_utilization (default 0.9) leaves after a profiling pass of the largest step.
    cuda_alloc_conf: str | None = None
    # One meaning, vLLM's: the share of the GPU's memory the engine plans for (weights,
    # activations and the KV cache, which takes what is left after a profiling pass).
    gpu_memory_utilization: float | None = None
    # A hard cap on this process's CUDA memory (torch.cuda.set_per_process_memory_fraction),
    # separate from the planning share: the caching allocator's garbage_collection_threshold
    # acts only with one set.
    cuda_memory_fraction: float | None = None
    # At start-up, run the forward once per decode batch size (1..WARMUP_MAX_BATCH, at most
    # max_num_seqs), per power-of-two prefill length (16..512, at most max_num_batched_tokens)
    # and for one step of 128-token prompts filling max_num_batched_tokens (at most 2,048), so
    # the kernels' one-time costs per shape are not paid by the first requests. tailserve
    # serve turns it on (--no-warmup turns it off).
    warmup: bool = False
    # CUDA: decodes run as CUDA graphs captured at start-up per batch-size bucket
    # (decode_graph_batch_sizes; padded to the bucket). True: always eager. CPU and tensor
    # parallelism are always eager.
    enforce_eager: bool = False
    # Record the CUDA caching allocator's history from start-up, for memory snapshots with
    # allocation sites and device_traces (memory/allocator/snapshot.py). CUDA only.
    record_memory_history: bool = False
    # Tensor parallelism: one process per rank (engine/tensor_parallel.py); gloo on the
    # CPU, NCCL on CUDA (rank r on cuda:r). kv_cache_memory_bytes is per rank.
    tensor_parallel_size: int = 1
    # CPU: size the intra-op thread pool to the cores other processes leave free, re-measured
    # every 0.25 s (engine/cpu_threads.py). None: on unless TAILSERVE_CPU_THREADS_ADAPT=0.
    cpu_threads_adapt: bool | None = None
    # ``tailserve serve``: where the engine loop runs (``plan_target`` decides "auto"):
    # "inline" = a task on the HTTP event loop's thread, steps and streaming taking turns;
    # "thread" = its own thread, outputs handed to the event loop's thread each step.
    engine_loop: str = "auto"
    # Prometheus histogram buckets per family (vLLM's --custom-histogram-buckets): its JSON
    # text, or the parsed ((family, bounds), ...). None: tailserve's defaults (metrics/prometheus.py).
    custom_histogram_buckets: str | tuple[tuple[str, tuple[float, ...]], ...] | None = None
    # KV-cache events for prefix-aware routers (vLLM's --kv-events-config): a KVEventsConfig
    # or its JSON text. See engine/kv_event_publisher.py.
    kv_events_config: KVEventsConfig | str | None = None
    # The prefix cache's block hash (vLLM's --prefix-caching-hash-algo; memory/block_hash.py):
    # "builtin" (Python's hash: fastest, not recomputable outside CPython) or
    # "sha256_cbor_64bit" (what llm-d's KV-cache indexer recomputes). None: sha256_cbor_64bit
    # when KV events are published, else builtin.
    prefix_caching_hash_algo: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, str | pathlib.Path) or not str(self.model):
            raise ConfigError("model must be a path to a checkpoint folder")
        object.__setattr__(self, "model", str(self.model))
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"
                              + (" (fp8 KV caches are not supported)" if "fp8" in str(self.kv_cache_dtype) else ""))
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ConfigError(f"device must be cpu or cuda[:N], got {self.device!r}")
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ConfigError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
        if tp > 1 and self.device not in ("cpu", "cuda"):
            raise ConfigError(f"with tensor_parallel_size > 1, device must be cpu or cuda (rank r uses cuda:r), "
                              f"got {self.device!r}")
        if self.record_memory_history and not self.device.startswith("cuda"):
            raise ConfigError("record_memory_history records the CUDA caching allocator: it needs device cuda")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ConfigError(f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}")
        if self.quantization not in (None, "int8", "w8a8_int8"):
            raise ConfigError(f"quantization must be int8, w8a8_int8 or unset, got {self.quantization!r}")
        if self.quantization == "w8a8_int8" and self.device != "cpu":
            raise ConfigError("quantization w8a8_int8 runs in the compiled CPU kernels: it needs device cpu "
                              f"(got {self.device!r}; int8 is weight-only int8 on any device)")
        if self.gateway_metrics and not self.enable_metrics:
            raise ConfigError("gateway_metrics needs metrics (drop --disable-metrics)")
        if isinstance(self.block_size, bool) or self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ConfigError(f"block_size must be a power of two from 1 to 128, got {self.block_size!r}")
        if self.kv_cache_memory_bytes is not None:
            object.__setattr__(self, "kv_cache_memory_bytes", parse_bytes(self.kv_cache_memory_bytes))
            if self.kv_cache_memory_bytes <= 0:
                raise ConfigError("kv_cache_memory_bytes must be positive")
        if self.max_model_len is not None and (isinstance(self.max_model_len, bool)
                                               or not isinstance(self.max_model_len, int)
                                               or self.max_model_len < 2):
            raise ConfigError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        if not self.enable_chunked_prefill and self.max_model_len is not None \
                and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError("without chunked prefill, max_num_batched_tokens must be >= max_model_len")
        _ = self.scheduler_config  # validates the scheduler fields
        if self.engine_loop not in ENGINE_LOOPS:
            raise ConfigError(f"engine_loop must be one of {', '.join(ENGINE_LOOPS)}, got {self.engine_loop!r}")
        if self.cpu_threads_adapt is None:
            object.__setattr__(self, "cpu_threads_adapt", os.environ.get("TAILSERVE_CPU_THREADS_ADAPT", "1") != "0")
        if isinstance(self.custom_histogram_buckets, str):
            object.__setattr__(self, "custom_histogram_buckets", parse_histogram_buckets(self.custom_histogram_buckets))
        if self.custom_histogram_buckets and not self.enable_metrics:
            raise ConfigError("custom_histogram_buckets sets the buckets of metrics: drop --disable-metrics")
        kv_events = self.kv_events_config
        if isinstance(kv_events, str):
            kv_events = KVEventsConfig.from_json(kv_events)
        elif kv_events is not None and not isinstance(kv_events, KVEventsConfig):
            raise ConfigError("kv_events_config must be a KVEventsConfig or its JSON text")
        object.__setattr__(self, "kv_events_config", kv_events)
        algo = self.prefix_caching_hash_algo
        if algo is None:
            algo = "sha256_cbor_64bit" if kv_events is not None and kv_events.enabled else "builtin"
        if algo not in PREFIX_CACHING_HASH_ALGOS:
            raise ConfigError(f"prefix_caching_hash_algo must be one of {', '.join(PREFIX_CACHING_HASH_ALGOS)}, "
                              f"got {algo!r}")
        object.__setattr__(self, "prefix_caching_hash_algo", algo)
        method = self.speculative_method
        if method is None and self.speculative_model is not None:
            method = "draft_model"
        if method not in (None, "draft_model", "ngram", "suffix", "hybrid"):
            raise ConfigError(f"speculative_method must be draft_model, ngram, suffix or hybrid, got {method!r}")
        if not (isinstance(self.suffix_max_depth, int) and self.suffix_max_depth >= 1
                and self.suffix_max_spec_factor > 0 and 0 <= self.suffix_min_token_prob <= 1
                and isinstance(self.suffix_cache_max_requests, int) and self.suffix_cache_max_requests >= 0):
            raise ConfigError("suffix decoding: suffix_max_depth >= 1, suffix_max_spec_factor > 0, "
                              "suffix_min_token_prob in [0, 1], suffix_cache_max_requests >= 0")
        if method in ("draft_model", "hybrid") and not self.speculative_model:
            raise ConfigError(f"speculative_method {method} needs speculative_model (a folder or 'builtin')")
        object.__setattr__(self, "speculative_method", method)
        a = self.speculative_synthetic_acceptance
        if a is not None:
            if os.environ.get("TAILSERVE_BENCHMARK") != "1":
                raise ConfigError("speculative_synthetic_acceptance makes outputs wrong on purpose (drafts accepted "
                                  "at random): it is for benchmarks only; set TAILSERVE_BENCHMARK=1 to allow it")
            if isinstance(a, bool) or not isinstance(a, int | float) or not 0.0 <= a <= 1.0:
                raise ConfigError(f"speculative_synthetic_acceptance must be in [0, 1], got {a!r}")
            if method is None:
                raise ConfigError("speculative_synthetic_acceptance needs a speculative method")
        if self.speculative_verification not in ("token", "block"):
            raise ConfigError(f"speculative_verification must be token or block, got {self.speculative_verification!r}")
        if self.speculative_verification == "block" and a is not None:
            raise ConfigError("speculative_verification block: synthetic acceptance replaces verification altogether")
        if self.speculative_objective not in ("throughput", "goodput"):
            raise ConfigError("speculative_objective must be throughput or goodput, "
                              f"got {self.speculative_objective!r}")
        if self.speculative_objective == "goodput":
            if self.slo is None:
                raise ConfigError('speculative_objective goodput needs slo (e.g. "p99_tpot_ms<=40,p99_ttft_ms<=500")')
            if method is None or self.num_speculative_tokens is not None:
                raise ConfigError("speculative_objective goodput chooses k per step: it needs a speculative method "
                                  "and no num_speculative_tokens")
        elif self.slo is not None:
            raise ConfigError("slo bounds what speculative_objective goodput maximises: set that objective too")
        if self.slo is not None:
            parse_slo(self.slo)  # a bad bound fails here, naming it
        k = self.num_speculative_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 16):
            raise ConfigError(f"num_speculative_tokens must be an integer in [1, 16], got {k!r}")
        if self.speculative_draft_dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError("speculative_draft_dtype must be auto, float32, bfloat16 or float16, "
                              f"got {self.speculative_draft_dtype!r}")
        if self.speculative_draft_numpy not in (None, True, False):
            raise ConfigError("speculative_draft_numpy must be true, false or unset, "
                              f"got {self.speculative_draft_numpy!r}")
        if self.speculative_draft_numpy and not self.device == "cpu":
            raise ConfigError("speculative_draft_numpy runs the draft in NumPy, which needs device cpu")
        if self.speculative_draft_quantization not in (None, *DRAFT_QUANTIZATIONS):
            raise ConfigError(f"speculative_draft_quantization must be {', '.join(DRAFT_QUANTIZATIONS)} or unset, "
                              f"got {self.speculative_draft_quantization!r}")
        if self.speculative_draft_quantization == "w8a8_int8" and self.device != "cpu":
            raise ConfigError("speculative_draft_quantization w8a8_int8 runs in the compiled CPU kernels: it needs "
                              f"device cpu (got {self.device!r}; int8 is weight-only int8 on any device)")
        if self.speculative_draft_quantization is not None:
            if method not in ("draft_model", "hybrid"):
                raise ConfigError("speculative_draft_quantization sets a draft model's weights: it needs "
                                  "speculative_model (speculative_method draft_model or hybrid)")
            if self.speculative_draft_numpy and self.speculative_draft_quantization in ("int8", "w8a8_int8"):
                raise ConfigError("speculative_draft_numpy runs float32 weights in NumPy: it cannot take "
                                  f"speculative_draft_quantization {self.speculative_draft_quantization}")
        if self.speculative_draft_numpy and self.speculative_draft_dtype not in ("auto", "float32"):
            raise ConfigError("speculative_draft_numpy needs a float32 draft "
                              f"(speculative_draft_dtype is {self.speculative_draft_dtype!r})")
        m = self.speculative_draft_stop_margin
        if m is not None and (isinstance(m, bool) or not isinstance(m, int | float) or not 0.0 <= m < 1.0):
            raise ConfigError(f"speculative_draft_stop_margin must be a number in [0, 1), got {m!r}")
        if not 1 <= self.speculative_max_tokens <= 16:
            raise ConfigError("speculative_max_tokens must be in [1, 16]")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ConfigError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")
        u = self.gpu_memory_utilization
        if u is not None and (isinstance(u, bool) or not isinstance(u, int | float) or not 0.0 < u <= 1.0):
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {u!r}")
        f = self.cuda_memory_fraction
        if f is not None and (isinstance(f, bool) or not isinstance(f, int | float) or not 0.0 < f <= 1.0):
            raise ConfigError(f"cuda_memory_fraction must be in (0, 1], got {f!r}")
        if self.cuda_alloc_conf is not None:
            from tailserve.memory.allocator.conf import parse_alloc_conf

            parse_alloc_conf(self.cuda_alloc_conf)  # a bad key or value fails here, naming it

    @property
    def draft_stop_margin(self) -> float:
        """The stop margin in force (see speculative_draft_stop_margin)."""
        if self.speculative_draft_stop_margin is not None:
            return float(self.speculative_draft_stop_margin)
        return 0.0 if self.num_speculative_tokens is not None else DEFAULT_DRAFT_STOP_MARGIN

    @property
    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, self.enable_chunked_prefill,
                               self.admission_reserve_tokens, self.max_long_partial_prefills or 0,
                               max_num_partial_prefills=self.max_num_partial_prefills or 0)
