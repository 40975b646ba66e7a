"""Small compiled CPU kernels: matrix products with compact weights (bf16, fp16, int8) and
float32 arithmetic, for decode on CPUs where PyTorch's own kernels fall short.

Measured on a 2-core AVX2 machine (docs/benchmarks.md): PyTorch's float32 products of a
decode step read weights at about half the memory bandwidth, and its bf16 ones are slower
still on a CPU without native bf16, while a decode step's time is its weight bytes over the
bandwidth. ``gemv_avx2.c`` keeps weights compact and widens them in registers (what
llama.cpp does): row-major for its dot-product kernels, or bf16 re-laid in 16-column panels
(``pack_panels``) for its outer-product kernel, which runs 16-row and prompt products near the
FMA peak; on a CPU with AVX-512 its products of 3+ rows (verification, batched decode) run
512-bit tiles with the same bits, 1.3-1.5x faster (``TAILSERVE_CPU_AVX512=0`` keeps AVX2). It
is compiled on first use with the system C compiler (``$CC``, else
``cc``/``gcc``) into ``$TAILSERVE_CACHE_DIR`` (default ``~/.cache/tailserve/kernels``), keyed
by the source's hash, and loaded with ctypes: no PyTorch headers, about a second to build.

``kernels()`` returns None (and the callers use PyTorch's kernels) when the CPU lacks AVX2/FMA,
no compiler is found, the build fails, or ``TAILSERVE_CPU_KERNELS=0``; ``unavailable_reason()``
says which.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import logging
import os
import pathlib
import shutil
import subprocess
import tempfile
import threading
import time

import numpy as np
import torch

log = logging.getLogger(__name__)

SOURCE = pathlib.Path(__file__).with_name("gemv_avx2.c")
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-lm"]

_lock = threading.Lock()
_state: dict[str, object] = {}


class LayerStruct(ctypes.Structure):
    """``tailserve_layer`` of gemv_avx2.c: one decoder layer's weights and sizes."""

    _fields_ = [("fmt", ctypes.c_int)] + [(n, ctypes.c_void_p) for n in (
        "w_qkv", "w_o", "w_gu", "w_down", "s_qkv", "s_o", "s_gu", "s_down", "ln1", "ln2")] + [
        ("eps", ctypes.c_float), ("scale", ctypes.c_float)] + [(n, ctypes.c_long) for n in ("E", "H", "KVH", "D", "I")]


class StepStruct(ctypes.Structure):
    """``tailserve_step``: a decode step's attention tables, shared by every layer."""

    _fields_ = [("block_tables", ctypes.c_void_p), ("bt_stride", ctypes.c_long), ("seq_lens", ctypes.c_void_p),
                ("slots", ctypes.c_void_p)] + [(n, ctypes.c_long) for n in ("M", "block_size", "window", "max_ctx")] \
        + [("threads", ctypes.c_int), ("kv_fmt", ctypes.c_int)]


WEIGHT_FORMATS = {torch.bfloat16: 0, torch.float16: 1, torch.int8: 2}
PANEL_PACKED_BF16 = 3  # tailserve_layer.fmt of PanelPackedWeight
PANEL_PACKED_INT8 = 4  # tailserve_layer.fmt of PanelPackedInt8Weight
PANEL_PACKED_W8A8 = 5  # tailserve_layer.fmt of PanelPackedW8A8Weight
PANEL_COLUMNS = 16


class _Panels:
    """What both panel layouts answer as a weight does: ``data`` (panels, K, ...) and ``n``."""

    data: torch.Tensor
    n: int

    @property
    def k(self) -> int:
        return self.data.shape[1]

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.k

    def data_ptr(self) -> int:
        return self.data.data_ptr()


@dataclasses.dataclass(frozen=True)
class PanelPackedWeight(_Panels):
    """bf16 weights (N, K) re-laid for the outer-product kernel (``tailserve_gemm_bf16p``):
    panels of 16 output columns, k-major; the 32-bit word (p, k, j) holds column 16p + j in
    its low half and column 16p + 8 + j in its high half (zero past N). The same bytes as the
    (N, K) bf16 tensor, N rounded up to 16."""

    data: torch.Tensor  # (ceil(N / 16), K, 8) int32
    n: int

    def unpack(self) -> torch.Tensor:
        """The (N, K) bf16 weight back (the layout's check in tests)."""
        p, k, _ = self.data.shape
        pairs = self.data.view(torch.bfloat16).view(p, k, 8, 2)  # (P, K, j, half)
        return pairs.permute(0, 3, 2, 1).reshape(p * PANEL_COLUMNS, k)[: self.n].contiguous()


