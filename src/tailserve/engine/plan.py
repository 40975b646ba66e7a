"""The execution plan: every "how does this run here" decision, made once, before anything loads.

``plan_target(config, arch, device, caps)`` and ``plan_draft(...)`` are pure functions of the
engine's configuration, the checkpoint's architecture, the device and what the platform can
do (``Capabilities``, detected once by ``detect_capabilities``). They return frozen plans that
hold each decision with the reason for it: the dtype, how linear layers multiply, which
norms and activations run, whether a decode step is one compiled call per layer, the
attention backend, the CUDA-graph buckets, the sampler's kernels and, for a draft model, its
dtype, chain step and backend. The worker only applies a plan (load, size, build); nothing
is changed on an object after it is built, and the hot path never asks again what the
plan decided. The plan is logged at start-up and shown in ``/health``: "why is it slow
here" starts with what runs and why.

Tested as a table (tests/test_plan.py): (device, dtype, flags, kernels available) -> plan.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import pathlib
from dataclasses import dataclass, field

import torch

from tailserve.config import EngineConfig, decode_graph_batch_sizes
from tailserve.engine import huge_pages, worker_spin
from tailserve.errors import ConfigError
from tailserve.model.config import ModelArchConfig, parse_dtype
from tailserve.model.linear import CpuCompactWeightsLinearMethod
from tailserve.model.llama import FusedDecodeLayer
from tailserve.platform_info import cpu_flags, cpu_has_native, resolve_auto_dtype
from tailserve.speculative.numpy_draft import NUMPY_DRAFT_MAX_PARAMETERS

# The CPU decode kernel's limits (kernels/cpu/gemv_avx2.c): a float32 model (its cache float32,
# bf16 or fp16), head sizes that are multiples of 8, at most 512.
_CPU_DECODE_MAX_HEAD_DIM = 512


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Capabilities:
    """What this platform can do, detected once (``detect_capabilities``) or written by hand
    in a test. ``cpu_kernels``: the compiled CPU kernels built and loaded here."""

    cpu_flags: frozenset[str] = frozenset()
    cpu_kernels: bool = False
    cpu_kernels_reason: str = "not detected"
    # The kernels' panel products of 3+ rows run AVX-512 tiles (kernels.cpu, TAILSERVE_CPU_AVX512).
    cpu_kernels_wide_tiles: bool = False
    onednn: bool = False
    cuda: bool = False
    cuda_capability: tuple[int, int] | None = None
    triton: bool = False
    # TRITON_INTERPRET=1: Triton runs its kernels on the CPU (tests); without it a Triton kernel
    # handed CPU tensors fails at its first launch.
    triton_interpreter: bool = False
    memory_bytes: int = 0  # the machine's physical memory (0: unknown)

    @property
    def cpu_capability(self) -> str:
        """The vector extensions that matter here, as a short word for logs and figures."""
        f = self.cpu_flags
        if not f:
            return "unknown"
        parts = ["AVX-512" if "avx512f" in f else "AVX2" if "avx2" in f else "no AVX2"]
        if f & {"avx512_bf16", "amx_bf16", "bf16"}:
            parts.append("bf16")
        return " ".join(parts)


def detect_capabilities(device: torch.device, want_cpu_kernels: bool = True) -> Capabilities:
    """Look at this process's platform once. The compiled CPU kernels are built (about a
    second, then cached) only when the device is the CPU and they are wanted."""
    from tailserve.model.linear import onednn_available

    kernels_ok, reason, wide_tiles = False, "--no-cpu-kernels", False
    if device.type == "cpu" and want_cpu_kernels:
        from tailserve.kernels import cpu as cpu_kernels

        k = cpu_kernels.kernels()
        kernels_ok = k is not None
        wide_tiles = k is not None and k.wide_tiles
        reason = "built" if kernels_ok else cpu_kernels.unavailable_reason() or "unavailable"
    elif device.type != "cpu":
        reason = "not a CPU device"
    cuda = device.type == "cuda" and torch.cuda.is_available()
    # Found, not imported: importing Triton costs start-up time an engine that does not use it
    # should not pay.
    has_triton = importlib.util.find_spec("triton") is not None
    return Capabilities(cpu_flags=cpu_flags(), cpu_kernels=kernels_ok, cpu_kernels_reason=reason,
                        cpu_kernels_wide_tiles=wide_tiles,
                        onednn=device.type == "cpu" and onednn_available(), cuda=cuda,
                        cuda_capability=torch.cuda.get_device_capability(device) if cuda else None,
                        triton=has_triton, triton_interpreter=os.environ.get("TRITON_INTERPRET") == "1",
                        memory_bytes=_physical_memory_bytes())


def _physical_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX system that reports it
        return 0


@dataclass(frozen=True)
class LinearPlan:
    """How every projection of one model multiplies (``model.linear.build_linear_method``).

    method: "plain" | "onednn-packed" | "cpu-compact-weights" | "int8-weight-only" | "int8-w8a8";
    compact_dtype: the checkpoint dtype compact weights stay in (cpu-compact-weights);
    keep_float32: also keep the float32 weights for batches above the kernel's rows;
    native_large_batches: batches above the kernel's rows multiply in the compact dtype (a CPU
    with native bf16/fp16 products);
    panel_packed: bf16 weights re-laid in 16-column panels, every batch through the
    outer-product kernel (a CPU without native bf16); with native_large_batches as well, every
    batch but a prompt step's, whose native products read a row-major copy kept beside; with
    int8-weight-only, the int8 weights in 16-column panels, every batch through them;
    cpu_kernels: int8 batches through the compiled kernel (every batch in panels, with
    panel_packed)."""

    method: str
    reason: str
    compact_dtype: torch.dtype | None = None
    keep_float32: bool = False
    cpu_kernels: bool = False
    native_large_batches: bool = False
    panel_packed: bool = False


@dataclass(frozen=True)
class ModelPlan:
    """The decisions one model (target or draft) shares: dtype, linear method, layer ops,
    attention backend and whether decode layers fuse into one compiled call."""

    dtype: torch.dtype
    dtype_reason: str
    linear: LinearPlan
    layer_ops: str  # "torch" | "cpu-kernels"
    layer_ops_reason: str
    attention_backend: str  # "torch-reference" | "cpu-decode" | "triton-paged"
    attention_reason: str
    fuse_decode_layers: bool
    fuse_reason: str

    def describe(self) -> dict[str, str]:
        return {
            "dtype": f"{_name(self.dtype)} ({self.dtype_reason})",
            "linear": f"{self.linear.method} ({self.linear.reason})",
            "layer_ops": f"{self.layer_ops} ({self.layer_ops_reason})",
            "attention": f"{self.attention_backend} ({self.attention_reason})",
            "fused_decode_layers": f"{'yes' if self.fuse_decode_layers else 'no'} ({self.fuse_reason})",
        }


@dataclass(frozen=True)
class DraftPlan:
    """How the draft model runs: its folder and architecture, its own ``ModelPlan``, and its
    chain step for one sequence ("numpy", "torch", or "batched": always through its backend)."""

    model_dir: pathlib.Path
    arch: ModelArchConfig
    model: ModelPlan
    chain_step: str
    chain_reason: str

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def numpy_step(self) -> bool:
        return self.chain_step == "numpy"

    def describe(self) -> dict[str, str]:
        return {**self.model.describe(), "chain_step": f"{self.chain_step} ({self.chain_reason})"}


@dataclass(frozen=True)
class TargetPlan:
    """Every platform decision of one engine: the target model's, the sampler's, the CUDA-graph
    buckets, and the draft model's (None without one)."""

    device: torch.device
    model: ModelPlan
    decode_graph_sizes: tuple[int, ...]
    graphs_reason: str
    sampler_kernels: bool
    sampler_reason: str
    cpu_capability: str
    draft: DraftPlan | None = field(default=None)
    # Constrained decoding: a step with at least this many constrained rows fills its grammar
    # masks on another thread while the forward runs, a smaller one before it; and whether
    # the fill itself runs on llguidance's thread pool.
    grammar_overlap_min_rows: int = 1
    grammar_masks_parallel: bool = False
    grammar_masks_reason: str = ""
    # Speculative decoding: the most rows (decoding requests x (1 + k)) the adaptive controller
    # lets a verification step take (None: no limit). Past the fused decode layer's rows the
    # target falls to the general path, a cliff no cost line fits: measured on the built-in
    # pair (AVX2), k = 16 at batch 1 (17 rows) gave 1.48x where k = 12 gave 3.77x.
    max_verify_rows: int | None = None
    max_verify_rows_reason: str = ""
    # CPU: whether the engine sizes its thread pool to the cores other processes leave free
    # (engine/cpu_threads.py).
    adapt_threads: bool = False
    adapt_threads_reason: str = ""
    # The target's KV-cache element type (``plan_kv_cache_dtype``); None: the model's dtype.
    kv_cache_dtype: torch.dtype | None = None
    kv_cache_dtype_reason: str = "the model's dtype"
    # ``tailserve serve``: "inline" (the engine loop a task on the event loop's thread) or
    # "thread" (its own thread); server/run.py, engine/async_engine.py.
    engine_loop: str = "thread"
    engine_loop_reason: str = ""
    # Prompts prefilled per step, all and long ones (0: no limit); plan_partial_prefills.
    max_num_partial_prefills: int = 0
    max_long_partial_prefills: int = 0
    partial_prefills_reason: str = ""
    # libgomp's spin after a parallel region (engine/worker_spin.py): set by ``tailserve serve``
    # before torch loads, so the plan reports it rather than chooses it.
    worker_spin: str = ""
    worker_spin_reason: str = ""
    # PyTorch's large CPU buffers on 2 MiB pages (engine/huge_pages.py): set by the worker
    # before anything loads, so the plan reports it rather than chooses it.
    huge_pages: bool = False
    huge_pages_reason: str = ""

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.kv_cache_dtype or self.model.dtype

    def with_draft(self, draft: DraftPlan | None) -> TargetPlan:
        return dataclasses.replace(self, draft=draft)

    def describe(self) -> dict[str, object]:
        """The plan as plain strings (the start-up log and ``/health``)."""
        graphs = ", ".join(map(str, self.decode_graph_sizes)) if self.decode_graph_sizes else "none"
        out: dict[str, object] = {
            "device": str(self.device), "cpu": self.cpu_capability, **self.model.describe(),
            "decode_graphs": f"{graphs} ({self.graphs_reason})",
            "sampler": f"{'compiled cut-offs' if self.sampler_kernels else 'torch'} ({self.sampler_reason})",
            "grammar_masks": f"beside the forward from {self.grammar_overlap_min_rows} rows"
                             f"{', on llguidance threads' if self.grammar_masks_parallel else ''} "
                             f"({self.grammar_masks_reason})",
            "verify_rows": f"{self.max_verify_rows or 'any'} ({self.max_verify_rows_reason})",
            "cpu_threads": f"{'adaptive' if self.adapt_threads else 'fixed'} ({self.adapt_threads_reason})",
            "kv_cache_dtype": f"{_name(self.kv_dtype)} ({self.kv_cache_dtype_reason})",
            "engine_loop": f"{self.engine_loop} ({self.engine_loop_reason})",
            "prefills_per_step": f"{self.max_num_partial_prefills or 'any'}, long ones "
                                 f"{self.max_long_partial_prefills or 'any'} ({self.partial_prefills_reason})",
            "cpu_worker_spin": f"{self.worker_spin} ({self.worker_spin_reason})",
            "cpu_huge_pages": f"{'on' if self.huge_pages else 'off'} ({self.huge_pages_reason})",
        }
        if self.draft is not None:
            out["draft"] = self.draft.describe()
        return out


