"""Record the engine's own allocation trace on the CPU, for the allocator model.

``torch.profiler`` with ``profile_memory=True`` reports every tensor allocation and free
(address, bytes) that PyTorch's allocator sees. On the CPU that is the plain system
allocator, not the CUDA caching allocator; but the sequence it records (which sizes the
engine asks for, in which order, and how long each lives) is the program's own demand, so
replaying it through ``CachingAllocatorSimulator`` predicts what the caching allocator
would make of the same steps on a GPU, for each ``PYTORCH_CUDA_ALLOC_CONF``. What a GPU run
adds (kernel workspaces, cuBLAS handles, CUDA-graph pools) is not in it.

The trace covers generation only: the weights and the KV cache are allocated before
recording starts, as they are allocated once at start-up on a GPU too.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import sys
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any

from tailserve.memory.allocator.simulator import TraceEvent


def events_from_chrome_trace(trace: dict[str, Any]) -> list[TraceEvent]:
    """``[memory]`` instant events of a profiler's Chrome trace -> alloc/free events, in
    time order. Frees of memory allocated before the recording are dropped."""
    mem = [e for e in trace.get("traceEvents", []) if e.get("name") == "[memory]" and "args" in e]
    mem.sort(key=lambda e: (e.get("ts", 0), e["args"].get("Ev Idx", 0)))
    live: dict[int, int] = {}
    out = []
    for e in mem:
        a = e["args"]
        addr, size = int(a.get("Addr", 0)), int(a.get("Bytes", 0))
        if size > 0:
            live[addr] = size
            out.append(TraceEvent("alloc", addr, size, 0))
        elif size < 0 and addr in live:
            out.append(TraceEvent("free", addr, live.pop(addr), 0))
    return out


# What the profiler's C++ side (Kineto) writes to the process's stderr when it starts and
# stops, e.g. "USDT:2026-12-03 15:53:08 3225:3225 SyncActivityProfilerHandler.cpp:52] profiler_start".
_PROFILER_LOG = re.compile(r"^(USDT:|[A-Z]\d{4} .*(ActivityProfiler|Kineto)|.*ActivityProfiler.*\] )")


@contextlib.contextmanager
def _quiet_profiler_log() -> Iterator[None]:
    """Hold file descriptor 2 in a temporary file while the profiler runs, then write back
    every line that is not the profiler's own start/stop log (warnings and errors still
    reach the user)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as f:
        os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            f.seek(0)
            kept = [ln for ln in f.read().decode("utf-8", "replace").splitlines(keepends=True)
                    if not _PROFILER_LOG.match(ln)]
            if kept:
                sys.stderr.write("".join(kept))


def record_generation_trace(llm: Any, prompts: Sequence[str | list[int]], params: Any) -> list[TraceEvent]:
    """Run ``llm.generate(prompts, params)`` under the profiler and return its trace."""
    # The autograd profiler is what ``torch.profiler.profile`` drives on the CPU, and records the
    # same ``[memory]`` events; the newer wrapper's start asks ``hasattr(torch, "_inductor")``,
    # which imports the compiler stack: 2-3 s here, for nothing a CPU trace uses.
    from torch.autograd.profiler import profile

    llm.generate(list(prompts)[:1], params)  # warm-up: first-call caches are not the steady state
    with _quiet_profiler_log(), profile(profile_memory=True) as prof:
        llm.generate(list(prompts), params)
    with tempfile.TemporaryDirectory() as d:
        path = pathlib.Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    return events_from_chrome_trace(trace)


def write_jsonl(events: Sequence[TraceEvent], path: str | pathlib.Path) -> None:
    with open(path, "w") as f:
        for ev in events:
            f.write(json.dumps({"action": ev.action, "addr": ev.addr, "size": ev.size, "stream": ev.stream}) + "\n")