def pack_panels(w: torch.Tensor) -> PanelPackedWeight:
    """(N, K) bf16 -> PanelPackedWeight; on a little-endian CPU the pair (low, high) of bf16
    values is the 32-bit word low | high << 16."""
    if w.dtype != torch.bfloat16 or w.dim() != 2:
        raise ValueError(f"pack_panels takes a 2-D bf16 weight, got {w.dtype} {tuple(w.shape)}")
    n, k = w.shape
    padded = -(-n // PANEL_COLUMNS) * PANEL_COLUMNS
    if padded != n:
        w = torch.cat([w, w.new_zeros(padded - n, k)])
    # (P, half, j, K) -> (P, K, j, half): column 16p + 8 * half + j
    packed = w.view(padded // PANEL_COLUMNS, 2, 8, k).permute(0, 3, 2, 1).contiguous()
    return PanelPackedWeight(packed.view(torch.int32).view(padded // PANEL_COLUMNS, k, 8), n)


@dataclasses.dataclass(frozen=True)
class PanelPackedInt8Weight(_Panels):
    """Weight-only int8 weights (N, K) with their float32 column scales, re-laid for the
    outer-product kernel (``tailserve_gemm_i8p``): panels of 16 output columns, k-major; byte
    (p, k, j) is column 16p + j at k (zero past N). ``scales``: (ceil(N / 16) * 16,) float32,
    zero past N, the pointer a fused layer passes beside the weight."""

    data: torch.Tensor  # (ceil(N / 16), K, 16) int8
    scales: torch.Tensor  # (ceil(N / 16) * 16,) float32
    n: int

    def unpack(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The (N, K) int8 weight and its (N,) scales back (the layout's check in tests)."""
        p, k, _ = self.data.shape
        return self.data.permute(0, 2, 1).reshape(p * PANEL_COLUMNS, k)[: self.n].contiguous(), self.scales[: self.n]


@dataclasses.dataclass(frozen=True)
class PanelPackedW8A8Weight(_Panels):
    """int8 weights (N, K) with their float32 column scales for the W8A8 kernel
    (``tailserve_gemm_w8a8p``: the activations quantised to int8 per row on the way in, the
    products summed exactly in int32): panels of 16 output columns; in a panel, per group of
    4 consecutive k (K padded to a multiple of 4) 64 bytes, column j's four weights at 4j..4j+3;
    after the last panel each padded column's weight sum (int32, the VNNI tiles' correction for
    their unsigned activations). ``scales``: (ceil(N / 16) * 16,) float32, zero past N."""

    data: torch.Tensor  # (ceil(N / 16) * ceil(K / 4) * 64 + ceil(N / 16) * 16 * 4,) int8
    scales: torch.Tensor  # (ceil(N / 16) * 16,) float32
    n: int
    k_in: int  # K (the panels hold it padded to a multiple of 4)

    @property
    def k(self) -> int:
        return self.k_in

    def unpack(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The (N, K) int8 weight and its (N,) scales back (the layout's check in tests)."""
        p, kp = -(-self.n // PANEL_COLUMNS), -(-self.k_in // 4) * 4
        panels = self.data[: p * kp * PANEL_COLUMNS].view(p, kp // 4, PANEL_COLUMNS, 4)  # (P, G, j, b)
        w = panels.permute(0, 2, 1, 3).reshape(p * PANEL_COLUMNS, kp)
        return w[: self.n, : self.k_in].contiguous(), self.scales[: self.n]

    def column_sums(self) -> torch.Tensor:
        """(ceil(N / 16) * 16,) int32: what the kernel reads after the panels."""
        p, kp = -(-self.n // PANEL_COLUMNS), -(-self.k_in // 4) * 4
        return self.data[p * kp * PANEL_COLUMNS :].view(torch.int32)


def pack_panels_w8a8(q: torch.Tensor, scales: torch.Tensor) -> PanelPackedW8A8Weight:
    """(N, K) int8 (in [-127, 127]) and its (N,) float32 scales -> PanelPackedW8A8Weight."""
    if q.dtype != torch.int8 or q.dim() != 2 or scales.shape != (q.shape[0],):
        raise ValueError(f"pack_panels_w8a8 takes a 2-D int8 weight and one scale a row, got {q.dtype} "
                         f"{tuple(q.shape)} and {tuple(scales.shape)}")
    if int(q.min()) < -127:
        raise ValueError("pack_panels_w8a8 takes weights in [-127, 127] (AVX2 negates them)")
    n, k = q.shape
    padded, kp = -(-n // PANEL_COLUMNS) * PANEL_COLUMNS, -(-k // 4) * 4
    s = torch.zeros(padded, dtype=torch.float32)
    s[:n] = scales.float()
    full = q.new_zeros(padded, kp)
    full[:n, :k] = q
    p = padded // PANEL_COLUMNS
    panels = full.view(p, PANEL_COLUMNS, kp // 4, 4).permute(0, 2, 1, 3).reshape(-1)  # (P, G, j, b)
    sums = full.sum(dim=1, dtype=torch.int32)  # (padded,)
    return PanelPackedW8A8Weight(torch.cat([panels, sums.view(torch.int8)]), s, n, k)


AnyKernelWeight = torch.Tensor | PanelPackedWeight | PanelPackedInt8Weight | PanelPackedW8A8Weight


def pack_panels_int8(q: torch.Tensor, scales: torch.Tensor) -> PanelPackedInt8Weight:
    """(N, K) int8 and its (N,) float32 scales -> PanelPackedInt8Weight."""
    if q.dtype != torch.int8 or q.dim() != 2 or scales.shape != (q.shape[0],):
        raise ValueError(f"pack_panels_int8 takes a 2-D int8 weight and one scale a row, got {q.dtype} "
                         f"{tuple(q.shape)} and {tuple(scales.shape)}")
    n, k = q.shape
    padded = -(-n // PANEL_COLUMNS) * PANEL_COLUMNS
    s = torch.zeros(padded, dtype=torch.float32)
    s[:n] = scales.float()
    if padded != n:
        q = torch.cat([q, q.new_zeros(padded - n, k)])
    packed = q.view(padded // PANEL_COLUMNS, PANEL_COLUMNS, k).permute(0, 2, 1).contiguous()  # (P, K, 16)
    return PanelPackedInt8Weight(packed, s, n)


def weight_format(w: AnyKernelWeight) -> int:
    """``tailserve_layer.fmt`` of a weight the kernels take."""
    if isinstance(w, PanelPackedWeight):
        return PANEL_PACKED_BF16
    if isinstance(w, PanelPackedInt8Weight):
        return PANEL_PACKED_INT8
    if isinstance(w, PanelPackedW8A8Weight):
        return PANEL_PACKED_W8A8
    return WEIGHT_FORMATS[w.dtype]
# The KV cache formats the decode attention reads (widened to float32 in registers).
KV_FORMATS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


class CpuKernels:
    """The loaded library: ``gemm(x, w, scale)`` for each weight format, and the fused
    per-layer operations of a float32 decode (``add_rms_norm``, ``silu_mul``)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        args = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int]
        self._fns = {}
        for fmt, name in ((torch.bfloat16, "tailserve_gemm_bf16w"), (torch.float16, "tailserve_gemm_f16w"),
                          (torch.int8, "tailserve_gemm_i8w")):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, None
            self._fns[fmt] = fn
        self._gemm_panels = lib.tailserve_gemm_bf16p
        self._gemm_panels.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3 + [ctypes.c_int]
        self._gemm_panels.restype = None
        self._gemm_i8_panels = lib.tailserve_gemm_i8p
        self._gemm_i8_panels.argtypes, self._gemm_i8_panels.restype = args, None
        self._gemm_w8a8 = lib.tailserve_gemm_w8a8p
        self._gemm_w8a8.argtypes, self._gemm_w8a8.restype = args, None
        self._panel_isa = lib.tailserve_panel_isa
        self._panel_isa.argtypes = [ctypes.c_int]
        self._panel_isa.restype = ctypes.c_int
        # Decided once here: AVX-512 tiles for panel products of 3+ rows where the CPU has
        # AVX-512 (bitwise the AVX2 tiles' results, ~1.3-1.5x faster), unless
        # TAILSERVE_CPU_AVX512=0.
        self.wide_tiles = bool(self._panel_isa(0 if os.environ.get("TAILSERVE_CPU_AVX512", "1") == "0" else -1))

        self._norm = lib.tailserve_add_rms_norm
        self._norm.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 2 + [ctypes.c_float]
        self._norm.restype = None
        self._silu_mul = lib.tailserve_silu_mul
        self._silu_mul.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_long] * 2
        self._silu_mul.restype = None
        self._attn = lib.tailserve_paged_decode_attention
        self._attn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_long] + [ctypes.c_void_p] * 3 \
            + [ctypes.c_long] * 5 + [ctypes.c_float, ctypes.c_long, ctypes.c_long, ctypes.c_int, ctypes.c_int]
        self._attn.restype = None
        self._rope_attn = lib.tailserve_rope_paged_decode_attention
        self._rope_attn.argtypes = [ctypes.c_void_p, ctypes.c_long] + [ctypes.c_void_p] * 5 + [ctypes.c_long] \
            + [ctypes.c_void_p] * 3 + [ctypes.c_long] * 5 + [ctypes.c_float, ctypes.c_long, ctypes.c_long, ctypes.c_int,
                                                              ctypes.c_int]
        self._rope_attn.restype = None
        self.decode_layer = lib.tailserve_decode_layer
        self.decode_layer.argtypes = [ctypes.POINTER(LayerStruct), ctypes.POINTER(StepStruct)] + [ctypes.c_void_p] * 7
        self.decode_layer.restype = None
        self.decode_model = lib.tailserve_decode_model
        self.decode_model.argtypes = [ctypes.POINTER(LayerStruct), ctypes.c_long, ctypes.POINTER(StepStruct)] \
            + [ctypes.c_void_p] * 4 + [ctypes.POINTER(ctypes.c_void_p)] * 2 + [ctypes.c_void_p, ctypes.c_float] \
            + [ctypes.c_long] * 3 + [ctypes.c_int] \
            + [ctypes.c_void_p] * 2 + [ctypes.c_long] + [ctypes.c_void_p] * 2
        self.decode_model.restype = ctypes.c_long
        self.draft_rounds = lib.tailserve_draft_rounds
        self.draft_rounds.argtypes = [ctypes.POINTER(LayerStruct), ctypes.c_long, ctypes.POINTER(StepStruct),
                                      ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                      ctypes.c_int64, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_long,
                                      ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long,
                                      ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                                      ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_void_p,
                                      ctypes.c_float, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long]
        self.draft_rounds.argtypes += [ctypes.c_void_p] * 7 + [ctypes.c_double] + [ctypes.c_void_p] * 5
        self.draft_rounds.restype = ctypes.c_long
        self._cutoffs = lib.tailserve_sampling_cutoffs
        self._cutoffs.argtypes = [ctypes.c_void_p] + [ctypes.c_long] * 3 + [ctypes.c_void_p] * 3 + [ctypes.c_int]
        self._cutoffs.restype = None
        self._bitmask = lib.tailserve_apply_token_bitmask
        self._bitmask.argtypes = [ctypes.c_void_p, ctypes.c_long] + [ctypes.c_void_p] * 2 + [ctypes.c_long] * 3 \
            + [ctypes.c_int]
        self._bitmask.restype = None
        self._race = lib.tailserve_seeded_race
        self._race.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_long,
                               ctypes.c_void_p, ctypes.c_int]
        self._race.restype = None
        self._inverse_cdf = lib.tailserve_inverse_cdf
        self._inverse_cdf.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_long,
                                      ctypes.c_void_p, ctypes.c_int]
        self._inverse_cdf.restype = None
        self._verify = lib.tailserve_verify_drafts
        self._verify.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_long] \
            + [ctypes.c_void_p] * 4 + [ctypes.c_long] * 2 + [ctypes.c_int] + [ctypes.c_void_p] * 2 + [ctypes.c_int]
        self._verify.restype = None
        self._top2 = lib.tailserve_top2_margin
        self._top2.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_void_p,
                               ctypes.c_void_p]
        self._top2.restype = None
        walk_args = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p,
                     ctypes.c_long, ctypes.c_long, ctypes.c_double, ctypes.c_double, ctypes.c_void_p, ctypes.c_void_p,
                     ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        self._suffix_walk = {}
        for dtype, name in ((np.int64, "tailserve_suffix_walk_i64"), (np.int32, "tailserve_suffix_walk_i32")):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = walk_args, ctypes.c_long
            self._suffix_walk[np.dtype(dtype)] = fn

    def set_wide_tiles(self, on: bool) -> bool:
        """Switch the panel products between AVX-512 and AVX2 tiles for this process (A/B
        measurements and the bitwise test; on only where the CPU has AVX-512). Returns the
        choice in force."""
        self.wide_tiles = bool(self._panel_isa(int(on)))
        return self.wide_tiles

    def top2_margin(self, logits: torch.Tensor) -> tuple[list[int], list[float]]:
        """Per row of float32 logits (N, V): the argmax (first maximum) and p(it) - p(second)
        of the row's softmax (a greedy draft's confidence), in one pass."""
        if logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1:
            raise ValueError("top2_margin takes float32 (N, V) logits with unit stride on V")
        n, v = logits.shape
        top = np.empty(n, dtype=np.int64)
        margin = np.empty(n, dtype=np.float32)
        self._top2(logits.data_ptr(), n, v, logits.stride(0), top.ctypes.data, margin.ctypes.data)
        return top.tolist(), margin.tolist()

    def suffix_walk(self, tokens: np.ndarray, pattern: np.ndarray, where: np.ndarray | None, base: int, k: int,
                    max_spec_factor: float, min_token_prob: float, scales: np.ndarray | None,
                    probe: np.ndarray | None) -> tuple[list[int], list[float], int, int, float]:
        """Suffix decoding's walk (``speculative.suffix._walk``, its drafts exactly) in one call.
        ``tokens``: the text (int64 or int32, contiguous), ``pattern``: the context's last tokens
        (the same dtype); ``where``: int32 positions of ``pattern[-1]`` in ``tokens`` (those
        below ``base`` skipped), or None to find them in ``tokens[:-1]`` (the pattern is then
        the text's end). With a calibration: per match-length bucket its factor (float64) and
        whether its next hold lets a draft through (uint8). Returns (draft, cumulative
        probabilities, match length, the bucket whose hold was consulted or -1, score)."""
        fn = self._suffix_walk.get(tokens.dtype)
        if fn is None or pattern.dtype != tokens.dtype or not tokens.flags.c_contiguous \
                or not pattern.flags.c_contiguous or (where is not None and where.dtype != np.int32):
            raise ValueError("suffix_walk takes contiguous int64 or int32 tokens and pattern of one dtype, "
                             "int32 positions")
        out_tokens = np.empty(max(k, 1), dtype=np.int64)
        out_cum = np.empty(max(k, 1), dtype=np.float64)
        info = np.empty(2, dtype=np.int64)
        score = np.empty(1, dtype=np.float64)
        calibrated = scales is not None
        d = fn(tokens.ctypes.data, tokens.size, None if where is None else where.ctypes.data,
               0 if where is None else where.size, base, pattern.ctypes.data, pattern.size, k, max_spec_factor,
               min_token_prob, scales.ctypes.data if calibrated else None,
               probe.ctypes.data if calibrated else None, int(calibrated), out_tokens.ctypes.data,
               out_cum.ctypes.data, info.ctypes.data, score.ctypes.data)
        return out_tokens[:d].tolist(), out_cum[:d].tolist(), int(info[0]), int(info[1]), float(score[0])

    def sampling_cutoffs(self, logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        """Per row of float32 logits (N, V): the smallest logit that survives top-k (int64
        (N,), V or more: off) then top-p (float32 (N,), 1: off); -inf where nothing is cut.
        The semantics of ``engine.sampler.filtered_probs``, by quickselect instead of a sort."""
        if logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1:
            raise ValueError("sampling_cutoffs takes float32 (N, V) logits with unit stride on V")
        n, v = logits.shape
        top_k = top_k.to(torch.int64).contiguous()
        top_p = top_p.to(torch.float32).contiguous()
        out = torch.empty(n, dtype=torch.float32)
        self._cutoffs(logits.data_ptr(), n, v, logits.stride(0), top_k.data_ptr(), top_p.data_ptr(), out.data_ptr(),
                      torch.get_num_threads())
        return out

    def apply_token_bitmask(self, logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
        """In place: float32 logits (N, V), rows (R,) int64, bitmask (R, ceil(V / 32)) int32
        (sample/bitmask.py): every token whose bit is clear gets -inf."""
        if logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1:
            raise ValueError("apply_token_bitmask takes float32 (N, V) logits with unit stride on V")
        rows = rows.to(torch.int64).contiguous()
        bitmask = bitmask.contiguous()
        r, w = bitmask.shape
        self._bitmask(logits.data_ptr(), logits.stride(0), rows.data_ptr(), bitmask.data_ptr(), r, logits.shape[1],
                      w, torch.get_num_threads())

    def seeded_race(self, probs: torch.Tensor, keys: list[int]) -> torch.Tensor:
        """Per row of float32 probabilities (N, V) the winner of its exponential race with
        the noise of ``keys[row]`` (``sample.sampler.race_noise``'s formula): (N,) int64."""
        if probs.dtype != torch.float32 or probs.dim() != 2 or probs.stride(1) != 1:
            raise ValueError("seeded_race takes float32 (N, V) probabilities with unit stride on V")
        n, v = probs.shape
        k = torch.tensor(keys, dtype=torch.int64)  # 63-bit keys: the same bits as uint64
        out = torch.empty(n, dtype=torch.int64)
        self._race(probs.data_ptr(), probs.stride(0), k.data_ptr(), n, v, out.data_ptr(), torch.get_num_threads())
        return out

    def inverse_cdf(self, probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
        """``sample.sampler.sample_from_probs`` in one call: per row of float32 probabilities
        (N, V) the first token whose cumulative mass exceeds ``uniform[row]`` (float64) times
        the row's total: (N,) int64, the same tokens."""
        if probs.dtype != torch.float32 or probs.dim() != 2 or probs.stride(1) != 1:
            raise ValueError("inverse_cdf takes float32 (N, V) probabilities with unit stride on V")
        n, v = probs.shape
        u = uniform.to(torch.float64).contiguous()
        out = torch.empty(n, dtype=torch.int64)
        self._inverse_cdf(probs.data_ptr(), probs.stride(0), u.data_ptr(), n, v, out.data_ptr(),
                          torch.get_num_threads())
        return out

    def verify_drafts(self, probs: torch.Tensor, q: torch.Tensor | None, draft_ids: list[list[int]],
                      num_drafts: list[int], uniform: torch.Tensor, final_u: torch.Tensor,
                      block: bool) -> tuple[list[int], list[int]]:
        """Token-wise or block verification of sampled requests in one call (the rules of
        ``sample.rejection``): probs (sum(k_b + 1), V) float32 filtered target probabilities,
        q (sum(k_b), V) float32 draft probabilities or None (one-hot drafts), uniform
        (sum(k_b),) float32, final_u (B,) float64. Returns (accepted counts, final tokens)."""
        if probs.dtype != torch.float32 or probs.dim() != 2 or probs.stride(1) != 1:
            raise ValueError("verify_drafts takes float32 (rows, V) probabilities with unit stride on V")
        b, v = len(num_drafts), probs.shape[1]
        # Host arrays through NumPy: a torch.tensor from a list cost ~3-4 us each here, once a
        # speculative round.
        ids = np.array([t for d in draft_ids for t in d] or [0], dtype=np.int64)
        nd = np.array(num_drafts, dtype=np.int64)
        uniform = uniform.to(torch.float32).contiguous()
        final_u = final_u.to(torch.float64).contiguous()
        if q is not None:
            q = q.to(torch.float32).contiguous()
        out = np.empty((2, b), dtype=np.int64)  # accepted counts, final tokens
        self._verify(probs.data_ptr(), probs.stride(0), None if q is None else q.data_ptr(), 0 if q is None else v,
                     ids.ctypes.data, uniform.data_ptr(), final_u.data_ptr(), nd.ctypes.data, b, v, int(block),
                     out.ctypes.data, out.ctypes.data + 8 * b, torch.get_num_threads())
        return out[0].tolist(), out[1].tolist()

    def paged_decode_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor, slots: torch.Tensor, scale: float,
                               window: int | None, max_ctx: int) -> torch.Tensor:
        """One query per sequence: q (B, H, D), k/v (B, KVH, D) float32, written into ``kv_cache``
        (2, num_blocks, block_size, KVH, D) contiguous, float32, bf16 or fp16 (``KV_FORMATS``;
        a 16-bit cache stores them rounded to nearest-even) at ``slots`` (B,) int64;
        block_tables (B, W) int32, seq_lens (B,) int32 (context after this token). Returns (B, H*D)."""
        b, h, d = q.shape
        kvh, bs = k.shape[1], kv_cache.shape[2]
        fmt = self._kv_format(kv_cache)
        out = torch.empty((b, h * d), dtype=torch.float32)
        q, k, v = q.float().contiguous(), k.float().contiguous(), v.float().contiguous()
        k_ptr = kv_cache.data_ptr()
        v_ptr = k_ptr + kv_cache.stride(0) * kv_cache.element_size()
        self._attn(q.data_ptr(), k.data_ptr(), v.data_ptr(), k_ptr, v_ptr,
                   block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(), slots.data_ptr(),
                   out.data_ptr(), b, h, kvh, d, bs, scale, window or 0, max_ctx, fmt, torch.get_num_threads())
        return out

    @staticmethod
    def _kv_format(kv_cache: torch.Tensor) -> int:
        fmt = KV_FORMATS.get(kv_cache.dtype)
        if fmt is None or not kv_cache.is_contiguous():
            raise ValueError(f"the CPU decode attention reads a contiguous float32, bf16 or fp16 KV cache, "
                             f"not {kv_cache.dtype}")
        return fmt

    def rope_paged_decode_attention(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, h: int, kvh: int,
                                    kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                                    slots: torch.Tensor, scale: float, window: int | None,
                                    max_ctx: int) -> torch.Tensor:
        """``paged_decode_attention`` from the fused projection's rows: qkv (B, (H + 2 KVH) * D)
        float32 with unit inner stride, cos/sin (B, D) float32 for each row's position; q and
        k rotated (rotate-half) inside. Returns (B, H*D)."""
        b = qkv.shape[0]
        d = cos.shape[-1]
        if qkv.stride(1) != 1 or qkv.dtype != torch.float32 or qkv.shape[1] != (h + 2 * kvh) * d \
                or cos.numel() != b * d:
            raise ValueError("rope_paged_decode_attention takes float32 (B, (H + 2 KVH) * D) rows and (B, D) tables")
        fmt = self._kv_format(kv_cache)
        if not (cos.is_contiguous() and sin.is_contiguous()):
            cos, sin = cos.contiguous(), sin.contiguous()
        out = torch.empty((b, h * d), dtype=torch.float32)
        k_ptr = kv_cache.data_ptr()  # (2, ...) contiguous: the V half starts stride(0) elements on
        self._rope_attn(qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(), k_ptr,
                        k_ptr + kv_cache.stride(0) * kv_cache.element_size(), block_tables.data_ptr(),
                        block_tables.stride(0), seq_lens.data_ptr(),
                        slots.data_ptr(), out.data_ptr(), b, h, kvh, d, kv_cache.shape[2], scale, window or 0,
                        max_ctx, fmt, torch.get_num_threads())
        return out

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 (M, K): with a residual, ``residual += x`` (in place) then its RMS norm times
        ``weight``; without, the norm of x. Returns (normed, the residual stream)."""
        stream = x if residual is None else residual
        if stream.dtype != torch.float32 or not stream.is_contiguous() or not x.is_contiguous():
            raise ValueError("add_rms_norm takes contiguous float32 tensors")
        y = torch.empty_like(stream)
        m, k = stream.shape
        self._norm(stream.data_ptr(), 0 if residual is None else x.data_ptr(), weight.data_ptr(), y.data_ptr(),
                   m, k, eps)
        return y, stream

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """(M, 2I) float32 -> silu(gate) * up, (M, I)."""
        gate_up = gate_up.contiguous()
        m, two_i = gate_up.shape
        out = torch.empty((m, two_i // 2), dtype=torch.float32)
        self._silu_mul(gate_up.data_ptr(), out.data_ptr(), m, two_i // 2)
        return out

    @staticmethod
    def supports(w: AnyKernelWeight) -> bool:
        """Whether a weight can go through these kernels (2-D, contiguous, K a multiple of 8;
        or packed in panels)."""
        if isinstance(w, _Panels):
            return True
        return (w.dim() == 2 and w.is_contiguous() and w.device.type == "cpu" and w.shape[1] % 8 == 0
                and w.dtype in (torch.bfloat16, torch.float16, torch.int8))

    def gemm(self, x: torch.Tensor, w: AnyKernelWeight, scale: torch.Tensor | None = None) -> torch.Tensor:
        """x (M, K) float32, w (N, K) compact or packed in panels, scale (N,) float32 or None
        (not with panels: int8 panels carry their own) -> (M, N) float32."""
        x = x.contiguous()
        m, k = x.shape
        n = w.shape[0]
        if x.dtype != torch.float32 or w.shape[1] != k:
            raise ValueError(f"gemm takes float32 x (M, {w.shape[1]}), got {x.dtype} {tuple(x.shape)}")
        y = torch.empty((m, n), dtype=torch.float32)
        if isinstance(w, PanelPackedWeight):
            if scale is not None:
                raise ValueError("weights packed in panels take no row scales")
            self._gemm_panels(x.data_ptr(), w.data_ptr(), y.data_ptr(), m, n, k, torch.get_num_threads())
            return y
        if isinstance(w, (PanelPackedInt8Weight, PanelPackedW8A8Weight)):
            if scale is not None:
                raise ValueError("int8 weights packed in panels carry their own scales")
            fn = self._gemm_w8a8 if isinstance(w, PanelPackedW8A8Weight) else self._gemm_i8_panels
            fn(x.data_ptr(), w.data_ptr(), w.scales.data_ptr(), y.data_ptr(), m, n, k, torch.get_num_threads())
            return y
        self._fns[w.dtype](x.data_ptr(), w.data_ptr(), 0 if scale is None else scale.data_ptr(), y.data_ptr(),
                           m, n, k, torch.get_num_threads())
        return y


def _cache_dir() -> pathlib.Path:
    root = os.environ.get("TAILSERVE_CACHE_DIR")
    return pathlib.Path(root) if root else pathlib.Path.home() / ".cache" / "tailserve" / "kernels"


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _build() -> tuple[CpuKernels | None, str]:
    if os.environ.get("TAILSERVE_CPU_KERNELS", "1") == "0":
        return None, "TAILSERVE_CPU_KERNELS=0"
    cap = torch.backends.cpu.get_cpu_capability()
    if cap not in ("AVX2", "AVX512"):
        return None, f"the CPU's vector capability is {cap} (the kernels need AVX2 and FMA)"
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join(FLAGS).encode()).hexdigest()[:16]
    target = _cache_dir() / f"gemv_avx2-{digest}.so"
    if not target.exists():
        cc = _compiler()
        if cc is None:
            return None, "no C compiler found ($CC, cc, gcc, clang)"
        target.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = pathlib.Path(tmp) / target.name
            proc = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", str(out)], capture_output=True, text=True)
            if proc.returncode != 0:
                last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"
                return None, f"{cc} failed: {last}"
            os.replace(out, target)  # atomic: a concurrent process sees the whole file or none
        log.info("compiled CPU kernels built in %.1f s (%s), cached in %s", time.perf_counter() - t0, cc, target)
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as e:
        return None, f"loading {target}: {e}"
    return CpuKernels(lib), ""


def kernels() -> CpuKernels | None:
    """The kernels, built and loaded once per process (None where they cannot run)."""
    with _lock:
        if "kernels" not in _state:
            try:
                k, why = _build()
            except OSError as e:  # an unwritable cache folder, a compiler that cannot be run, ...
                k, why = None, f"building the kernels failed: {e}"
            _state["kernels"], _state["reason"] = k, why
            if k is None:
                log.info("compiled CPU kernels unavailable: %s (PyTorch's kernels are used)", why)
        return _state["kernels"]  # type: ignore[return-value]


def unavailable_reason() -> str:
    kernels()
    return str(_state["reason"])
