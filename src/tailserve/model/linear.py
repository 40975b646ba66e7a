"""Linear layers: parallel layouts that load their own slices, and linear methods chosen at
load time.

**Linear methods.** How a layer multiplies is decided once, when the model is loaded, by a
``LinearMethod`` (chosen by the execution plan, engine/plan.py), not by a branch inside ``forward``:

- ``PlainLinearMethod``: ``F.linear``; everywhere.
- ``OneDNNPackedLinearMethod``: CPU only. PyTorch's default CPU ``F.linear`` reaches a
  fraction of memory bandwidth for the matrix-vector products of batch-1 decode, worst in
  bfloat16 (measured here: ~9 GB/s for bf16, vs ~26+ GB/s through oneDNN with the weight
  reordered once into its blocked layout). The packed weight replaces the plain one (no
  second copy is kept). Results are the same kernels' arithmetic in the same dtype; tests
  compare both methods against transformers.

- ``Int8WeightOnlyLinearMethod`` (``--quantization int8``): per-row int8 weights, the
  activations in the model's dtype.

A method owns the layer's weight format (fp8 would slot in the same way).

**Parallel layouts** (nano-vllm's ``layers/linear.py`` shape). Every parameter carries a
``weight_loader(param, loaded, shard_id)``: the layer knows which slice of a checkpoint
tensor is its own for its tensor-parallel rank, and of which fused part (``q``/``k``/``v``,
gate/up). ``loaded`` may be a safetensors slice, so a rank reads only its part of the file.

- ``ColumnParallelLinear``: output features split across ranks (no communication);
  ``MergedColumnParallelLinear`` fuses several (gate/up); ``QKVParallelLinear`` fuses q/k/v
  with query heads split and KV heads split, or replicated where there are fewer KV heads
  than ranks.
- ``RowParallelLinear``: input features split; the partial products are summed with an
  all-reduce (only rank 0 adds the bias).

With ``tp_size == 1`` (all that runs today) every layer holds the whole weight.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tailserve.errors import CheckpointFormatError
from tailserve.kernels.cpu import pack_panels, pack_panels_int8, pack_panels_w8a8


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group."""

    size: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} of size {self.size}")


SINGLE = TensorParallel()


def kv_heads_per_rank(num_kv_heads: int, tp: TensorParallel) -> int:
    """KV heads a rank holds: split when they divide by the ranks, else each rank keeps one
    (replicated: several ranks' query heads share it)."""
    if num_kv_heads >= tp.size:
        if num_kv_heads % tp.size:
            raise ValueError(f"{num_kv_heads} KV heads do not split over {tp.size} ranks")
        return num_kv_heads // tp.size
    if tp.size % num_kv_heads:
        raise ValueError(f"{tp.size} ranks cannot share {num_kv_heads} KV heads evenly")
    return 1


def _read(loaded, index: tuple | None = None) -> torch.Tensor:
    """A tensor, or the indexed part of a safetensors slice (read from the file alone)."""
    if isinstance(loaded, torch.Tensor):
        return loaded if index is None else loaded[index]
    return loaded[index if index is not None else slice(None)]


def _shape(loaded) -> tuple[int, ...]:
    return tuple(loaded.shape) if isinstance(loaded, torch.Tensor) else tuple(loaded.get_shape())


def _check(name: str, loaded, expected: tuple[int, ...]) -> None:
    if _shape(loaded) != tuple(expected):
        raise CheckpointFormatError(f"tensor {name!r} has shape {_shape(loaded)}, expected {tuple(expected)}")


def default_weight_loader(param: nn.Parameter, loaded, shard_id: object = None, name: str = "") -> None:
    """A replicated parameter: the whole checkpoint tensor."""
    _check(name, loaded, tuple(param.shape))
    param.data.copy_(_read(loaded))


