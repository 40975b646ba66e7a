"""Linear layers: parallel layouts that load their own slices, and linear methods chosen at
load time.

**Linear methods.** How a layer multiplies is decided once, when the model is loaded, by a
``LinearMethod`` (``select_linear_method``), not by a branch inside ``forward``:

- ``PlainLinearMethod``: ``F.linear``; everywhere.
- ``OneDNNPackedLinearMethod``: CPU only. PyTorch's default CPU ``F.linear`` reaches a
  fraction of memory bandwidth for the matrix-vector products of batch-1 decode, worst in
  bfloat16 (measured here: ~9 GB/s for bf16, vs ~26+ GB/s through oneDNN with the weight
  reordered once into its blocked layout). The packed weight replaces the plain one (no
  second copy is kept). Results are the same kernels' arithmetic in the same dtype; tests
  compare both methods against transformers.

Quantised methods (int8, fp8) slot in here: a method owns the layer's weight format.

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

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tailserve.errors import CheckpointFormatError


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


def select_linear_method(device: torch.device, cpu_onednn: bool) -> LinearMethod:
    """The method for every linear layer of a model on ``device``."""
    if device.type == "cpu" and cpu_onednn and onednn_available():
        return OneDNNPackedLinearMethod()
    return PLAIN


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
        self.packed: torch.Tensor | None = None

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
