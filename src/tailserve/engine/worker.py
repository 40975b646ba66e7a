"""The worker: loads the model (and the draft model), sizes and allocates the KV caches,
and executes scheduler outputs through its ``ModelRunner``.

Everything that touches weights, devices or tensors lives here, behind one call,
``execute(SchedulerOutput) -> ModelRunnerOutput``; the engine core above it only schedules.
This is the boundary a tensor-parallel worker process will sit behind.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass

import torch

from tailserve.assets import resolve_model_path
from tailserve.attention import get_attention_backend
from tailserve.attention.cpu_decode import CpuDecodeBackend
from tailserve.config import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_KV_CACHE_MEMORY_BYTES,
    EngineConfig,
    decode_graph_batch_sizes,
)
from tailserve.engine.model_runner import ModelRunner, Proposer
from tailserve.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from tailserve.errors import ConfigError, TailserveError
from tailserve.kernels import cpu as cpu_kernels
from tailserve.memory.allocator.control import apply_alloc_conf
from tailserve.memory.allocator.snapshot import start_recording
from tailserve.memory.kv_cache import allocate_kv_caches, kv_bytes_per_block
from tailserve.memory.kv_sizing import CudaMemory, DeviceMemory, MemoryProfile, num_blocks_from_profile, profile_memory
from tailserve.model.config import ModelArchConfig, load_arch_config, parse_dtype
from tailserve.model.linear import SINGLE, TensorParallel, select_linear_method
from tailserve.model.llama import TORCH_OPS, KernelLayerOps, LayerOps, LlamaFamilyModel, fuse_decode_layers
from tailserve.model.loader import load_model
from tailserve.platform_info import resolve_auto_dtype
from tailserve.speculative.draft_step import make_draft_step
from tailserve.speculative.numpy_draft import NUMPY_DRAFT_MAX_PARAMETERS
from tailserve.speculative.proposer import DraftModelProposer, HybridProposer, NgramProposer


@dataclass(frozen=True)
class DraftPlan:
    """How the draft model runs: its folder, architecture, dtype, and whether its chain
    steps of a single sequence run in NumPy."""

    model_dir: pathlib.Path
    arch: ModelArchConfig
    dtype: torch.dtype
    numpy_step: bool


def plan_draft(config: EngineConfig, device: torch.device, target_dtype: torch.dtype) -> DraftPlan | None:
    """The draft model's platform choices, made once, before anything is loaded."""
    if config.speculative_method not in ("draft_model", "hybrid"):
        return None
    draft_dir = pathlib.Path(resolve_model_path(config.speculative_model, draft=True))
    arch = load_arch_config(draft_dir)
    # A bf16/fp16 draft checkpoint on a CPU with the compiled kernels runs in float32 over its
    # compact weights (kernels/cpu), single sequences included: measured on the built-in
    # pair at batch 1 (docs/benchmarks.md), greedy 352 tok/s against 291 with the NumPy step.
    compact = (device.type == "cpu" and config.cpu_kernels and arch.dtype in (torch.bfloat16, torch.float16)
               and config.speculative_draft_dtype in ("auto", "float32") and cpu_kernels.kernels() is not None)
    numpy_step = config.speculative_draft_numpy
    if numpy_step is None:
        # Only small drafts: NumPy reads float32 weights (twice PyTorch's bf16 bytes), which
        # outweighs the per-operation overhead it saves beyond a few million parameters.
        numpy_step = (device.type == "cpu" and config.speculative_draft_dtype in ("auto", "float32")
                      and arch.sliding_window is None and arch.num_parameters <= NUMPY_DRAFT_MAX_PARAMETERS
                      and not compact)
    elif numpy_step and arch.sliding_window is not None:
        raise ConfigError("speculative_draft_numpy: the NumPy draft step has no sliding window, "
                          "and this draft model uses one")
    if config.speculative_draft_dtype != "auto":
        dtype = parse_dtype(config.speculative_draft_dtype)
    else:
        dtype = torch.float32 if numpy_step or compact else target_dtype
    return DraftPlan(draft_dir, arch, dtype, numpy_step)


