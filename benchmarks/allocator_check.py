"""The allocator model against PyTorch's real CUDA caching allocator, on the same traces.

For each trace and each PYTORCH_CUDA_ALLOC_CONF, a fresh process (the setting is read once,
when CUDA initialises) replays the trace with ``torch.empty`` / ``del`` on the GPU and reads
``torch.cuda.max_memory_reserved()``; the simulator predicts the same figure. The goal is a
prediction within 5%. Without a GPU (``--simulate-only``) it prints the predictions alone.

Traces (fixed seeds): ``order`` (eight 16 MiB tensors freed, then four 32 MiB: 256 MiB
predicted), ``kv_like`` (a decode loop's pattern: a growing set of per-request buffers of
mixed sizes, freed out of order), ``mixed`` (random sizes from 512 B to 64 MiB, random frees).

    python benchmarks/allocator_check.py [--simulate-only] [--per-event] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys

from tailserve.memory.allocator.simulator import TraceEvent, simulate_trace

MiB = 1 << 20
CONFS = ["", "max_split_size_mb:128", "roundup_power2_divisions:4", "max_split_size_mb:64,roundup_power2_divisions:8",
         "expandable_segments:True"]


def trace_order() -> list[TraceEvent]:
    ev = [TraceEvent("alloc", i, 16 * MiB) for i in range(8)]
    ev += [TraceEvent("free", i, 16 * MiB) for i in range(8)]
    ev += [TraceEvent("alloc", 100 + i, 32 * MiB) for i in range(4)]
    return ev


def _random_trace(n: int, free_prob: float, size, seed: int) -> list[TraceEvent]:
    """n events: with probability free_prob free a random live tensor, else allocate size(rng)."""
    rng = random.Random(seed)
    ev, live, addr = [], [], 0
    for _ in range(n):
        if live and rng.random() < free_prob:
            ev.append(TraceEvent("free", live.pop(rng.randrange(len(live))), 0))
        else:
            ev.append(TraceEvent("alloc", addr, size(rng)))
            live.append(addr)
            addr += 1
    return ev


def trace_kv_like(seed: int = 0) -> list[TraceEvent]:
    sizes = [3 * MiB, 5 * MiB, 12 * MiB, 24 * MiB, 40 * MiB]
    return _random_trace(600, 0.45, lambda rng: rng.choice(sizes) + rng.randrange(0, MiB, 512), seed)


def trace_mixed(seed: int = 1) -> list[TraceEvent]:
    return _random_trace(3000, 0.5, lambda rng: int(2 ** rng.uniform(9, 26)), seed)


TRACES = {"order": trace_order, "kv_like": trace_kv_like, "mixed": trace_mixed}


def replay_on_gpu(name: str, per_event: bool = False) -> dict:
    """In this process (PYTORCH_CUDA_ALLOC_CONF already in the environment): peak reserved and,
    with per_event, the reserved and allocated bytes after each event (to find where a
    prediction first departs from the real allocator)."""
    import torch

    torch.cuda.init()
    live = {}
    reserved, allocated = [], []
    for e in TRACES[name]():
        if e.action == "alloc":
            live[e.addr] = torch.empty(e.size, dtype=torch.uint8, device="cuda")
        else:
            live.pop(e.addr, None)
        if per_event:
            reserved.append(torch.cuda.memory_reserved())
            allocated.append(torch.cuda.memory_allocated())
    torch.cuda.synchronize()
    out = {"peak_reserved": int(torch.cuda.max_memory_reserved())}
    if per_event:
        out.update(reserved_after_each_event=reserved, allocated_after_each_event=allocated)
    return out


def _replay(name: str, conf: str, per_event: bool = False) -> dict:
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=conf)
    cmd = [sys.executable, __file__, "--replay", name] + (["--per-event"] if per_event else [])
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise SystemExit(f"replay of {name} with {conf!r} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--simulate-only", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--per-event", action="store_true",
                    help="for each pair that misses by more than 0.5%%, also record the real reserved and allocated "
                         "bytes after every event (in --json)")
    ap.add_argument("--replay", help=argparse.SUPPRESS)  # internal: replay one trace in this process
    args = ap.parse_args()
    if args.replay:
        print(json.dumps(replay_on_gpu(args.replay, args.per_event)))
        return
    rows = []
    for name, make in TRACES.items():
        events = make()
        for conf in CONFS:
            predicted = simulate_trace(events, conf, capacity_bytes=1 << 40).peak_reserved_bytes
            real, detail = None, {}
            if not args.simulate_only:
                real = _replay(name, conf)["peak_reserved"]
            err = None if real is None else (predicted - real) / real
            if args.per_event and err is not None and abs(err) > 0.005:
                detail = _replay(name, conf, per_event=True)
                detail.pop("peak_reserved")
            rows.append({"trace": name, "conf": conf or "default", "events": len(events),
                         "predicted_peak_reserved_bytes": predicted, "real_peak_reserved_bytes": real,
                         "relative_error": err, **detail})
            real_s = "-" if real is None else f"{real / MiB:10.1f}"
            err_s = "-" if err is None else f"{err:+.1%}"
            print(f"{name:8s} {conf or 'default':48s} predicted {predicted / MiB:10.1f} MiB  "
                  f"real {real_s} MiB  {err_s}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
