"""``PYTORCH_CUDA_ALLOC_CONF`` parsed and validated the way PyTorch's allocator config does
(c10 ``AllocatorConfig::parseArgs``), so a bad setting is caught with a clear error before
it reaches a GPU, and the simulator sees exactly the values PyTorch would use.

Keys modelled: ``max_split_size_mb`` (>= 20), ``max_non_split_rounding_mb`` (>= 20, default
20), ``garbage_collection_threshold`` (in (0, 1)), ``roundup_power2_divisions`` (one power
of two, or the list form ``[256:1,512:2,>:8]`` whose keys are MiB boundaries), and
``expandable_segments``. Keys PyTorch accepts that do not change the caching arithmetic
(``backend``, ``release_lock_on_cudamalloc``, ``pinned_*``, ...) are kept as given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tailserve.errors import ConfigError

MiB = 1 << 20
K_LARGE_BUFFER = 20 * MiB
ROUNDUP_INTERVALS = 16  # power-of-two intervals from 1 MiB (index 0) up
_PASSTHROUGH = {"backend", "release_lock_on_cudamalloc", "pinned_use_cuda_host_register", "pinned_num_register_threads",
                "pinned_use_background_threads", "pinned_reserve_segment_size_mb",
                "graph_capture_record_stream_reuse", "expandable_segments_handle_type"}


@dataclass(frozen=True)
class AllocatorConf:
    max_split_size: float = math.inf  # bytes; inf = never refuse to split
    max_non_split_rounding: int = K_LARGE_BUFFER
    garbage_collection_threshold: float = 0.0
    roundup_power2_divisions: tuple[int, ...] = (0,) * ROUNDUP_INTERVALS
    expandable_segments: bool = False
    other: tuple[tuple[str, str], ...] = field(default=())
    text: str = ""

    def divisions_for(self, size: int) -> int:
        """The roundup divisions of the power-of-two interval ``size`` falls in."""
        log_size = size.bit_length() - 1
        index = max(log_size - 20, 0)
        return self.roundup_power2_divisions[min(index, ROUNDUP_INTERVALS - 1)]

    def __str__(self) -> str:
        return self.text or "default"


def _is_pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def _int(key: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"PYTORCH_CUDA_ALLOC_CONF: {key} needs an integer, got {value!r}") from None


def _divisions(value: str) -> tuple[int, ...]:
    key = "roundup_power2_divisions"
    out = [0] * ROUNDUP_INTERVALS
    value = value.strip()
    if not value.startswith("["):
        v = _int(key, value)
        if not _is_pow2(v):
            raise ConfigError(f"PYTORCH_CUDA_ALLOC_CONF: {key} must be a power of 2, got {v}")
        return (v,) * ROUNDUP_INTERVALS
    if not value.endswith("]"):
        raise ConfigError(f"PYTORCH_CUDA_ALLOC_CONF: {key} list {value!r} has no closing ']'")
    first, last_index = True, 0
    for item in filter(None, (s.strip() for s in value[1:-1].split(","))):
        bound, sep, div = item.partition(":")
        if not sep:
            raise ConfigError(f"PYTORCH_CUDA_ALLOC_CONF: {key} entry {item!r} is not BOUNDARY_MB:DIVISIONS")
        d = _int(key, div)
        if d != 0 and not _is_pow2(d):
            raise ConfigError(f"PYTORCH_CUDA_ALLOC_CONF: {key} divisions must be a power of 2 or 0, got {d}")
        if bound.strip() == ">":
            for i in range(last_index + 1, ROUNDUP_INTERVALS):
                out[i] = d
            continue
        b = _int(key, bound)
        if not _is_pow2(b):
            raise ConfigError(f"PYTORCH_CUDA_ALLOC_CONF: {key} boundaries must be powers of 2 (MiB), got {b}")
        index = min(max(b.bit_length() - 1, 0), ROUNDUP_INTERVALS - 1)
        if first:  # every interval below the first boundary takes its value too
            for i in range(index):
                out[i] = d
            first = False
        out[index] = d
        last_index = index
    return tuple(out)


def _split_top_level(text: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def parse_alloc_conf(text: str | None) -> AllocatorConf:
    """``"max_split_size_mb:128,garbage_collection_threshold:0.8"`` -> AllocatorConf.
    Raises ConfigError naming the key for an unknown key or a bad value."""
    if not text:
        return AllocatorConf()
    kw: dict[str, object] = {}
    other = []
    for item in _split_top_level(text):
        key, sep, value = item.partition(":")
        key, value = key.strip(), value.strip()
        if not sep or not value:
            raise ConfigError(f"PYTORCH_CUDA_ALLOC_CONF: {item!r} is not key:value")
        if key in ("max_split_size_mb", "max_non_split_rounding_mb"):
            mb = _int(key, value)
            if mb < K_LARGE_BUFFER // MiB:
                raise ConfigError(f"PYTORCH_CUDA_ALLOC_CONF: {key} must be >= {K_LARGE_BUFFER // MiB}, got {mb}")
            kw["max_split_size" if key == "max_split_size_mb" else "max_non_split_rounding"] = mb * MiB
        elif key == "garbage_collection_threshold":
            try:
                v = float(value)
            except ValueError:
                raise ConfigError(f"PYTORCH_CUDA_ALLOC_CONF: {key} needs a number, got {value!r}") from None
            if not 0.0 < v < 1.0:
                raise ConfigError(f"PYTORCH_CUDA_ALLOC_CONF: {key} must be in (0.0, 1.0), got {v}")
            kw["garbage_collection_threshold"] = v
        elif key == "roundup_power2_divisions":
            kw["roundup_power2_divisions"] = _divisions(value)
        elif key == "expandable_segments":
            if value not in ("True", "False", "true", "false"):
                raise ConfigError(f"PYTORCH_CUDA_ALLOC_CONF: expandable_segments must be True or False, got {value!r}")
            kw["expandable_segments"] = value in ("True", "true")
        elif key in _PASSTHROUGH:
            other.append((key, value))
        else:
            raise ConfigError(f"PYTORCH_CUDA_ALLOC_CONF: unknown key {key!r}")
    return AllocatorConf(other=tuple(other), text=text, **kw)  # type: ignore[arg-type]