# Panels beside the rows (a CPU with native bf16 products) while the second copy takes at most
# this share of the machine's memory.
PANEL_COPY_MAX_MEMORY_SHARE = 1 / 8


def _linear_plan(device: torch.device, dtype: torch.dtype, checkpoint_dtype: torch.dtype, config: EngineConfig,
                 caps: Capabilities, quantization: str | None, keep_float32: bool = False,
                 weight_bytes: int = 0, quantization_flag: str = "--quantization") -> LinearPlan:
    """``weight_bytes``: the checkpoint's weights in its own dtype (what a second copy costs);
    ``quantization_flag``: the option that asked for ``quantization`` (for the reason), or the
    reason itself where the plan chose int8 (it then starts with "int8" or "w8a8")."""
    cpu = device.type == "cpu"
    kernels = cpu and config.cpu_kernels and caps.cpu_kernels
    if quantization == "w8a8_int8":  # int8 weights and activations (a draft's default on the kernels, or asked for)
        why = quantization_flag if quantization_flag.startswith("w8a8") else f"{quantization_flag} w8a8_int8"
        if not (kernels and dtype == torch.float32):
            raise ConfigError(f"{why} runs in the compiled CPU kernels on a float32 model (here: "
                              + (f"{_name(dtype)}" if kernels else f"no kernels, {_kernels_off(config, caps)}") + ")")
        return LinearPlan("int8-w8a8", why + "; int8 activations quantised per row, the products summed in int32 "
                          "(the compiled CPU kernels' W8A8 panels)", cpu_kernels=True, panel_packed=True)
    if quantization == "int8":
        why = quantization_flag if quantization_flag.startswith("int8") else f"{quantization_flag} int8"
        if not (kernels and dtype == torch.float32):
            return LinearPlan("int8-weight-only", why, cpu_kernels=kernels)
        # Every batch through int8 panels (16 columns, k-major: the outer-product kernel the
        # bf16 panels use), prompt steps included, in place of the row-major int8: that kernel
        # widens inside a dot product and falls behind from ~4 rows, and PyTorch's takes larger
        # batches in bf16 at about half the panels' speed. The 55M Llama of the peers table in
        # int8 on 2 Xeon cores (AVX-512) decoded 607 / 1,188 / 1,393 tok/s at batch 1 / 4 / 16
        # through the rows and 600 / 1,617 / 2,166 through panels (bf16 panels: 495 / 1,460 /
        # 2,053); 256 rows of the built-in draft's head took 1.8 ms against 4.1 ms.
        return LinearPlan("int8-weight-only", why + "; every batch through the compiled CPU kernel's 16-column "
                          "int8 panels", cpu_kernels=True, panel_packed=True)
    # A float32 model of a bf16/fp16 checkpoint on the CPU keeps the weights in the
    # checkpoint's dtype (widening is exact: the same products, half the bytes) where the
    # compiled kernels run.
    if kernels and dtype == torch.float32 and checkpoint_dtype in (torch.bfloat16, torch.float16):
        # Only under --dtype auto: an explicit float32 asks for float32 products throughout.
        native = config.dtype == "auto" and cpu_has_native(checkpoint_dtype, caps.cpu_flags) and not keep_float32
        # Without native bf16 products, bf16 weights go in the outer-product kernel's panel
        # layout for every batch size: at 16 rows and up ~90% of the FMA peak against 65-80%
        # for the row-major kernel, batch 1 at least as fast (2 AVX2 cores, docs/benchmarks.md).
        # Native prefill (and a kept float32 copy) read the row layout. With native products
        # the panels still decode faster (2 Xeon cores, AVX-512 bf16, built-in target: batch 1
        # 1.04-1.05x, 4 1.06-1.07x, 16 1.15-1.17x, repeated suffix decoding 2.32-2.44x -> 2.58-2.66x
        # of plain), while prefill through them is 2-2.5x slower than native (128 tokens
        # 7.6-8.0 -> 15.2-16.0 ms): so both layouts are kept where the second copy is small
        # beside the machine's memory, the rows only for the native products of prompt steps.
        bf16_rows = checkpoint_dtype == torch.bfloat16 and not keep_float32  # panels could replace them
        both = native and bf16_rows and 0 < weight_bytes <= caps.memory_bytes * PANEL_COPY_MAX_MEMORY_SHARE
        panels = bf16_rows and (not native or both)
        layout = ""
        if both:
            layout = (f"; panels (16 columns) for decode and verification beside the rows for prefill: "
                      f"at most {weight_bytes / 2**20:.0f} MiB more, within 1/{round(1 / PANEL_COPY_MAX_MEMORY_SHARE)} "
                      f"of memory")
        elif panels:
            layout = "; re-laid in 16-column panels, every batch through the outer-product kernel"
        elif native and bf16_rows:
            layout = (f"; rows only (a panel copy for decode would take {weight_bytes / 2**20:.0f} MiB, over "
                      f"1/{round(1 / PANEL_COPY_MAX_MEMORY_SHARE)} of memory)" if weight_bytes
                      else "; rows only (the weights' size not given)")
        return LinearPlan("cpu-compact-weights",
                          f"float32 arithmetic over the {_name(checkpoint_dtype)} weights as stored"
                          + (f"; batches above {CpuCompactWeightsLinearMethod.SMALL_BATCH} rows (prefill) in native "
                             f"{_name(checkpoint_dtype)}" if native else "")
                          + layout,
                          compact_dtype=checkpoint_dtype, keep_float32=keep_float32, native_large_batches=native,
                          panel_packed=panels)
    if cpu and config.cpu_onednn and caps.onednn:
        why = "oneDNN's blocked weight layout"
        if cpu and dtype == torch.float32 and checkpoint_dtype in (torch.bfloat16, torch.float16):
            why += f" (compact weights need the compiled CPU kernels: {_kernels_off(config, caps)})"
        return LinearPlan("onednn-packed", why)
    return LinearPlan("plain", "F.linear" + ("" if not cpu else " (--no-cpu-onednn)" if not config.cpu_onednn
                                             else " (oneDNN unavailable)"))