# -- linear methods ----------------------------------------------------------------------------
class LinearMethod(ABC):
    name: str = "abstract"

    def process_weights_after_loading(self, layer: Linear) -> None:  # noqa: B027 - optional hook
        """Turn the loaded weight into this method's format (once, after loading)."""

    @abstractmethod
    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor: ...


class PlainLinearMethod(LinearMethod):
    name = "plain"

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)


PLAIN = PlainLinearMethod()


class OneDNNPackedLinearMethod(LinearMethod):
    name = "onednn-packed"

    def process_weights_after_loading(self, layer: Linear) -> None:
        w = layer.weight
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(w.detach())
            probe = torch.zeros(1, w.shape[1], dtype=w.dtype)
            torch.ops.mkldnn._linear_pointwise(probe, packed, layer.bias, "none", [], "")
        except RuntimeError:
            layer.method = PLAIN  # this build or CPU cannot run the packed kernel for this dtype
            return
        layer.packed = packed
        layer.weight = nn.Parameter(torch.empty(w.shape, dtype=w.dtype, device="meta"), requires_grad=False)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, layer.packed, layer.bias, "none", [], "")


def _int8pack_mm_runs(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether PyTorch's weight-only int8 kernel takes activations of ``dtype`` here."""
    try:
        x = torch.ones(1, 32, dtype=dtype, device=device)
        w = torch.ones(8, 32, dtype=torch.int8, device=device)
        torch.ops.aten._weight_int8pack_mm(x, w, torch.ones(8, dtype=dtype, device=device))
    except (RuntimeError, NotImplementedError, AttributeError):
        return False
    return True


class Int8WeightOnlyLinearMethod(LinearMethod):
    """Weight-only int8: each output row is stored as int8 with one scale (symmetric,
    ``scale = max|w_row| / 127``), a quarter of float32's bytes and half of bf16's. The
    activations stay in the model's dtype; the product dequantises inside the kernel.

    Batch-1 decode reads every weight once per token, so it is bound by weight bytes: this is
    what ``--quantization int8`` buys. A float32 model on a CPU with the compiled kernels
    multiplies through them (``panel_packed``: every batch through int8 panels; otherwise
    batches of up to 16 rows through the row-major kernel); elsewhere the kernel is PyTorch's
    ``_weight_int8pack_mm`` (vectorised for AVX2 and AVX-512 on the CPU; bf16/fp16 on CUDA);
    where it does not take the activations' dtype, the weight is dequantised per call
    (correct, not faster). The cost in accuracy is measured in docs/benchmarks.md (held-out
    cross-entropy)."""

    name = "int8-weight-only"

    SMALL_BATCH = 16  # rows up to which the compiled CPU kernel is used (float32 models)

    def __init__(self, cpu_kernels=None, panel_packed: bool = False) -> None:
        # cpu_kernels: kernels.cpu.CpuKernels where the plan uses them; panel_packed (with
        # them, a float32 model): the int8 weights re-laid in 16-column panels
        # (``pack_panels_int8``) and every batch through the outer-product kernel, prompt steps
        # included (no row-major copy is kept). The row-major kernel is a dot product whose
        # widening shares the FMA ports, and PyTorch's kernel multiplies in bf16: 2 Xeon cores,
        # the built-in draft's 4,096 x 256 head, 16 rows 130 us through panels against 234 us
        # through the rows; 256 rows 1.8 ms against 4.1 ms through ``_weight_int8pack_mm``
        # (float32 F.linear over the dequantised weight: 1.7 ms).
        self._kernel_ok: dict[tuple[torch.dtype, str], bool] = {}
        self.cpu_kernels = cpu_kernels
        self.panel_packed = panel_packed

    @staticmethod
    def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(N, K) float -> int8 (N, K) and float32 scales (N,), round to nearest."""
        w32 = w.float()
        scales = w32.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        q = torch.round(w32 / scales[:, None]).clamp_(-127, 127).to(torch.int8)
        return q, scales

    @staticmethod
    def kernel_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
        """The activations' dtype inside the product. PyTorch's CPU kernel is vectorised for
        bf16 and fp16 activations only (float32 ones take a scalar path ~10x slower, measured
        here), so a float32 model multiplies in bf16 and reads the result back in float32."""
        return torch.bfloat16 if device.type == "cpu" and dtype == torch.float32 else dtype

    def process_weights_after_loading(self, layer: Linear) -> None:
        w = layer.weight
        q, scales = self.quantize(w.detach())
        kdtype = self.kernel_dtype(w.dtype, w.device)
        key = (kdtype, w.device.type)
        if key not in self._kernel_ok:
            self._kernel_ok[key] = _int8pack_mm_runs(kdtype, w.device)
        layer.use_int8_kernel = self._kernel_ok[key]
        layer.scales = scales.to(kdtype if layer.use_int8_kernel else w.dtype)
        if self.panel_packed and self.cpu_kernels is not None and w.dtype == torch.float32:
            # The panels are the weight (qweight); their padded scales are what a fused layer
            # passes beside them (scales_f32).
            layer.qweight = layer.qpanels = pack_panels_int8(q, scales)
            layer.scales_f32 = layer.qpanels.scales
        else:
            layer.qweight, layer.qpanels = q.contiguous(), None
            # float32 on the CPU: small batches through the compiled kernel, in float32 throughout.
            layer.scales_f32 = scales if self.cpu_kernels is not None and w.dtype == torch.float32 \
                and self.cpu_kernels.supports(layer.qweight) else None
        # The full-precision weight goes (a tied LM head keeps the embedding, which is separate storage).
        layer.weight = nn.Parameter(torch.empty(w.shape, dtype=w.dtype, device="meta"), requires_grad=False)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        q, scales = layer.qweight, layer.scales
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if layer.qpanels is not None:
            y = self.cpu_kernels.gemm(x2, layer.qpanels)
        elif layer.scales_f32 is not None and x2.shape[0] <= self.SMALL_BATCH:
            y = self.cpu_kernels.gemm(x2, q, layer.scales_f32)
        elif layer.use_int8_kernel:
            y = torch.ops.aten._weight_int8pack_mm(x2.to(scales.dtype).contiguous(), q, scales).to(x.dtype)
        else:
            y = F.linear(x2, q.to(x.dtype)) * scales
        if layer.bias is not None:
            y = y + layer.bias
        return y.view(*shape[:-1], y.shape[-1])


class Int8DynamicActivationLinearMethod(Int8WeightOnlyLinearMethod):
    """int8 weights (as ``Int8WeightOnlyLinearMethod`` quantises them) and int8 activations,
    quantised per row on the way into each product, the products summed exactly in int32
    (``kernels.cpu.tailserve_gemm_w8a8p``: AVX-512 VNNI, else AVX2, the same bits; SGLang calls
    the scheme ``w8a8_int8``). The activations lose ~7 bits: for a draft model harmless (the
    target verifies every draft; the built-in draft's acceptance moved by under a point), so a
    bf16/fp16 draft on the compiled kernels takes it by default; for a target lossy, on request
    (``--quantization w8a8_int8``: the built-in target's held-out cross-entropy +0.03%). What
    it buys is the widening the weight-only panels spend: the built-in draft's 4,096 x 256 head
    took 8.9 us for one row against 29.8 us through the weight-only panels (2 Xeon cores,
    AVX-512 VNNI; AVX2 tiles 13.9 us), 256 rows 0.67 ms against 1.79 ms. Needs the compiled CPU
    kernels and a float32 model."""

    name = "int8-w8a8"

    def __init__(self, cpu_kernels) -> None:
        if cpu_kernels is None:
            raise ValueError("int8-w8a8 needs the compiled CPU kernels")
        super().__init__(cpu_kernels, panel_packed=True)

    def process_weights_after_loading(self, layer: Linear) -> None:
        w = layer.weight
        if w.dtype != torch.float32 or w.device.type != "cpu":
            raise ValueError(f"int8-w8a8 takes a float32 CPU model, got {w.dtype} on {w.device.type}")
        q, scales = self.quantize(w.detach())
        layer.use_int8_kernel = False
        layer.scales = scales
        # The packed panels are the weight; their padded scales are what a fused layer passes.
        layer.qweight = layer.qpanels = pack_panels_w8a8(q, scales)
        layer.scales_f32 = layer.qpanels.scales
        layer.weight = nn.Parameter(torch.empty(w.shape, dtype=w.dtype, device="meta"), requires_grad=False)


def native_rows(m: int) -> int:
    """The rows a native (oneDNN) product of ``m`` prompt rows is padded to with zero rows.

    oneDNN sets up a primitive for each new shape: on 2 AVX-512 bf16 + AMX cores 0.5-0.9 ms per
    projection the first time a row count is seen (the built-in target's prompts of 41-194
    tokens, warmed engine: 11.6 ms median at lengths not seen before, 8.3 ms at lengths seen),
    and a server sees prompts of every length. Rounded up to a multiple of 16 (of 64 past 256 rows) the shapes
    repeat, at most 15 (63) rows of wasted work. A native prompt row already depends on the rows
    beside it, so the padding changes no guarantee."""
    step = 16 if m <= 256 else 64
    return -(-m // step) * step


class CpuCompactWeightsLinearMethod(LinearMethod):
    """float32 arithmetic over weights kept in their compact checkpoint dtype (bf16 or fp16),
    for CPUs without native bf16/fp16 arithmetic, where ``--dtype auto`` computes in float32.

    Widening bf16 or fp16 to float32 is exact, so the products are those of the float32
    model, in half its weight bytes: a decode step's time is its weight bytes over the memory
    bandwidth. Batches of up to ``SMALL_BATCH`` rows go through the compiled kernel
    (kernels/cpu); larger ones (prefill chunks, whose products are compute-bound) widen
    the weight once per call and use PyTorch's float32 kernel, except with ``panel_packed``
    (bf16 on a CPU without native bf16), where every batch goes through the outer-product
    kernel. A layer whose weights do not round-trip exactly (a checkpoint that stores float32
    under a bf16 config) keeps float32."""

    name = "cpu-compact-weights"
    SMALL_BATCH = 16
    # Up to this many rows (decode steps of 17-64 sequences, verification), the kernel in
    # SMALL_BATCH-row chunks: 1.1-1.5x faster than widening for PyTorch's float32 product
    # (AVX-512 bf16, 512x1408 .. 2816x512 weights), and each row's product stays the one it has
    # in a batch of up to 16, so an output does not depend on how many requests decode beside it.
    CHUNKED_MAX_ROWS = 64

    def __init__(self, weight_dtype: torch.dtype, kernels, keep_float32: bool = False,
                 native_large_batches: bool = False, panel_packed: bool = False) -> None:
        if panel_packed and (weight_dtype != torch.bfloat16 or keep_float32):
            raise ValueError("panel-packed weights are bf16, without a float32 copy (it reads the row layout)")
        self.weight_dtype = weight_dtype
        # bf16 weights re-laid in 16-column panels for the outer-product kernel (kernels/cpu
        # PanelPackedWeight), which then multiplies batches of every size: at 16 rows and up
        # 1.25-1.45x the row-major kernel and faster than PyTorch's float32 GEMM over widened
        # weights (2 AVX2 cores, docs/benchmarks.md). Each output sums in k order whatever the
        # batch, so a row's product is the same alone, in a decode batch, or in a prompt. With
        # native_large_batches as well, the row-major bf16 weight is kept beside the panels for
        # the native products of prompt steps (``rweight``): two copies of the weights.
        self.panel_packed = panel_packed
        # On a CPU with native bf16 (fp16) products, the forwards of pure prompt steps (inside
        # native_scope(True)) multiply batches above SMALL_BATCH in the weights' own dtype,
        # activations rounded to it, accumulating in float32: 2.5-3x faster than widening here
        # (AVX-512 bf16, 512x1408 at 128-2048 rows). Steps with decode or verification rows
        # stay float32 throughout, so a speculative step's rows are the plain decode's products.
        self.native_large_batches = native_large_batches
        self._native_now = False
        # Also keep the float32 weight for batches above SMALL_BATCH instead of widening per
        # call: for a small model whose batched forwards are frequent (a draft model's chain
        # at batch 16 feeds 32 rows), at the cost of the float32 bytes as well.
        self.keep_float32 = keep_float32
        self.kernels = kernels  # kernels.cpu.CpuKernels

    @contextlib.contextmanager
    def native_scope(self, on: bool) -> Iterator[None]:
        """One forward's choice (the model runner's): native products for its large batches."""
        if self._native_now:
            raise RuntimeError("native_scope does not nest")
        self._native_now = on and self.native_large_batches
        try:
            yield
        finally:
            self._native_now = False

    def process_weights_after_loading(self, layer: Linear) -> None:
        full = layer.weight.detach()
        w = full.to(self.weight_dtype).contiguous()
        # Only where it is lossless: a checkpoint whose config says bf16 may still store float32.
        if not self.kernels.supports(w) or not torch.equal(w.to(full.dtype), full):
            layer.method = OneDNNPackedLinearMethod() if onednn_available() else PLAIN
            layer.method.process_weights_after_loading(layer)
            return
        layer.qweight = pack_panels(w) if self.panel_packed else w
        layer.rweight = w if self.panel_packed and self.native_large_batches else None
        if not self.keep_float32:
            layer.weight = nn.Parameter(torch.empty(w.shape, dtype=torch.float32, device="meta"), requires_grad=False)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self._native_now and x2.shape[0] > self.SMALL_BATCH:
            rows = layer.rweight if self.panel_packed else layer.qweight
            m = x2.shape[0]
            xn = x2.to(self.weight_dtype)
            padded = native_rows(m)
            if padded != m:
                xn = F.pad(xn, (0, 0, 0, padded - m))
            y = F.linear(xn, rows)[:m].float()
            if layer.bias is not None:
                y += layer.bias
        elif self.panel_packed or x2.shape[0] <= self.SMALL_BATCH:
            y = self.kernels.gemm(x2, layer.qweight)
            if layer.bias is not None:
                y += layer.bias
        elif x2.shape[0] <= self.CHUNKED_MAX_ROWS and not self.keep_float32:
            y = torch.cat([self.kernels.gemm(x2[i : i + self.SMALL_BATCH], layer.qweight)
                           for i in range(0, x2.shape[0], self.SMALL_BATCH)])
            if layer.bias is not None:
                y += layer.bias
        else:
            y = F.linear(x2, layer.weight if self.keep_float32 else layer.qweight.float(), layer.bias)
        return y.view(*shape[:-1], y.shape[-1])


def build_linear_method(method: str, kernels=None, compact_dtype: torch.dtype | None = None,
                        keep_float32: bool = False, native_large_batches: bool = False,
                        panel_packed: bool = False) -> LinearMethod:
    """The linear method the execution plan chose (engine/plan.py ``LinearPlan``): ``kernels``
    is the compiled CPU kernels' handle where the plan uses them (kernels.cpu.CpuKernels)."""
    if method == PlainLinearMethod.name:
        return PLAIN
    if method == OneDNNPackedLinearMethod.name:
        return OneDNNPackedLinearMethod()
    if method == Int8WeightOnlyLinearMethod.name:
        return Int8WeightOnlyLinearMethod(kernels, panel_packed and kernels is not None)
    if method == Int8DynamicActivationLinearMethod.name:
        return Int8DynamicActivationLinearMethod(kernels)
    if method == CpuCompactWeightsLinearMethod.name:
        if kernels is None or compact_dtype is None:
            raise ValueError("cpu-compact-weights needs the compiled CPU kernels and the weights' compact dtype")
        return CpuCompactWeightsLinearMethod(compact_dtype, kernels, keep_float32, native_large_batches, panel_packed)
    raise ValueError(f"unknown linear method {method!r}")


# -- layers ------------------------------------------------------------------------------------
class Linear(nn.Module):
    """``y = x W^T + b`` with a full (replicated) weight; the base of the parallel layouts."""

    def __init__(self, out_features: int, in_features: int, bias: bool) -> None:
        super().__init__()
        # Built on the meta device; the loader gives it real storage, then the weight loaders fill it.
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.method: LinearMethod = PLAIN
        self.packed: torch.Tensor | None = None  # the oneDNN method's reordered weight
        self.qweight: torch.Tensor | None = None  # the int8 method's weight and per-row scales
        self.scales: torch.Tensor | None = None
        self.use_int8_kernel = False
        self.scales_f32: torch.Tensor | None = None  # the int8 method's scales for the compiled CPU kernel
        self.qpanels = None  # the int8 method's weight in panels (kernels.cpu.PanelPackedInt8Weight), when it packs

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: object = None, name: str = "") -> None:
        default_weight_loader(param, loaded, shard_id, name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    def set_method(self, method: LinearMethod) -> None:
        self.method = method
        method.process_weights_after_loading(self)


class ColumnParallelLinear(Linear):
    """Output features split across ranks: rank r holds rows [r * out/tp, (r+1) * out/tp)."""

    def __init__(self, out_features: int, in_features: int, bias: bool, tp: TensorParallel = SINGLE) -> None:
        if out_features % tp.size:
            raise ValueError(f"{out_features} output features do not split over {tp.size} ranks")
        super().__init__(out_features // tp.size, in_features, bias)
        self.tp = tp
        self.full_out_features = out_features

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: object = None, name: str = "") -> None:
        n = param.shape[0]
        full = (self.full_out_features, *param.shape[1:])
        _check(name, loaded, full)
        param.data.copy_(_read(loaded, (slice(self.tp.rank * n, (self.tp.rank + 1) * n),)))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one (gate/up):
    ``shard_id`` i is the i-th, of ``output_sizes[i]`` features (split across ranks each)."""

    def __init__(self, output_sizes: list[int], in_features: int, bias: bool, tp: TensorParallel = SINGLE) -> None:
        super().__init__(sum(output_sizes), in_features, bias, tp)
        self.output_sizes = output_sizes

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: object = None, name: str = "") -> None:
        if not isinstance(shard_id, int):
            raise ValueError(f"{name}: a merged projection needs the index of its part")
        size = self.output_sizes[shard_id] // self.tp.size
        offset = sum(self.output_sizes[:shard_id]) // self.tp.size
        _check(name, loaded, (self.output_sizes[shard_id], *param.shape[1:]))
        part = _read(loaded, (slice(self.tp.rank * size, (self.tp.rank + 1) * size),))
        param.data.narrow(0, offset, size).copy_(part)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v fused: rank r holds query heads [r * H/tp, ...) and its KV heads (split,
    or the one it shares when there are fewer KV heads than ranks)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 tp: TensorParallel = SINGLE) -> None:
        if num_heads % tp.size:
            raise ValueError(f"{num_heads} attention heads do not split over {tp.size} ranks")
        self.num_heads_per_rank = num_heads // tp.size
        self.num_kv_heads_per_rank = kv_heads_per_rank(num_kv_heads, tp)
        self.head_dim, self.total_num_heads, self.total_num_kv_heads = head_dim, num_heads, num_kv_heads
        per_rank = (self.num_heads_per_rank + 2 * self.num_kv_heads_per_rank) * head_dim
        super().__init__(per_rank * tp.size, hidden_size, bias, tp)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: object = None, name: str = "") -> None:
        d, rank = self.head_dim, self.tp.rank
        hq, hkv = self.num_heads_per_rank, self.num_kv_heads_per_rank
        if shard_id == "q":
            full_heads, size, offset, first = self.total_num_heads, hq * d, 0, rank * hq
        elif shard_id in ("k", "v"):
            full_heads, size = self.total_num_kv_heads, hkv * d
            offset = hq * d + (0 if shard_id == "k" else hkv * d)
            # Replicated KV heads: rank r's query heads use KV head r * KVH // tp.
            first = rank * hkv if self.total_num_kv_heads >= self.tp.size else \
                rank * self.total_num_kv_heads // self.tp.size
        else:
            raise ValueError(f"{name}: shard id must be q, k or v, got {shard_id!r}")
        _check(name, loaded, (full_heads * d, *param.shape[1:]))
        param.data.narrow(0, offset, size).copy_(_read(loaded, (slice(first * d, first * d + size),)))


class RowParallelLinear(Linear):
    """Input features split across ranks; partial outputs summed by an all-reduce."""

    def __init__(self, out_features: int, in_features: int, bias: bool, tp: TensorParallel = SINGLE) -> None:
        if in_features % tp.size:
            raise ValueError(f"{in_features} input features do not split over {tp.size} ranks")
        super().__init__(out_features, in_features // tp.size, bias)
        self.tp = tp
        self.full_in_features = in_features

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: object = None, name: str = "") -> None:
        if param.dim() == 1:  # the bias: added once, by rank 0, after the sum
            _check(name, loaded, tuple(param.shape))
            if self.tp.rank == 0:
                param.data.copy_(_read(loaded))
            else:
                param.data.zero_()
            return
        n = param.shape[1]
        _check(name, loaded, (param.shape[0], self.full_in_features))
        param.data.copy_(_read(loaded, (slice(None), slice(self.tp.rank * n, (self.tp.rank + 1) * n))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(self, x)
        if self.tp.size > 1:
            torch.distributed.all_reduce(y)
        return y


class VocabParallelLMHead(Linear):
    """The LM head split by vocabulary rows: rank r holds rows [r * ceil(V/tp), ...) (the
    last rank fewer when V does not divide), computes its slice of the logits, and an
    all-gather gives every rank all V (each rank samples the same tokens from them).
    Tied to a replicated embedding, its weight is a view of that embedding's rows."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel = SINGLE) -> None:
        self.per_rank = -(-vocab_size // tp.size)
        self.start = min(tp.rank * self.per_rank, vocab_size)
        self.end = min(self.start + self.per_rank, vocab_size)
        super().__init__(self.end - self.start, hidden_size, bias=False)
        self.tp = tp
        self.vocab_size = vocab_size

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: object = None, name: str = "") -> None:
        _check(name, loaded, (self.vocab_size, param.shape[1]))
        param.data.copy_(_read(loaded, (slice(self.start, self.end),)))

    def tie(self, embedding: nn.Parameter) -> None:
        """Share the (full, replicated) embedding's storage: this rank's rows of it."""
        if self.tp.size == 1:
            self.weight = embedding
        else:
            self.weight = nn.Parameter(embedding.data[self.start : self.end], requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(self, x)  # (N, this rank's rows)
        if self.tp.size == 1:
            return y
        if y.shape[-1] < self.per_rank:  # equal sizes for the gather; the padding ends up last
            y = F.pad(y, (0, self.per_rank - y.shape[-1]))
        parts = [torch.empty_like(y) for _ in range(self.tp.size)]
        torch.distributed.all_gather(parts, y.contiguous())
        return torch.cat(parts, dim=-1)[..., : self.vocab_size]
