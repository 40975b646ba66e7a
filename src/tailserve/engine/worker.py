"""The worker: applies the execution plan (engine/plan.py), loads the model (and the draft
model), sizes and allocates the KV caches, and executes scheduler outputs through its
``ModelRunner``.

Everything that touches weights, devices or tensors lives here, behind the ``ModelExecutor``
seam (engine/scheduler_output.py): ``execute(SchedulerOutput) -> ModelRunnerOutput`` per step,
and a frozen ``WorkerInfo`` once. The engine core above it only schedules. A tensor-parallel
executor implements the same seam over one worker per rank.
"""

from __future__ import annotations

import logging
import os
import pathlib
import time

import torch

from tailserve.assets import resolve_model_path
from tailserve.attention.backend import AttentionBackend
from tailserve.attention.cpu_decode import CpuDecodeBackend
from tailserve.attention.reference import TorchReferenceBackend
from tailserve.config import DEFAULT_GPU_MEMORY_UTILIZATION, DEFAULT_KV_CACHE_MEMORY_BYTES, EngineConfig
from tailserve.engine import huge_pages
from tailserve.engine.model_runner import ModelRunner
from tailserve.engine.plan import (
    Capabilities,
    DraftPlan,
    ModelPlan,
    TargetPlan,
    detect_capabilities,
    plan_draft,
    plan_target,
    uses_draft_model,
)
from tailserve.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput, WorkerInfo
from tailserve.errors import ConfigError, TailserveError
from tailserve.kernels import cpu as cpu_kernels
from tailserve.memory.allocator.control import apply_alloc_conf
from tailserve.memory.allocator.snapshot import start_recording
from tailserve.memory.kv_cache import allocate_kv_caches, kv_bytes_per_block
from tailserve.memory.kv_sizing import CudaMemory, DeviceMemory, MemoryProfile, num_blocks_from_profile, profile_memory
from tailserve.model.config import load_arch_config
from tailserve.model.linear import (
    SINGLE,
    CpuCompactWeightsLinearMethod,
    LinearMethod,
    TensorParallel,
    build_linear_method,
)
from tailserve.model.llama import TORCH_OPS, FusedDecodeLayer, KernelLayerOps, LayerOps, fuse_decode_layers
from tailserve.model.loader import load_model
from tailserve.sample.sampler import Sampler
from tailserve.speculative.adaptive import VerifyCostProfile
from tailserve.speculative.draft_step import make_draft_step
from tailserve.speculative.proposer import DraftModelProposer, HybridProposer, NgramProposer, Proposer
from tailserve.speculative.suffix import SuffixConfig, SuffixProposer

log = logging.getLogger("tailserve.engine")
# vLLM: VLLM_ALLOW_LONG_MAX_MODEL_LEN
ALLOW_LONG_MAX_MODEL_LEN = "TAILSERVE_ALLOW_LONG_MAX_MODEL_LEN"


def _layer_ops(plan: ModelPlan, kernels) -> LayerOps:
    return KernelLayerOps(kernels) if plan.layer_ops == "cpu-kernels" else TORCH_OPS


def _linear_method(plan: ModelPlan, kernels) -> LinearMethod:
    lp = plan.linear
    uses_kernels = lp.method == "cpu-compact-weights" or lp.cpu_kernels
    return build_linear_method(lp.method, kernels if uses_kernels else None, lp.compact_dtype, lp.keep_float32,
                               lp.native_large_batches, lp.panel_packed)


def _attention_backend(plan: ModelPlan, args: tuple, kernels) -> AttentionBackend:
    """The backend the plan names, built."""
    if plan.attention_backend == "cpu-decode":
        return CpuDecodeBackend(*args, kernels=kernels)
    if plan.attention_backend == "triton-paged":
        from tailserve.attention.triton_paged import TritonPagedBackend

        return TritonPagedBackend(*args)
    return TorchReferenceBackend(*args)