def _kernels_off(config: EngineConfig, caps: Capabilities) -> str:
    return "--no-cpu-kernels" if not config.cpu_kernels else caps.cpu_kernels_reason


def _cpu_decode_handles(head_dim: int, dtype: torch.dtype) -> bool:
    return head_dim % 8 == 0 and head_dim <= _CPU_DECODE_MAX_HEAD_DIM and dtype == torch.float32


def _model_plan(device: torch.device, dtype: torch.dtype, dtype_reason: str, arch: ModelArchConfig,
                config: EngineConfig, caps: Capabilities, linear: LinearPlan, tp_size: int,
                attention: str) -> ModelPlan:
    cpu = device.type == "cpu"
    kernels = cpu and config.cpu_kernels and caps.cpu_kernels
    if kernels and dtype == torch.float32:
        ops, ops_why = "cpu-kernels", "float32 on the CPU: one compiled pass per norm and activation"
    else:
        ops = "torch"
        ops_why = ("not a CPU device" if not cpu else f"compiled CPU kernels off: {_kernels_off(config, caps)}"
                   if not kernels else f"{_name(dtype)}: the compiled kernels compute float32")
    if attention == "auto":
        if ops == "cpu-kernels" and _cpu_decode_handles(arch.head_dim, dtype):
            backend, backend_why = "cpu-decode", "float32 CPU with the compiled kernels: paged decode kernel " \
                                                 "for steps of up to 16 tokens a sequence"
        else:
            backend = "torch-reference"
            backend_why = "auto: the reference (the Triton kernel decodes faster on an H200, its long-prompt " \
                          "prefill is not measured yet: --attention-backend triton)" \
                if not cpu else "auto on the CPU without the decode kernel (" + (
                    ops_why if ops != "cpu-kernels" else f"head size {arch.head_dim} or dtype unsupported") + ")"
    elif attention == "torch":
        backend, backend_why = "torch-reference", "--attention-backend torch"
    elif attention == "triton":
        if not caps.triton:
            raise ConfigError("attention_backend: attention backend 'triton' needs Triton: pip install triton")
        if cpu and not caps.triton_interpreter:
            raise ConfigError("attention_backend: attention backend 'triton' runs on a CUDA device (--device cuda); "
                              "on the CPU only in Triton's interpreter (TRITON_INTERPRET=1, for tests)")
        backend, backend_why = "triton-paged", "--attention-backend triton"
    else:
        raise ConfigError(f"attention_backend: unknown attention backend {attention!r}")
    fuse = backend == "cpu-decode" and tp_size == 1 and not arch.qk_norm
    if fuse:
        fuse_why = "decode steps of up to 16 rows in one compiled call per layer (layers with compact or int8 " \
                   "weights and no biases)"
    else:
        fuse_why = ("the CPU decode backend is not in use" if backend != "cpu-decode"
                    else "tensor parallelism" if tp_size != 1 else "q/k norms")
    return ModelPlan(dtype, dtype_reason, linear, ops, ops_why, backend, backend_why, fuse, fuse_why)