class Worker:
    """One rank's model, caches and runner (the only rank without tensor parallelism; under
    it, ``engine/tensor_parallel.py`` runs one per process, all on the same scheduler
    outputs)."""

    def __init__(self, config: EngineConfig, tp: TensorParallel = SINGLE) -> None:
        self.config = config
        self.tp = tp
        self.device = torch.device(config.device)
        if tp.size > 1 and self.device.type == "cuda":
            self.device = torch.device("cuda", tp.rank)
        # Before anything touches CUDA: the caching allocator reads its settings only then.
        self.allocator_settings = apply_alloc_conf(config.cuda_alloc_conf, config.gpu_memory_utilization,
                                                   strict_env=self.device.type == "cuda")
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device cuda requested but torch.cuda.is_available() is False")
        if self.device.type == "cuda" and config.gpu_memory_utilization is not None:
            torch.cuda.set_per_process_memory_fraction(config.gpu_memory_utilization, self.device)
        if config.record_memory_history:  # before the weights load, so their sites are in it
            start_recording()
        self.model_dir = pathlib.Path(resolve_model_path(config.model))
        arch = load_arch_config(self.model_dir)
        max_len = config.max_model_len or arch.max_position_embeddings
        if max_len > arch.max_position_embeddings:
            raise ConfigError(f"max_model_len {max_len} exceeds the model's max_position_embeddings "
                              f"{arch.max_position_embeddings}")
        self.max_model_len = max_len
        if config.dtype == "auto":
            dtype, self.dtype_reason = resolve_auto_dtype(arch.dtype, self.device)
        else:
            dtype, self.dtype_reason = parse_dtype(config.dtype), "--dtype"
        # Platform choices, made once: how linear layers multiply, which attention backend.
        # A float32 model of a bf16/fp16 checkpoint on the CPU keeps the weights in the
        # checkpoint's dtype (widening is exact: the same products, half the bytes) when the
        # compiled kernels run here: what --dtype auto gives on a CPU without native bf16.
        compact = arch.dtype if (self.device.type == "cpu" and dtype == torch.float32
                                 and arch.dtype in (torch.bfloat16, torch.float16)) else None
        self.linear_method = select_linear_method(self.device, config.cpu_onednn, config.quantization,
                                                  compact_weights=compact, cpu_kernels=config.cpu_kernels)
        if self.linear_method.name == "cpu-compact-weights":
            self.dtype_reason += f"; weights kept in {str(arch.dtype).removeprefix('torch.')} as stored " \
                                 "(float32 arithmetic, compiled AVX2 kernels)"
        # The draft model keeps its own precision. On the CPU a float32 draft of a bf16/fp16
        # checkpoint runs its batched steps of up to 16 rows through the compiled kernels on
        # compact weights, and keeps the float32 weights for more rows (a draft is small). The
        # NumPy single-sequence step copies them widened, before the linear method is applied.
        self.draft_linear_method = select_linear_method(self.device, config.cpu_onednn)
        try:
            self.model, self.arch = load_model(self.model_dir, dtype, self.device, max_positions=max_len,
                                               linear_method=self.linear_method, tp=tp)
        except ValueError as e:
            if tp.size == 1 or isinstance(e, TailserveError):
                raise
            raise ConfigError(f"tensor_parallel_size {tp.size} does not fit this model: {e}") from None
        self.dtype = self.model.embed_tokens.dtype
        self.layer_ops = self._select_layer_ops(self.dtype)
        self.model.set_layer_ops(self.layer_ops)

        self.draft_plan = plan_draft(config, self.device, self.dtype)
        draft_model: LlamaFamilyModel | None = None
        if self.draft_plan is not None:
            plan = self.draft_plan
            # Its linear method is applied once the NumPy step (if any) has copied the plain weights.
            draft_model, _ = load_model(plan.model_dir, plan.dtype, self.device, max_positions=max_len)
            draft_model.set_layer_ops(self._select_layer_ops(plan.dtype))
            if self.device.type == "cpu" and plan.dtype == torch.float32 \
                    and plan.arch.dtype in (torch.bfloat16, torch.float16):
                self.draft_linear_method = select_linear_method(
                    self.device, config.cpu_onednn, compact_weights=plan.arch.dtype, cpu_kernels=config.cpu_kernels,
                    keep_float32=True)
            if plan.arch.vocab_size != self.arch.vocab_size:
                raise ConfigError(f"draft model vocabulary ({plan.arch.vocab_size}) differs from the target's "
                                  f"({self.arch.vocab_size}); speculative decoding needs the same tokenizer")
            if plan.arch.max_position_embeddings < max_len:
                raise ConfigError(f"draft model context ({plan.arch.max_position_embeddings}) is shorter than "
                                  f"max_model_len {max_len}")

        try:
            backend_cls = get_attention_backend(config.attention_backend)
        except ValueError as e:
            raise ConfigError(f"attention_backend: {e}") from None
        backend_args = (config.block_size, config.max_num_seqs, config.max_num_batched_tokens, max_len,
                        self.arch.sliding_window, self.device)
        if config.attention_backend == "auto" and isinstance(self.layer_ops, KernelLayerOps) \
                and CpuDecodeBackend.handles(self.arch.head_dim, self.dtype):
            # float32 on the CPU with the compiled kernels: decodes through the paged decode kernel.
            self.attn_backend = CpuDecodeBackend(*backend_args, kernels=self.layer_ops.kernels)
        else:
            self.attn_backend = backend_cls(*backend_args)
        # Decode steps of a float32 CPU model with compact weights: one compiled call per layer.
        self.num_fused_layers = 0
        if isinstance(self.attn_backend, CpuDecodeBackend):
            self.num_fused_layers = fuse_decode_layers(self.model, self.layer_ops.kernels)
        # CUDA graphs for decode: one process, CUDA, and a backend with capture hooks.
        self.use_decode_graphs = (self.device.type == "cuda" and not config.enforce_eager and tp.size == 1
                                  and self.attn_backend.supports_graph_capture)
        self.num_blocks = self.determine_num_blocks()
        # One block past the ones the scheduler hands out, that no request ever owns: a
        # captured decode pads its batch with rows that write their K/V there.
        self.kv_caches = allocate_kv_caches(self.arch, self.num_blocks + 1, config.block_size, self.dtype,
                                            self.device, tp)
        self.runner = ModelRunner(self.model, self.arch, self.kv_caches, config.block_size, self.device, config.seed,
                                  max_model_len=max_len, attn_backend=self.attn_backend)
        self.runner.proposer = self._build_proposer(draft_model)
        if self.device.type == "cpu" and config.cpu_kernels:
            # top-k / top-p cut-offs by quickselect, for every model dtype (logits are float32 there).
            self.runner.sampler.kernels = cpu_kernels.kernels()
            draft = getattr(self.runner.proposer, "draft", self.runner.proposer)
            if isinstance(draft, DraftModelProposer):
                draft.sampling_kernels = self.runner.sampler.kernels
        self.graph_capture_s: float | None = None
        if self.use_decode_graphs:
            self.graph_capture_s = self.capture_decode_graphs(decode_graph_batch_sizes(config.max_num_seqs))

    def _select_layer_ops(self, dtype: torch.dtype) -> LayerOps:
        """The compiled CPU kernels' norms and activations for a float32 model on the CPU
        (same arithmetic, one pass each), else PyTorch's."""
        if self.device.type == "cpu" and dtype == torch.float32 and self.config.cpu_kernels:
            k = cpu_kernels.kernels()
            if k is not None:
                return KernelLayerOps(k)
        return TORCH_OPS

    def capture_decode_graphs(self, batch_sizes: list[int]) -> float:
        """Capture decodes at these batch sizes (``ModelRunner.capture_decode_graphs``); the
        padding rows write into the scratch block past ``num_blocks``."""
        return self.runner.capture_decode_graphs(batch_sizes, self.num_blocks * self.config.block_size)

    @property
    def kv_bytes_per_block(self) -> int:
        """Both models' K/V for one block id on this rank (its KV heads of the target; the
        draft model is whole on every rank): one block id addresses both caches."""
        per_block = kv_bytes_per_block(self.arch, self.config.block_size, self.dtype, self.tp)
        if self.draft_plan is not None:
            per_block += kv_bytes_per_block(self.draft_plan.arch, self.config.block_size, self.draft_plan.dtype)
        return per_block

    def determine_num_blocks(self, memory: DeviceMemory | None = None) -> int:
        """Blocks of the KV cache: from ``kv_cache_memory_bytes`` when it is given (default
        DEFAULT_KV_CACHE_MEMORY_BYTES on the CPU); on CUDA without it, from
        ``gpu_memory_utilization`` (default 0.9) after a profiling pass of the largest step
        (memory/kv_sizing.py). Under tensor parallelism every rank takes the smallest count."""
        per_block = self.kv_bytes_per_block
        self.memory_profile: MemoryProfile | None = None
        budget = self.config.kv_cache_memory_bytes
        if budget is None and (self.device.type == "cuda" or memory is not None):
            utilization = self.config.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION
            self.memory_profile = profile_memory(memory or CudaMemory(self.device), self._run_largest_step,
                                                 utilization)
            num_blocks = num_blocks_from_profile(self.memory_profile, per_block)
        else:
            budget = DEFAULT_KV_CACHE_MEMORY_BYTES if budget is None else budget
            num_blocks = budget // per_block
            if num_blocks < 1:
                raise ConfigError(f"kv_cache_memory_bytes {budget} holds no block "
                                  f"(one block of {self.config.block_size} tokens takes {per_block} bytes)")
        if self.tp.size > 1 and self.memory_profile is not None:
            t = torch.tensor([num_blocks], device=self.device)
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
            num_blocks = int(t.item())
        return num_blocks

    @torch.inference_mode()
    def _run_largest_step(self) -> None:
        """The largest step the scheduler can send: max_num_batched_tokens prompt tokens (in
        sequences of at most max_model_len), then logits and probabilities for max_num_seqs
        rows. Writes into a throw-away cache of just those blocks."""
        cfg, bs = self.config, self.config.block_size
        lens, left = [], cfg.max_num_batched_tokens
        while left > 0:
            lens.append(min(left, self.max_model_len))
            left -= lens[-1]
        tables, first = [], 0
        for n in lens:
            nb = -(-n // bs)
            tables.append(list(range(first, first + nb)))
            first += nb
        caches = allocate_kv_caches(self.arch, first, bs, self.dtype, self.device, self.tp)
        meta = self.attn_backend.build(lens, lens, tables)
        positions = torch.cat([torch.arange(n, device=self.device) for n in lens])
        hidden = self.model(torch.zeros(len(positions), dtype=torch.long, device=self.device), positions, caches, meta)
        rows = min(cfg.max_num_seqs, len(positions))
        self.model.compute_logits(hidden[:rows]).softmax(dim=-1)
        del caches, hidden

    def _build_proposer(self, draft_model: LlamaFamilyModel | None) -> Proposer | None:
        config = self.config
        if draft_model is not None and self.draft_plan is not None:
            plan = self.draft_plan
            # One block past num_blocks, as the target's: a scratch slot for writes nobody reads.
            draft_caches = allocate_kv_caches(plan.arch, self.num_blocks + 1, config.block_size,
                                              draft_model.embed_tokens.dtype, self.device)
            # The NumPy step copies the plain weights, so it is built before the linear method
            # repacks them.
            single_step = make_draft_step(draft_model, plan.arch, draft_caches, self.device, plan.numpy_step)
            draft_model.set_linear_method(self.draft_linear_method)
            if isinstance(draft_model.ops, KernelLayerOps):
                fuse_decode_layers(draft_model, draft_model.ops.kernels)  # used where its backend is the kernel's
            draft_backend = None
            draft_ops = draft_model.ops
            if isinstance(draft_ops, KernelLayerOps) and plan.arch.sliding_window is None \
                    and config.attention_backend == "auto" and CpuDecodeBackend.handles(plan.arch.head_dim, plan.dtype):
                # The chain's batched steps through the CPU decode kernel, as the target's decodes.
                draft_backend = CpuDecodeBackend(config.block_size, config.max_num_seqs,
                                                 config.max_num_batched_tokens, self.max_model_len, None,
                                                 self.device, kernels=draft_ops.kernels)
            proposer: Proposer = DraftModelProposer(draft_model, plan.arch, draft_caches, config.block_size,
                                                    self.device, self.runner.sampler.generator,
                                                    stop_margin=config.draft_stop_margin, single_step=single_step,
                                                    attn_backend=draft_backend,
                                                    scratch_slot=self.num_blocks * config.block_size)
            if config.speculative_method == "hybrid":
                proposer = HybridProposer(proposer, NgramProposer(config.ngram_min, config.ngram_max),
                                          self.arch.vocab_size)
            return proposer
        if config.speculative_method == "ngram":
            return NgramProposer(config.ngram_min, config.ngram_max)
        return None

    @property
    def proposer(self) -> Proposer | None:
        return self.runner.proposer

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(sched)

    def warm_up(self, decode_batch_sizes: list[int], prefill_lens: list[int]) -> None:
        """Pay the kernels' one-time costs per shape now (``ModelRunner.warm_up``)."""
        self.runner.warm_up(decode_batch_sizes, prefill_lens)

    def free(self, request_ids: list[str]) -> None:
        """Drop finished requests' state (reported by a step with nothing to compute)."""
        self.runner.free(request_ids)

    def check_health(self) -> None:
        """Raise ``EngineDeadError`` if this worker cannot go on (one process: never)."""

    def shutdown(self) -> None:
        """Release what outlives the object (one process: nothing)."""