class Worker:
    """One rank's model, caches and runner (the only rank without tensor parallelism; under
    it, ``engine/tensor_parallel.py`` runs one per process, all on the same scheduler
    outputs). A ``ModelExecutor``: the engine core calls only that protocol and reads ``info``."""

    def __init__(self, config: EngineConfig, tp: TensorParallel = SINGLE,
                 capabilities: Capabilities | None = None) -> None:
        self.config = config
        self.tp = tp
        device = torch.device(config.device)
        if tp.size > 1 and device.type == "cuda":
            device = torch.device("cuda", tp.rank)
        self.device = device
        # Before anything touches CUDA: the caching allocator reads its settings only then.
        self.allocator_settings = apply_alloc_conf(config.cuda_alloc_conf, config.cuda_memory_fraction,
                                                   strict_env=device.type == "cuda")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device cuda requested but torch.cuda.is_available() is False")
        if device.type == "cuda" and config.cuda_memory_fraction is not None:
            torch.cuda.set_per_process_memory_fraction(config.cuda_memory_fraction, device)
        if config.record_memory_history:  # before the weights load, so their sites are in it
            start_recording()
        self.model_dir = pathlib.Path(resolve_model_path(config.model))
        arch = load_arch_config(self.model_dir)
        max_len = config.max_model_len or arch.max_position_embeddings
        # As vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN: past the trained context the outputs may be
        # worse (RoPE positions the model never saw), but a benchmark of long prompts needs it.
        allow_long = os.environ.get(ALLOW_LONG_MAX_MODEL_LEN, "") == "1"
        if max_len > arch.max_position_embeddings:
            if not allow_long:
                raise ConfigError(f"max_model_len {max_len} exceeds the model's max_position_embeddings "
                                  f"{arch.max_position_embeddings} (set {ALLOW_LONG_MAX_MODEL_LEN}=1 to allow it: "
                                  "past its trained context a model's outputs may degrade)")
            log.warning("max_model_len %d exceeds the model's max_position_embeddings %d (%s=1): outputs past "
                        "its trained context may degrade", max_len, arch.max_position_embeddings,
                        ALLOW_LONG_MAX_MODEL_LEN)
        self.max_model_len = max_len

        # 1. The plan: every platform decision, made once, before anything loads. PyTorch's
        # allocator reads its huge-page setting at its first allocation: set it first
        # (engine/huge_pages.py; the plan reports what applies).
        huge_pages.enable_for_engine(device.type == "cpu")
        caps = capabilities or detect_capabilities(device, config.cpu_kernels)
        plan = plan_target(config, arch, device, caps, tp.size)
        if uses_draft_model(config):
            draft_dir = pathlib.Path(resolve_model_path(config.speculative_model, draft=True))
            draft_arch = load_arch_config(draft_dir)
            if draft_arch.vocab_size != arch.vocab_size:
                raise ConfigError(f"draft model vocabulary ({draft_arch.vocab_size}) differs from the target's "
                                  f"({arch.vocab_size}); speculative decoding needs the same tokenizer")
            if draft_arch.max_position_embeddings < max_len and not allow_long:
                raise ConfigError(f"draft model context ({draft_arch.max_position_embeddings}) is shorter than "
                                  f"max_model_len {max_len}")
            plan = plan.with_draft(plan_draft(config, draft_dir, draft_arch, device, caps, plan.dtype))
        self.plan: TargetPlan = plan
        self.draft_plan: DraftPlan | None = plan.draft
        kernels = cpu_kernels.kernels() if caps.cpu_kernels and device.type == "cpu" else None
        self.dtype_reason = plan.model.dtype_reason

        # 2. Load the target as planned.
        self.linear_method = _linear_method(plan.model, kernels)
        try:
            self.model, self.arch = load_model(self.model_dir, plan.dtype, device, max_positions=max_len,
                                               linear_method=self.linear_method, tp=tp)
        except ValueError as e:
            if tp.size == 1 or isinstance(e, TailserveError):
                raise
            raise ConfigError(f"tensor_parallel_size {tp.size} does not fit this model: {e}") from None
        self.dtype = self.model.embed_tokens.dtype
        self.kv_dtype = plan.kv_dtype
        self.layer_ops = _layer_ops(plan.model, kernels)
        self.model.set_layer_ops(self.layer_ops)
        backend_args = (config.block_size, config.max_num_seqs, config.max_num_batched_tokens, max_len,
                        self.arch.sliding_window, device)
        self.attn_backend = _attention_backend(plan.model, backend_args, kernels)
        # Decode steps of a float32 CPU model with compact weights: one compiled call per layer
        # (the layers that qualify; the count is what loading found).
        self.num_fused_layers = fuse_decode_layers(self.model, kernels) if plan.model.fuse_decode_layers else 0

        # 3. Size the KV cache (both models' K/V per block id), then allocate it with one block
        # past the ones the scheduler hands out, that no request ever owns: a captured decode
        # pads its batch with rows that write their K/V there, and so do a draft's ragged
        # catch-ups.
        self.num_blocks = self.determine_num_blocks()
        self.kv_caches = allocate_kv_caches(self.arch, self.num_blocks + 1, config.block_size, self.kv_dtype,
                                            device, tp)

        # 4. Build, each object whole: the sampler, the proposer (which shares the sampler's
        # generator and kernels), the runner that holds both.
        sampler = Sampler(self.arch.vocab_size, device, config.seed, kernels if plan.sampler_kernels else None)
        self.draft_linear_method: LinearMethod | None = None
        proposer = self._build_proposer(sampler, kernels)
        self.runner = ModelRunner(self.model, self.arch, self.kv_caches, config.block_size, device, config.seed,
                                  max_model_len=max_len, attn_backend=self.attn_backend, proposer=proposer,
                                  sampler=sampler, synthetic_acceptance=config.speculative_synthetic_acceptance,
                                  verification=config.speculative_verification,
                                  native_prefill=self.linear_method.native_scope
                                  if isinstance(self.linear_method, CpuCompactWeightsLinearMethod)
                                  and self.linear_method.native_large_batches else None,
                                  fused_rows=FusedDecodeLayer.MAX_ROWS if self.num_fused_layers else 0)
        self.graph_capture_s: float | None = None
        if plan.decode_graph_sizes:
            self.graph_capture_s = self.capture_decode_graphs(list(plan.decode_graph_sizes))
        self.verify_costs: VerifyCostProfile | None = None
        if proposer is not None and config.num_speculative_tokens is None and tp.size == 1:
            self.verify_costs = self._profile_verification(plan.max_verify_rows)
        self.info = WorkerInfo(
            arch=self.arch, model_dir=self.model_dir, max_model_len=max_len, num_blocks=self.num_blocks,
            block_size=config.block_size, kv_bytes_per_block=self.kv_bytes_per_block, dtype=self.dtype,
            dtype_reason=self.dtype_reason, device=device, allocator_settings=self.allocator_settings,
            memory_profile=self.memory_profile, decode_graph_sizes=tuple(sorted(self.runner.decode_graphs)),
            graph_capture_s=self.graph_capture_s, has_proposer=proposer is not None, plan=plan,
            num_fused_layers=self.num_fused_layers, verify_costs=self.verify_costs,
            lookup_proposer=proposer is not None and not proposer.uses_draft_kv)

    PROFILE_MAX_BATCH = 64

    def _profile_verification(self, max_rows: int | None) -> VerifyCostProfile:
        """The adaptive controller's start-up profile (``ModelRunner.profile_verification``) at
        the batch sizes that top its buckets (1, 2, 4, ... up to max_num_seqs's), each up to
        the largest k its rows allow, up to batch 64 (larger buckets go unprofiled: the
        controller explores there as without a profile, and a device with no row limit would
        spend seconds on shapes of thousands of rows). 0.3-0.5 s for the built-in pair on 2 CPU
        cores."""
        k_max = self.config.speculative_max_tokens
        sizes, caps, b = [], [], 1
        while b <= self.PROFILE_MAX_BATCH:
            cap = k_max if max_rows is None else min(k_max, max_rows // b - 1)
            if cap <= 0:
                break
            sizes.append(b)
            caps.append(cap)
            if b >= self.config.max_num_seqs:
                break
            b *= 2
        t0 = time.perf_counter()
        profile = self.runner.profile_verification(sizes, caps)
        log.info("verification profile (%d shapes, batch sizes %s) in %.2f s", len(profile.target_s), sizes,
                 time.perf_counter() - t0)
        return profile

    def capture_decode_graphs(self, batch_sizes: list[int]) -> float:
        """Capture decodes at these batch sizes (``ModelRunner.capture_decode_graphs``); the
        padding rows write into the scratch block past ``num_blocks``."""
        return self.runner.capture_decode_graphs(batch_sizes, self.num_blocks * self.config.block_size)

    @property
    def kv_bytes_per_block(self) -> int:
        """Both models' K/V for one block id on this rank (its KV heads of the target; the
        draft model is whole on every rank): one block id addresses both caches."""
        per_block = kv_bytes_per_block(self.arch, self.config.block_size, self.kv_dtype, self.tp)
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
        caches = allocate_kv_caches(self.arch, first, bs, self.kv_dtype, self.device, self.tp)
        meta = self.attn_backend.build(lens, lens, tables)
        positions = torch.cat([torch.arange(n, device=self.device) for n in lens])
        hidden = self.model(torch.zeros(len(positions), dtype=torch.long, device=self.device), positions, caches, meta)
        rows = min(cfg.max_num_seqs, len(positions))
        self.model.compute_logits(hidden[:rows]).softmax(dim=-1)
        del caches, hidden

    def _build_proposer(self, sampler: Sampler, kernels) -> Proposer | None:
        config, plan = self.config, self.draft_plan
        if plan is None:
            if config.speculative_method == "ngram":
                return NgramProposer(config.ngram_min, config.ngram_max)
            return SuffixProposer(_suffix_config(config), kernels) if config.speculative_method == "suffix" else None
        mp = plan.model
        draft_model, _ = load_model(plan.model_dir, plan.dtype, self.device, max_positions=self.max_model_len)
        draft_model.set_layer_ops(_layer_ops(mp, kernels))
        # One block past num_blocks, as the target's: a scratch slot for writes nobody reads.
        draft_caches = allocate_kv_caches(plan.arch, self.num_blocks + 1, config.block_size,
                                          draft_model.embed_tokens.dtype, self.device)
        # The NumPy step copies the plain weights, so it is built before the linear method
        # repacks them.
        single_step = make_draft_step(draft_model, plan.arch, draft_caches, self.device, plan.numpy_step)
        self.draft_linear_method = _linear_method(mp, kernels)
        draft_model.set_linear_method(self.draft_linear_method)
        draft_backend = None
        if mp.attention_backend == "cpu-decode":
            # The chain's batched steps through the CPU decode kernel, as the target's decodes.
            draft_backend = CpuDecodeBackend(config.block_size, config.max_num_seqs, config.max_num_batched_tokens,
                                             self.max_model_len, None, self.device, kernels=kernels)
        if mp.fuse_decode_layers:
            fuse_decode_layers(draft_model, kernels)
        proposer: Proposer = DraftModelProposer(
            draft_model, plan.arch, draft_caches, config.block_size, self.device, sampler.generator,
            stop_margin=config.draft_stop_margin, single_step=single_step, attn_backend=draft_backend,
            scratch_slot=self.num_blocks * config.block_size, sampling_kernels=sampler.kernels,
            batched_single_rows=plan.chain_step == "batched")
        if config.speculative_method == "hybrid":
            # Lookups first, cheapest and longest first: suffix, then n-gram, else the model.
            proposer = HybridProposer(proposer, [SuffixProposer(_suffix_config(config), kernels),
                                                 NgramProposer(config.ngram_min, config.ngram_max)],
                                      self.arch.vocab_size)
        return proposer

    @property
    def local(self) -> Worker:
        """The in-process worker (this one; rank 0's under tensor parallelism), for white-box
        views in tests and benchmarks."""
        return self

    @property
    def proposer(self) -> Proposer | None:
        return self.runner.proposer

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(sched)

    def warm_up(self, decode_batch_sizes: list[int], prefill_lens: list[int], prefill_batch_tokens: int = 0) -> None:
        """Pay the kernels' one-time costs per shape now (``ModelRunner.warm_up``)."""
        self.runner.warm_up(decode_batch_sizes, prefill_lens, prefill_batch_tokens)

    def free(self, request_ids: list[str]) -> None:
        """Drop finished requests' state (reported by a step with nothing to compute)."""
        self.runner.free(request_ids)

    def check_health(self) -> None:
        """Raise ``EngineDeadError`` if this worker cannot go on (one process: never)."""

    def shutdown(self) -> None:
        """Release what outlives the object (one process: nothing)."""


def _suffix_config(config: EngineConfig) -> SuffixConfig:
    return SuffixConfig(config.suffix_max_depth, config.suffix_max_spec_factor, config.suffix_min_token_prob,
                        config.suffix_cache_max_requests)