def plan_target(config: EngineConfig, arch: ModelArchConfig, device: torch.device, caps: Capabilities,
                tp_size: int = 1) -> TargetPlan:
    """The target model's plan, and the engine-wide decisions (sampler, graphs)."""
    if config.dtype == "auto":
        dtype, dtype_reason = resolve_auto_dtype(arch.dtype, device, caps.cpu_flags)
        if device.type == "cpu" and dtype in (torch.bfloat16, torch.float16) and config.cpu_kernels \
                and caps.cpu_kernels:
            # Even with native bf16 products, decode is faster as float32 over the compact
            # weights: measured on 2 AVX-512 bf16 cores (PEERS shape, 2026-12-03), batch 1
            # 225 tok/s against 107 native, batch 16 974 against 851; prefill keeps the native
            # products (CpuCompactWeightsLinearMethod.native_large_batches).
            dtype = torch.float32
            dtype_reason = f"float32: the compiled kernels decode faster than native {_name(arch.dtype)}"
    else:
        dtype, dtype_reason = parse_dtype(config.dtype), "--dtype"
    linear = _linear_plan(device, dtype, arch.dtype, config, caps, config.quantization,
                          weight_bytes=arch.num_parameters * arch.dtype.itemsize)
    if linear.method == "cpu-compact-weights":
        dtype_reason += (f"; weights kept in {_name(arch.dtype)} as stored (float32 arithmetic, compiled AVX2 kernels"
                         + (", AVX-512 tiles for 3+ rows" if linear.panel_packed and caps.cpu_kernels_wide_tiles
                            else "") + ")")
    model = _model_plan(device, dtype, dtype_reason, arch, config, caps, linear, tp_size, config.attention_backend)
    cuda = device.type == "cuda"
    graph_capture = model.attention_backend in ("torch-reference", "triton-paged")
    if cuda and not config.enforce_eager and tp_size == 1 and graph_capture:
        sizes, why = tuple(decode_graph_batch_sizes(config.max_num_seqs)), "CUDA graphs for decode steps"
    else:
        sizes = ()
        why = ("not CUDA" if not cuda else "--enforce-eager" if config.enforce_eager
               else "tensor parallelism" if tp_size != 1 else f"{model.attention_backend} cannot be captured")
    kernels = device.type == "cpu" and config.cpu_kernels and caps.cpu_kernels
    sampler_why = "top-k / top-p cut-offs by quickselect in the compiled kernels" if kernels else (
        "not a CPU device" if device.type != "cpu" else f"sort-based cut-offs ({_kernels_off(config, caps)})")
    # Measured on 2 AVX2 cores (benchmarks/bench_structured.py, docs/benchmarks.md, four
    # sittings): one request's mask takes ~90 us, less than handing it to a thread while
    # OpenMP keeps the cores busy (before the forward won every sitting at batch 1, e.g. 0.98x
    # of unconstrained against 0.82x); sixteen take ~1 ms (4,096 tokens) to ~9 ms (152k),
    # where beside the forward was ahead on average but within the noise. A GPU's host only
    # waits for the device: always beside it, on llguidance's threads.
    gpu = device.type != "cpu"
    min_rows = 1 if gpu else 4
    masks_why = ("the host waits on the device meanwhile" if gpu
                 else "on the CPU a hand-off costs more than one or two requests' masks")
    if model.fuse_decode_layers:
        rows, rows_why = FusedDecodeLayer.MAX_ROWS, "the fused decode layer's rows: adaptive k stays within them"
    else:
        rows, rows_why = None, "no fused decode layer"
    # Measured on 2 AVX-512 cores (benchmarks/bench_busy_core.py): beside one busy core batch-1
    # decode ran 28 tok/s on 2 threads and 92 on 1, against 107 alone on 2.
    adapt = device.type == "cpu" and tp_size == 1 and bool(config.cpu_threads_adapt)
    adapt_why = ("one thread fewer while another process takes a core: the thread sharing it would hold up "
                 "every product" if adapt else "not a CPU device" if device.type != "cpu"
                 else "tensor parallelism: each rank keeps its threads" if tp_size != 1
                 else "cpu_threads_adapt off")
    kv_dtype, kv_why = plan_kv_cache_dtype(config, model, arch.dtype)
    loop, loop_why = plan_engine_loop(config, device)
    prefills, long_prefills, prefills_why = plan_partial_prefills(config, device)
    spin, spin_why = worker_spin.current()
    huge, huge_why = huge_pages.current() if device.type == "cpu" else (False, "not a CPU device")
    return TargetPlan(device, model, sizes, why, kernels, sampler_why, caps.cpu_capability,
                      grammar_overlap_min_rows=min_rows, grammar_masks_parallel=gpu,
                      grammar_masks_reason=masks_why, max_verify_rows=rows, max_verify_rows_reason=rows_why,
                      adapt_threads=adapt, adapt_threads_reason=adapt_why, kv_cache_dtype=kv_dtype,
                      kv_cache_dtype_reason=kv_why, engine_loop=loop, engine_loop_reason=loop_why,
                      max_num_partial_prefills=prefills, max_long_partial_prefills=long_prefills,
                      partial_prefills_reason=prefills_why, worker_spin=spin, worker_spin_reason=spin_why,
                      huge_pages=huge, huge_pages_reason=huge_why)


