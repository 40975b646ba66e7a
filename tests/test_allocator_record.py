"""The engine's own allocation trace, recorded on the CPU and replayed through the model of
the caching allocator."""

from __future__ import annotations

from tailserve import LLM, SamplingParams
from tailserve.cli import main
from tailserve.memory.allocator.record import events_from_chrome_trace, record_generation_trace
from tailserve.memory.allocator.simulator import read_jsonl_trace, simulate_trace


def test_chrome_trace_memory_events_become_alloc_and_free():
    ev = lambda ts, addr, b: {"name": "[memory]", "ts": ts, "args": {"Addr": addr, "Bytes": b}}  # noqa: E731
    trace = {"traceEvents": [ev(3, 10, -64), ev(1, 5, 128), {"name": "aten::mm", "ts": 2}, ev(2, 5, -128),
                             ev(4, 7, 32)]}
    got = [(e.action, e.addr, e.size) for e in events_from_chrome_trace(trace)]
    assert got == [("alloc", 5, 128), ("free", 5, 128), ("alloc", 7, 32)]  # addr 10 was never allocated here


def test_a_recorded_generation_trace_replays_through_the_allocator_model(llama_checkpoint):
    path, _ = llama_checkpoint
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=2 << 20)
    events = record_generation_trace(llm, [[5, 6, 7, 8] * 8, [9, 10] * 12], SamplingParams(max_tokens=4,
                                                                                           ignore_eos=True))
    allocs = [e for e in events if e.action == "alloc"]
    assert len(allocs) > 50 and len(events) - len(allocs) <= len(allocs)
    live: dict[int, int] = {}
    for e in events:  # every free matches a live allocation of the same size
        if e.action == "alloc":
            live[e.addr] = e.size
        else:
            assert live.pop(e.addr) == e.size
    r = simulate_trace(events, "", 1 << 30)
    assert not r.oom and 0 < r.peak_allocated_bytes <= r.peak_reserved_bytes


def test_memory_record_command(llama_checkpoint, tmp_path, capsys):
    path, _ = llama_checkpoint
    out = tmp_path / "trace.jsonl"
    assert main(["memory", "record", "--out", str(out), "--model", str(path), "--dtype", "float32",
                 "--kv-cache-memory", "2MiB", "--num-prompts", "2", "--input-len", "24", "--max-tokens", "3"]) == 0
    assert "allocations" in capsys.readouterr().out
    assert len(read_jsonl_trace(out)) > 50


def test_the_profilers_own_log_lines_are_held_back_and_other_stderr_kept(capfd):
    import os

    from tailserve.memory.allocator.record import _quiet_profiler_log

    with _quiet_profiler_log():
        os.write(2, b"USDT:2026-12-03 15:53:08 3225:3225 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"a real warning\n")
    err = capfd.readouterr().err
    assert "profiler_start" not in err and "a real warning" in err
