"""PyTorch memory snapshots (``torch.cuda.memory._dump_snapshot``): taken, and read safely.

Taking one: ``start_recording`` turns on the allocator's history (the ``device_traces`` and
each block's frames) and ``cuda_snapshot`` returns the snapshot as plain data, the dict that
``_dump_snapshot`` pickles; ``snapshot_bytes`` is that pickle. The engine records when
configured to (``record_memory_history``), and the server hands snapshots to authenticated
requests only (``POST /debug/memory/snapshot``; ``tailserve memory snapshot``).

A snapshot is a pickle of plain data (dicts, lists, strings, numbers). Unpickling can run
arbitrary code through a global reference (``os.system`` and friends), so the loader
refuses *every* global: a snapshot file can never run code. Its ``device_traces`` become a
trace for the simulator (``alloc``; ``free_completed``, or ``free_requested`` where a
trace has no completions).
"""

from __future__ import annotations

import io
import pathlib
import pickle
from typing import Any

from tailserve.errors import ConfigError
from tailserve.memory.allocator.simulator import TraceEvent, read_jsonl_trace


class UnsafeSnapshotError(ConfigError):
    """A snapshot file that would import or call something when loaded."""


class _PlainDataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise UnsafeSnapshotError(f"refusing to load a snapshot that references {module}.{name}: "
                                  "a memory snapshot is plain data, and loading this one would run code")


# Entries of allocation history kept (a ring buffer): each is a few hundred bytes with frames.
DEFAULT_HISTORY_ENTRIES = 100_000


def start_recording(max_entries: int = DEFAULT_HISTORY_ENTRIES) -> None:
    """Record the CUDA caching allocator's history from now on (stack frames included)."""
    import torch

    torch.cuda.memory._record_memory_history(max_entries=max_entries)


def cuda_snapshot() -> dict[str, Any]:
    """The CUDA caching allocator's state now (segments, blocks, history if recorded)."""
    import torch

    return torch.cuda.memory._snapshot()


def snapshot_bytes(snap: dict[str, Any]) -> bytes:
    """The snapshot as ``_dump_snapshot`` writes it (a pickle of plain data)."""
    return pickle.dumps(snap)


def load_snapshot(path: str | pathlib.Path) -> dict[str, Any]:
    return load_snapshot_bytes(pathlib.Path(path).read_bytes(), str(path))


def load_snapshot_bytes(data: bytes, name: str = "snapshot") -> dict[str, Any]:
    try:
        snap = _PlainDataUnpickler(io.BytesIO(data)).load()
    except UnsafeSnapshotError:
        raise
    except Exception as e:  # truncated or not a pickle at all
        raise ConfigError(f"{name}: not a PyTorch memory snapshot ({type(e).__name__}: {e})") from None
    if not isinstance(snap, dict) or "segments" not in snap:
        raise ConfigError(f"{name}: not a PyTorch memory snapshot (no 'segments')")
    return snap


def trace_from_snapshot(snap: dict[str, Any], device: int = 0) -> list[TraceEvent]:
    traces = snap.get("device_traces") or []
    if device >= len(traces) or not traces[device]:
        raise ConfigError("the snapshot has no device_traces for this device "
                          "(record with torch.cuda.memory._record_memory_history() first)")
    entries = traces[device]
    has_completed = any(e.get("action") == "free_completed" for e in entries)
    free_action = "free_completed" if has_completed else "free_requested"
    out = []
    for e in entries:
        action = e.get("action")
        if action == "alloc":
            out.append(TraceEvent("alloc", int(e["addr"]), int(e["size"]), int(e.get("stream", 0))))
        elif action == free_action:
            out.append(TraceEvent("free", int(e["addr"]), int(e.get("size", 0)), int(e.get("stream", 0))))
    return out


def read_trace(path: str | pathlib.Path) -> list[TraceEvent]:
    """A JSONL trace, or a pickled PyTorch snapshot with device_traces."""
    p = pathlib.Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: trace file not found")
    if p.suffix in (".jsonl", ".json"):
        return read_jsonl_trace(p)
    return trace_from_snapshot(load_snapshot(p))