def plan_partial_prefills(config: EngineConfig, device: torch.device) -> tuple[int, int, str]:
    """How many prompts, and how many long ones (over 4% of max_model_len), one step may
    prefill; 0: no limit.

    ``tailserve serve`` leaves them to the plan (None); the offline API and an explicit
    ``--max-num-partial-prefills`` / ``--max-long-partial-prefills`` fix them. On the CPU a
    step's time grows with its prompt tokens: a step that prefills many prompts at once makes
    every request in it wait for all of them, and requests that start together with equal
    lengths finish together, so a burst stays a burst, wave after wave. A few prefills per step
    beside the decodes spread them. Measured on 2 AVX2 cores, 64 x 128/128 at 16 concurrent:
    one long prefill per step took ``vllm bench serve``'s TTFT P50 to 174-200 ms in every load
    (55M Llama), against 172-770 ms swinging between loads; repeated prompts (16 tokens each
    left to compute after the prefix cache, so not long) went from ~60 ms with no limit to
    ~30 ms with two prefills a step (~25 ms with one; the built-in target), at the same
    throughput. Two, not one: a short prompt behind a long one then shares its step (long
    anyway) instead of waiting for the next (vLLM V0's reason for two limits). On a GPU a
    step of many prompts is short; vLLM V1's rule (no limit) holds."""
    num, long = config.max_num_partial_prefills, config.max_long_partial_prefills
    if num is not None and long is not None:
        return num, long, "--max-num-partial-prefills, --max-long-partial-prefills" if num or long \
            else "no limit (the offline default)"
    told = "".join(f"; {flag} as given" for flag, v in (("--max-num-partial-prefills", num),
                                                         ("--max-long-partial-prefills", long)) if v is not None)
    if device.type == "cpu":
        why = "on the CPU a step of many prompts delays them all; a few at a time spread a burst" + told
        return (2 if num is None else num), (1 if long is None else long), why
    return num or 0, long or 0, "a GPU prefills many prompts in one short step" + told


def plan_engine_loop(config: EngineConfig, device: torch.device) -> tuple[str, str]:
    """Where ``tailserve serve`` runs the engine loop: on the event loop's thread ("inline")
    or its own ("thread").

    On the CPU the HTTP work and the steps share the same cores, so they take turns anyway;
    inline they take them on one thread, and a token reaches the socket without the two
    cross-thread wake-ups a hand-off costs (measured on 2 AVX-512 cores, 55M Llama, one
    stream, benchmarks/bench_server_overhead.py: the server's added TPOT 0.28-0.42 ms
    against 0.45-0.96 ms with the hand-off). On a GPU the host mostly waits for the device
    during a step; on its own thread the engine leaves the event loop free to stream and
    accept meanwhile."""
    if config.engine_loop != "auto":
        return config.engine_loop, "--engine-loop"
    if device.type == "cpu":
        return "inline", "the CPU runs steps and HTTP alike: they take turns on one thread, no hand-off per token"
    return "thread", "the event loop streams and accepts while a step waits on the device"


def plan_kv_cache_dtype(config: EngineConfig, model: ModelPlan,
                        checkpoint_dtype: torch.dtype) -> tuple[torch.dtype, str]:
    """The target's KV-cache element type (``--kv-cache-dtype``). "auto" is the model's dtype
    (vLLM's rule), except where ``--dtype auto`` made a float32 CPU model over a bf16/fp16
    checkpoint's compact weights: its K/V are stored in the checkpoint's dtype, as the model
    computes them natively, and widened as the decode kernel reads them (every format the
    kernel reads: float32, bf16, fp16). Half the bytes: twice the tokens in the same
    ``--kv-cache-memory``, and half the context read per decode step. Measured on 2 AVX-512
    cores (built-in target, 6 layers, 2 KV heads of 64): 32 sequences at 600-token contexts
    attend in 3.8 ms a step from bf16 against 7.8 from float32 (118 MB of float32 K/V no
    longer stays in cache)."""
    if config.kv_cache_dtype != "auto":
        kv = parse_dtype(config.kv_cache_dtype)
        if model.attention_backend == "triton-paged" and kv != model.dtype:
            raise ConfigError(f"kv_cache_dtype {config.kv_cache_dtype}: the Triton attention kernel reads a KV "
                              f"cache of the model's dtype ({_name(model.dtype)}); use auto")
        return kv, "--kv-cache-dtype"
    compact = model.linear.method == "cpu-compact-weights" and checkpoint_dtype in (torch.bfloat16, torch.float16)
    # Under --dtype auto only: an explicit --dtype float32 asks for float32 throughout.
    if compact and config.dtype == "auto" and model.attention_backend == "cpu-decode":
        return checkpoint_dtype, (f"the checkpoint's {_name(checkpoint_dtype)}: half the bytes of float32 K/V, "
                                  "widened as the decode kernel reads them")
    return model.dtype, "the model's dtype"


# The reason a draft plan gives for int8 weights nobody asked for (``plan_draft``).
DEFAULT_INT8_DRAFT_REASON = ("w8a8_int8 by default for a bf16/fp16 draft on the compiled CPU kernels, where it "
                             "was measured faster (--speculative-draft-quantization int8: weight-only; none: the "
                             "draft's own weights)")


def uses_draft_model(config: EngineConfig) -> bool:
    """Whether the speculative method runs a draft model (n-gram lookup has none)."""
    return config.speculative_method in ("draft_model", "hybrid")


def plan_draft(config: EngineConfig, draft_dir: pathlib.Path, arch: ModelArchConfig, device: torch.device,
               caps: Capabilities, target_dtype: torch.dtype) -> DraftPlan:
    """The draft model's plan (its own precision; the target's attention choice)."""
    cpu = device.type == "cpu"
    kernels = cpu and config.cpu_kernels and caps.cpu_kernels
    half = arch.dtype in (torch.bfloat16, torch.float16)
    # A bf16/fp16 draft checkpoint on a CPU with the compiled kernels runs in float32 over its
    # compact weights, single sequences included: measured on the built-in pair at batch 1
    # (docs/benchmarks.md), greedy 352 tok/s against 291 with the NumPy step.
    quant, quant_flag = config.speculative_draft_quantization, "--speculative-draft-quantization"
    float_draft = config.speculative_draft_dtype in ("auto", "float32")
    if quant == "none":
        quant = None
    elif quant is None and kernels and half and float_draft and not config.speculative_draft_numpy:
        # Such a draft's weights go to int8 by default, and its activations too, per row inside
        # each product (lossless: the target verifies every draft): the draft reads half the
        # bytes, evicts fewer of the target's weights from the cache between its steps, and
        # multiplies without widening its weights. Built-in pair, 40 interleaved batches
        # (docs/benchmarks.md): on 2 Xeon cores with AVX-512 (sessions 42 and 48-50) batch 1
        # greedy k = 4 1.69x of off (bf16) -> 1.74x (int8) -> 1.91x (w8a8_int8), t = 0.8 k = 4
        # 1.21x -> 1.27x -> 1.38x, batch 4 greedy k = 2 1.068x -> 1.081x -> 1.090x; on 2 AMD
        # EPYC (Zen 4) cores (session 51) batch 1 greedy k = 4 1.49x -> 1.60x -> 1.65x, and with
        # the kernels' AVX-512 off (TAILSERVE_CPU_AVX512=0: the AVX2 tiles, the AVX2 W8A8
        # products; a stand-in for the AVX2-only Zen 3 machines) 1.29x -> 1.37x -> 1.46x, t = 0.8
        # 1.14x -> 1.16x -> 1.19x, batch 4 greedy k = 2 0.96x -> 1.005x -> 1.02x.
        quant, quant_flag = "w8a8_int8", DEFAULT_INT8_DRAFT_REASON
    compact = kernels and half and float_draft and quant is None
    numpy_step = config.speculative_draft_numpy
    if numpy_step is None:
        numpy_step = (cpu and config.speculative_draft_dtype in ("auto", "float32") and arch.sliding_window is None
                      and arch.num_parameters <= NUMPY_DRAFT_MAX_PARAMETERS and not compact and quant is None)
    elif numpy_step and arch.sliding_window is not None:
        raise ConfigError("speculative_draft_numpy: the NumPy draft step has no sliding window, "
                          "and this draft model uses one")
    if config.speculative_draft_dtype != "auto":
        dtype, why = parse_dtype(config.speculative_draft_dtype), "--speculative-draft-dtype"
    elif numpy_step or compact:
        dtype = torch.float32
        why = "float32 for the NumPy chain step" if numpy_step else \
            f"float32 over compact {_name(arch.dtype)} weights (compiled kernels)"
    elif quant in ("int8", "w8a8_int8") and kernels:
        dtype, why = torch.float32, "float32 over int8 weights (compiled kernels)"
    else:
        dtype, why = target_dtype, "the target's dtype"
    # Batched chain steps of up to 16 rows through the compiled kernels on compact weights;
    # the float32 weights are kept too for more rows (a draft is small). With int8 the draft's
    # projections are int8 whatever the rows.
    linear = _linear_plan(device, dtype, arch.dtype, config, caps, quant, keep_float32=True,
                          quantization_flag=quant_flag)
    # The draft's batched forwards take the CPU decode kernel where the target's auto would,
    # and otherwise the proposer's own reference metadata (slot tables computed once per
    # round); a sliding-window draft always takes the reference's general builder.
    auto = config.attention_backend == "auto" and arch.sliding_window is None
    model = _model_plan(device, dtype, why, arch, config, caps, linear, 1, "auto" if auto else "torch")
    if not auto:
        why_ref = "a sliding-window draft: the reference's general builder" if arch.sliding_window is not None \
            else f"the proposer's reference metadata (--attention-backend {config.attention_backend})"
        model = dataclasses.replace(model, attention_reason=why_ref)
    if model.attention_backend == "cpu-decode" and not numpy_step:
        chain, chain_why = "batched", "every chain step through the CPU decode kernel, single sequences included"
    elif numpy_step:
        chain, chain_why = "numpy", "a single sequence's steps in NumPy (small float32 draft on the CPU)" \
            if config.speculative_draft_numpy is None else "--speculative-draft-numpy"
    else:
        chain, chain_why = "torch", "a single sequence's steps through the draft's own PyTorch forward"
    return DraftPlan(draft_dir, arch, model, chain, chain_why)
