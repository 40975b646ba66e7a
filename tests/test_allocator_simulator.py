"""The caching-allocator model, one rule per test, each with a hand-computed case from
the rules of PyTorch's CUDACachingAllocator.cpp (see the simulator's docstring), and the
PYTORCH_CUDA_ALLOC_CONF parser."""

from __future__ import annotations

import json

import pytest

from tailserve.errors import ConfigError
from tailserve.memory.allocator import CachingAllocatorSimulator, SimulatedOutOfMemory, parse_alloc_conf
from tailserve.memory.allocator.simulator import TraceEvent as TraceEventT
from tailserve.memory.allocator.simulator import read_jsonl_trace, simulate_trace

MiB = 1 << 20
KiB = 1 << 10


def sim(conf=None, capacity=1 << 34, fraction=None):
    return CachingAllocatorSimulator(conf, capacity, fraction)


def test_sizes_round_to_512_bytes_and_to_power_of_two_divisions():
    s = sim()
    assert [s.round_size(n) for n in (1, 512, 513, 1500)] == [512, 512, 1024, 1536]
    # 4 divisions of [1 MiB, 2 MiB): 1, 1.25, 1.5, 1.75 MiB; 1.2 MiB rounds to 1.25 MiB.
    s4 = sim("roundup_power2_divisions:4")
    assert s4.round_size(int(1.2 * MiB)) == int(1.25 * MiB) and s4.round_size(MiB + 1) == int(1.25 * MiB)
    assert s4.round_size(1 << 21) == 1 << 21  # a power of two stays
    # List form: below 256 MiB 1 division (plain 512 B rounding), from 512 MiB 2, past 1 GiB 8.
    sl = sim("roundup_power2_divisions:[256:1,512:2,>:8]")
    assert sl.round_size(300 * MiB + 1) == 300 * MiB + 512
    assert sl.round_size(600 * MiB) == 768 * MiB  # [512, 1024) in 2 divisions
    assert sl.round_size(1100 * MiB) == 1152 * MiB  # [1024, 2048) in 8 divisions of 128 MiB


def test_pool_choice_and_segment_sizes():
    def first_segment(size):
        s = sim()
        b = s.malloc(size)
        return b.small, s.stats.reserved_bytes

    assert first_segment(MiB) == (True, 2 * MiB)  # exactly 1 MiB: small pool, 2 MiB segments
    assert first_segment(MiB + 1) == (False, 20 * MiB)  # large pool; under 10 MiB: 20 MiB
    assert first_segment(10 * MiB) == (False, 10 * MiB)  # from 10 MiB: rounded up to 2 MiB
    assert first_segment(11 * MiB) == (False, 12 * MiB)
    s = sim()
    s.malloc(MiB + 1)
    s.malloc(10 * MiB)  # best fit: the first segment's 19 MiB remainder, no new segment
    assert s.stats.num_segments == 1


def test_small_pool_splits_down_to_512_bytes():
    s = sim()
    blocks = [s.malloc(512 * KiB) for _ in range(4)]  # 4 x 512 KiB fill one 2 MiB segment
    assert s.stats.reserved_bytes == 2 * MiB and s.inactive_split_bytes == 0
    s.malloc(1)  # a fifth request needs a second segment
    assert s.stats.num_segments == 2
    s.free(blocks[1])
    c = s.malloc(1024)  # best fit: the freed 512 KiB block, split (remainder >= 512 B)
    assert c.addr == blocks[1].addr and c.size == 1024 and s.stats.num_segments == 2
    d = s.malloc(512 * KiB - 1024 - 512)  # leaves exactly 512 B: still split
    assert d.size == 512 * KiB - 1536 and s.inactive_split_bytes >= 512


def test_large_pool_splits_only_below_max_split_and_with_more_than_1mib_left():
    s = sim()
    a = s.malloc(5 * MiB)  # 20 MiB segment, 15 MiB left over: split
    assert a.size == 5 * MiB and s.largest_free_block == 15 * MiB
    s2 = sim()
    big = s2.malloc(5 * MiB)
    s2.free(big)  # the whole 20 MiB segment is free again (merged)
    c = s2.malloc(19 * MiB)  # 1 MiB would be left: not more than 1 MiB, so no split
    assert c.size == 20 * MiB and s2.stats.allocated_bytes == 20 * MiB
    s3 = sim("max_split_size_mb:20")
    d = s3.malloc(5 * MiB)  # below max_split_size: still split
    assert d.size == 5 * MiB
    e = s3.malloc(30 * MiB)  # 30 MiB segment, request at/above max_split: never split
    s3.free(e)
    f = s3.malloc(29 * MiB)
    assert f.size == 30 * MiB


def test_oversize_blocks_serve_only_large_requests_within_the_rounding_limit():
    s = sim("max_split_size_mb:64")
    big = s.malloc(100 * MiB)
    s.free(big)
    x = s.malloc(30 * MiB)  # below max_split: the cached 100 MiB block is not used
    assert x.addr != big.addr and s.stats.reserved_bytes == 130 * MiB
    s.free(x)
    y = s.malloc(90 * MiB)  # 100 < 90 + 20: served whole by the oversize block
    assert y.addr == big.addr and y.size == 100 * MiB and s.stats.reserved_bytes == 130 * MiB
    s.free(y)
    z = s.malloc(70 * MiB)  # 100 >= 70 + 20: a new segment
    assert z.addr != big.addr and s.stats.reserved_bytes == 200 * MiB
    s_r = sim("max_split_size_mb:64,max_non_split_rounding_mb:40")
    big = s_r.malloc(100 * MiB)
    s_r.free(big)
    assert s_r.malloc(70 * MiB).addr == big.addr  # 100 < 70 + 40


def test_free_blocks_merge_with_free_neighbours_of_their_segment():
    s = sim()
    a, b, c = (s.malloc(4 * MiB) for _ in range(3))  # one 20 MiB segment: a | b | c | 8 MiB free
    assert s.stats.num_segments == 1 and s.inactive_split_bytes == 8 * MiB
    s.free(b)  # b alone: 4 MiB free between a and c
    assert s.inactive_split_bytes == 12 * MiB
    s.free(c)  # c merges with b and the 8 MiB tail
    assert s.largest_free_block == 16 * MiB
    s.free(a)  # the whole segment: one unsplit free block, no longer "inactive split"
    assert s.largest_free_block == 20 * MiB and s.inactive_split_bytes == 0


def test_blocks_are_never_handed_to_another_stream():
    s = sim()
    a = s.malloc(4 * MiB, stream=1)
    s.free(a)
    b = s.malloc(4 * MiB, stream=2)
    assert s.stats.num_segments == 2 and b.addr != a.addr


def test_order_of_sizes_changes_what_is_reserved():
    """Eight 16 MiB tensors, freed, then four 32 MiB ones: the freed 16 MiB segments fit no
    32 MiB request, so 8 x 16 + 4 x 32 = 256 MiB are reserved. The reverse order: each
    freed 32 MiB segment is split into two 16 MiB blocks (16 < max_split_size, 16 MiB left
    > 1 MiB), so 4 x 32 = 128 MiB suffice. Both figures follow from the segment-size and
    split rules above."""

    def run(first, second):
        s = sim()
        blocks = [s.malloc(first) for _ in range(8 if first == 16 * MiB else 4)]
        for b in blocks:
            s.free(b)
        for _ in range(4 if second == 32 * MiB else 8):
            s.malloc(second)
        return s.stats.peak_reserved_bytes

    assert run(16 * MiB, 32 * MiB) == 256 * MiB
    assert run(32 * MiB, 16 * MiB) == 128 * MiB


def test_a_miss_frees_cached_blocks_and_retries_then_runs_out():
    s = sim(capacity=100 * MiB)
    a = s.malloc(60 * MiB)
    s.free(a)  # 60 MiB cached
    b = s.malloc(70 * MiB)  # no room for a new segment: free the unsplit cached block, retry
    assert s.stats.num_alloc_retries == 1 and s.stats.reserved_bytes == 70 * MiB
    with pytest.raises(SimulatedOutOfMemory):
        s.malloc(40 * MiB)  # 70 + 40 > 100 and nothing is cached
    assert s.stats.num_ooms == 1 and b.allocated


def test_split_blocks_are_not_released_on_a_miss():
    """The fragmentation trap: a cached block whose segment is partly in use is stranded."""
    s = sim(capacity=40 * MiB)
    x = s.malloc(5 * MiB)  # 20 MiB segment: x + 15 MiB free (split)
    s.malloc(5 * MiB)  # served from the same segment
    s.free(x)
    assert s.inactive_split_bytes == 15 * MiB
    with pytest.raises(SimulatedOutOfMemory):
        s.malloc(21 * MiB)  # 20 reserved + 22 > 40, and the 15 MiB free can't be released
    assert s.stats.num_alloc_retries == 1


def test_with_max_split_size_oversize_cached_blocks_go_first_without_a_retry():
    s = sim("max_split_size_mb:32", capacity=80 * MiB)
    a = s.malloc(60 * MiB)
    s.free(a)
    # 30 MiB < max_split: the cached 60 MiB block may not serve it; 60 + 30 > 80, so the
    # oversize block is released and the new segment fits, with no retry counted.
    s.malloc(30 * MiB)
    assert s.stats.num_alloc_retries == 0 and s.stats.reserved_bytes == 30 * MiB


def test_garbage_collection_needs_a_memory_fraction():
    def cached_then_new(fraction):
        s = sim("garbage_collection_threshold:0.5", capacity=100 * MiB, fraction=fraction)
        blocks = [s.malloc(12 * MiB) for _ in range(3)]  # 36 MiB of 12 MiB segments
        for b in blocks:
            s.free(b)
        s.malloc(14 * MiB)  # a miss (no 14 MiB block)
        return s.stats.reserved_bytes

    # No fraction: the threshold does nothing; the cache keeps all three blocks.
    assert cached_then_new(None) == (36 + 14) * MiB
    # Fraction 0.6: allowed 60 MiB, GC above 30 MiB: the cached blocks (all of the same age)
    # are released until reserved is under the threshold, before the new segment.
    assert cached_then_new(0.6) == 14 * MiB


def test_garbage_collection_frees_the_oldest_blocks_first():
    s = sim("garbage_collection_threshold:0.5", capacity=100 * MiB, fraction=0.4)  # allowed 40, GC above 20
    old = s.malloc(12 * MiB)
    s.free(old)
    for _ in range(3):  # three searches of the large pool age every cached block by one
        s.free(s.malloc(2 * MiB, stream=1))  # reuses (and so rejuvenates) its own 20 MiB segment
    # A 16 MiB miss on stream 0: reserved 12 + 20 = 32 > 20, so GC runs first. Ages: the old
    # block 4, stream 1's segment 1 (reset when it was last taken); the average is 2.5, so only
    # the old block goes, which brings reserved to the threshold.
    s.malloc(16 * MiB)
    cached = {b.addr for b in s.large_pool.blocks.values()}
    assert old.addr not in cached and len(cached) == 1 and s.stats.reserved_bytes == (20 + 16) * MiB


def test_alloc_conf_parser():
    c = parse_alloc_conf("max_split_size_mb:128,garbage_collection_threshold:0.8,roundup_power2_divisions:[256:1,>:4]")
    assert c.max_split_size == 128 * MiB and c.garbage_collection_threshold == 0.8
    assert c.divisions_for(300 * MiB) == 1 and c.divisions_for(600 * MiB) == 4 and c.divisions_for(MiB) == 1
    assert parse_alloc_conf("expandable_segments:True").expandable_segments
    assert parse_alloc_conf("backend:native").other == (("backend", "native"),)
    for bad, names in [("max_split_size_mb:10", "max_split_size_mb"), ("garbage_collection_threshold:1.5",
                       "garbage_collection_threshold"), ("roundup_power2_divisions:3", "roundup_power2_divisions"),
                       ("max_split_size_mb:big", "max_split_size_mb"), ("no_such_key:1", "no_such_key"),
                       ("expandable_segments:yes", "expandable_segments"), ("max_split_size_mb", "key:value")]:
        with pytest.raises(ConfigError, match=names):
            parse_alloc_conf(bad)


# -- expandable segments ------------------------------------------------------------------------
EXP = "expandable_segments:True"


def test_expandable_segment_maps_20_mib_pages_as_it_grows():
    s = sim(EXP)
    blocks = [s.malloc(4 * MiB) for _ in range(5)]  # 5 x 4 MiB fill one 20 MiB page exactly
    assert s.stats.reserved_bytes == 20 * MiB and s.stats.num_segments == 1
    blocks.append(s.malloc(4 * MiB))  # one more page of the same segment, not a new segment
    assert s.stats.reserved_bytes == 40 * MiB and s.stats.num_segments == 1
    assert [b.addr - blocks[0].addr for b in blocks] == [i * 4 * MiB for i in range(6)]  # contiguous
    small = s.malloc(100 * KiB)  # the small pool has its own segment, mapped in 2 MiB pages
    assert s.stats.reserved_bytes == 42 * MiB and s.stats.num_segments == 2 and small.segment is not None


def test_a_freed_block_at_the_mapped_end_grows_instead_of_a_new_segment():
    """Growing tensors (100, 110, ..., 190 MiB), each freed before the next: without
    expandable segments every one needs a new segment (a cached block never grows), so all
    ten are reserved at once (1450 MiB); with them, the freed block at the end of the mapped
    range grows into new pages, and the peak is the largest tensor rounded to 20 MiB pages."""
    sizes = [(100 + 10 * i) * MiB for i in range(10)]

    def peak(conf):
        s = sim(conf)
        for n in sizes:
            s.free(s.malloc(n))
        return s.stats.peak_reserved_bytes, s.stats.num_segments

    assert peak(None) == (sum(sizes), 10)
    assert peak(EXP) == (200 * MiB, 1)


def test_best_fit_counts_the_unmapped_space_behind_a_block():
    s = sim(EXP)
    a, b, c = s.malloc(30 * MiB), s.malloc(6 * MiB), s.malloc(10 * MiB)  # one segment: [a][b][c][4 free]
    s.free(a)  # [30 free][b][c][4 free | unmapped...]
    # 4 MiB: the 4 MiB block at the end is the tighter fit by size, but it can grow into the
    # unmapped space behind it, so it counts as huge and the 30 MiB block is chosen.
    d = s.malloc(4 * MiB)
    assert d.addr == a.addr
    assert b.allocated and c.allocated


def test_every_expandable_block_splits_and_free_pages_unmap():
    s = sim(EXP)
    a = s.malloc(25 * MiB)  # two 20 MiB pages mapped; the 15 MiB left splits off (any rest >= 512 B)
    b = s.malloc(10 * MiB)  # from that rest
    assert s.stats.reserved_bytes == 40 * MiB and b.addr == a.addr + 25 * MiB
    s.free(a)
    assert s.inactive_split_bytes == 0  # left out for expandable segments, as in PyTorch
    s.empty_cache()  # a's first page is wholly free: unmapped; the second also holds b: stays
    assert s.stats.reserved_bytes == 20 * MiB
    s.free(b)
    s.empty_cache()  # nothing left: the segment goes
    assert s.stats.reserved_bytes == 0 and s.stats.num_segments == 0
    assert s.malloc(25 * MiB).segment is not None  # and a new one is made on demand


def test_expandable_mapping_runs_out_of_physical_memory_then_unmaps_and_retries():
    s = sim(EXP, capacity=100 * MiB)
    x = s.malloc(60 * MiB)
    s.free(x)  # 60 MiB mapped and free
    y = s.malloc(70 * MiB)  # the free block grows by one page: 80 MiB mapped, no retry needed
    assert s.stats.reserved_bytes == 80 * MiB and s.stats.num_alloc_retries == 0 and y.addr == x.addr
    s.malloc(10 * MiB)  # the 10 MiB left in the last page
    with pytest.raises(SimulatedOutOfMemory):
        s.malloc(40 * MiB)  # 80 + 40 > 100, and no free page to unmap
    assert s.stats.num_alloc_retries == 1


def test_trace_replay_reports_per_configuration(tmp_path):
    # The 16 -> 32 MiB sequence as a JSONL trace.
    events = [{"action": "alloc", "addr": a, "size": 16 * MiB, "stream": 0} for a in range(8)]
    events += [{"action": "free", "addr": a, "size": 16 * MiB} for a in range(8)]
    for i in range(4):
        events.append({"action": "alloc", "addr": 100 + i, "size": 32 * MiB})
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(e) for e in events))
    trace = read_jsonl_trace(path)
    r = simulate_trace(trace, None, capacity_bytes=1 << 30)
    assert (r.peak_reserved_bytes, r.peak_allocated_bytes, r.oom) == (256 * MiB, 128 * MiB, False)
    tight = simulate_trace(trace, None, capacity_bytes=200 * MiB)
    # At 200 MiB the cached 16 MiB blocks are released and retried (no OOM).
    assert not tight.oom and tight.num_alloc_retries >= 1 and tight.peak_reserved_bytes <= 200 * MiB
    tiny = simulate_trace(trace, None, capacity_bytes=100 * MiB)
    assert tiny.oom and tiny.oom_at_event == 6  # the seventh 16 MiB tensor does not fit
    (tmp_path / "bad.jsonl").write_text('{"action": "resize", "addr": 1}\n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl:1"):
        read_jsonl_trace(tmp_path / "bad.jsonl")


def test_a_malicious_snapshot_is_refused_and_runs_nothing(tmp_path):
    import pathlib
    import pickle

    from tailserve.memory.allocator.snapshot import UnsafeSnapshotError, load_snapshot

    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (pathlib.Path.touch, (marker,))

    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "x": Evil()}))
    with pytest.raises(UnsafeSnapshotError, match="pathlib"):
        load_snapshot(path)
    assert not marker.exists()


def test_snapshot_device_traces_replay_and_the_cli(tmp_path, capsys):
    import pickle

    from tailserve.cli import main

    entries = [{"action": "alloc", "addr": i, "size": 16 * MiB, "stream": 0} for i in range(8)]
    entries += [{"action": "free_requested", "addr": i, "size": 16 * MiB, "stream": 0} for i in range(8)]
    entries += [{"action": "free_completed", "addr": i, "size": 16 * MiB, "stream": 0} for i in range(8)]
    entries += [{"action": "alloc", "addr": 100 + i, "size": 32 * MiB, "stream": 0} for i in range(4)]
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [entries], "allocator_settings": {}}))
    assert main(["memory", "simulate", str(path), "--conf", "", "--conf", "max_split_size_mb:64", "--json",
                 "--capacity", "1GiB"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["peak_reserved_bytes"] for r in rows] == [256 * MiB, 256 * MiB]
    assert {"conf", "peak_reserved_bytes", "peak_allocated_bytes", "num_alloc_retries", "oom", "oom_at_event"} <= \
        rows[0].keys()
    assert main(["memory", "simulate", str(path), "--conf", "max_split_size_mb:5"]) == 2  # one-line error
    assert "max_split_size_mb must be >= 20" in capsys.readouterr().err
    assert main(["memory", "simulate", str(path)]) == 0 and "default" in capsys.readouterr().out


def test_the_gpu_comparison_script_predicts_without_a_gpu(tmp_path):
    import subprocess
    import sys

    root = __import__("pathlib").Path(__file__).resolve().parents[1]
    out = tmp_path / "check.json"
    r = subprocess.run([sys.executable, str(root / "benchmarks" / "allocator_check.py"), "--simulate-only", "--json",
                        str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())
    order = [x for x in rows if x["trace"] == "order"]
    assert order and all(x["predicted_peak_reserved_bytes"] == (140 if "expandable" in x["conf"] else 256) * MiB
                         for x in order)  # expandable: 128 MiB of tensors in 7 pages of 20 MiB
    assert all(x["real_peak_reserved_bytes"] is None for x in rows)


def test_recommend_picks_the_setting_that_fits_and_says_why(tmp_path, capsys):
    from tailserve.cli import main
    from tailserve.memory.allocator.simulator import TraceEvent, recommend

    # 100 MiB tensors alternate with 30 MiB ones that outlive them: by default each freed
    # 100 MiB segment is split for the next 30 MiB tensor, and the next 100 MiB one needs a
    # new segment; max_split_size keeps the 100 MiB blocks whole for the 100 MiB requests.
    # Expandable segments do better still: each 100 MiB tensor grows the free block at the
    # end of the mapped range, so 250 MiB of tensors need 260 MiB (13 pages of 20 MiB).
    ev, addr = [], 0
    for _ in range(6):
        ev += [TraceEvent("alloc", addr, 100 * MiB), TraceEvent("free", addr, 0),
               TraceEvent("alloc", addr + 1, 30 * MiB)]
        addr += 2
    ranked, why = recommend(ev, capacity_bytes=1 << 40)
    default = next(r for r in ranked if r.conf == "default")
    assert ranked[0].conf == "expandable_segments:True" and ranked[0].peak_reserved_bytes == 260 * MiB
    classic = [r for r in ranked if "expandable" not in r.conf]
    assert classic[0].peak_reserved_bytes < default.peak_reserved_bytes and "max_split_size_mb" in classic[0].conf
    assert why.startswith("use PYTORCH_CUDA_ALLOC_CONF=") and "less than the default" in why
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps({"action": e.action, "addr": e.addr, "size": e.size}) for e in ev))
    assert main(["memory", "recommend", str(path), "--capacity", "1024GiB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["recommendation"] == ranked[0].conf and out["why"] == why


def test_fragmentation_is_reported_at_the_peak_and_above_the_alert_floor(tmp_path, capsys):
    from tailserve.cli import main

    # Small tensors in a 2 MiB small-pool segment (stranded ~100% of a nearly empty segment),
    # then a 16 MiB segment cached and reused split by a 4 MiB tensor: 12 MiB stranded.
    events = [TraceEventT("alloc", 10 + i, 512) for i in range(3)]
    events += [TraceEventT("alloc", 1, 16 * MiB), TraceEventT("free", 1, 16 * MiB), TraceEventT("alloc", 2, 4 * MiB)]
    events += [TraceEventT("alloc", 20 + i, 512) for i in range(2)]
    r = simulate_trace(events, "", 1 << 30)
    assert r.peak_reserved_bytes == 18 * MiB
    assert 0.7 < r.stranded_at_peak < 0.85  # (12 MiB + ~2 MiB) of 18 MiB
    assert r.max_inactive_split_over_reserved > 0.99  # the 2 MiB segment alone read as ~100% before
    assert (r.max_stranded_above_floor, r.alert_fires) == (0.0, False)  # 18 MiB never reaches the 1 GiB floor
    low = simulate_trace(events, "", 1 << 30, alert_min_reserved_bytes=8 * MiB)
    assert low.alert_fires and low.max_stranded_above_floor == pytest.approx(low.stranded_at_peak, abs=1e-3)
    two = simulate_trace(events[:7], "", 1 << 30, alert_min_reserved_bytes=8 * MiB)
    assert not two.alert_fires  # above the threshold for two evaluations only: the monitor needs three

    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps({"action": e.action, "addr": e.addr, "size": e.size}) for e in events))
    long_conf = "max_split_size_mb:128,garbage_collection_threshold:0.8,roundup_power2_divisions:4"
    assert main(["memory", "simulate", str(path), "--conf", "", "--conf", long_conf,
                 "--memory-fraction", "0.9"]) == 0
    out = capsys.readouterr().out
    assert long_conf in out and "stranded at peak" in out and "below floor" in out and "fires" not in out
    assert main(["memory", "simulate", str(path), "--alert-min-reserved", "8MiB"]) == 0
    row = capsys.readouterr().out.splitlines()[-1]
    assert row.startswith("default") and "fires" in row


def test_equal_size_free_blocks_go_lowest_address_first_and_new_segments_lie_below():
    # Two 20 MiB requests, each its own segment; freed, either fits the next one: the second
    # segment lies below the first (as cudaMalloc placed them on an H200), so its block is taken.
    sim = CachingAllocatorSimulator("", capacity_bytes=1 << 34)
    first, second = sim.malloc(20 << 20), sim.malloc(20 << 20)
    assert second.addr < first.addr
    sim.free(first)
    sim.free(second)
    assert sim.malloc(20 << 20) is second


# Peak reserved bytes of PyTorch's real allocator (torch 2.11, CUDA 13) on an H200, 2026-12-04,
# replaying benchmarks/allocator_check.py's traces under each setting (MiB).
H200_PEAK_RESERVED_MIB = {
    ("order", ""): 256, ("order", "max_split_size_mb:128"): 256, ("order", "roundup_power2_divisions:4"): 256,
    ("order", "max_split_size_mb:64,roundup_power2_divisions:8"): 256, ("order", "expandable_segments:True"): 140,
    ("kv_like", ""): 1084, ("kv_like", "max_split_size_mb:128"): 1084, ("kv_like", "roundup_power2_divisions:4"): 1198,
    ("kv_like", "max_split_size_mb:64,roundup_power2_divisions:8"): 1120,
    ("kv_like", "expandable_segments:True"): 1060,
    ("mixed", ""): 416, ("mixed", "max_split_size_mb:128"): 416, ("mixed", "roundup_power2_divisions:4"): 366,
    ("mixed", "max_split_size_mb:64,roundup_power2_divisions:8"): 458, ("mixed", "expandable_segments:True"): 266,
}


def test_the_model_predicts_the_h200s_peak_on_every_allocator_check_pair():
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
    import allocator_check

    assert {(t, c) for t in allocator_check.TRACES for c in allocator_check.CONFS} == set(H200_PEAK_RESERVED_MIB)
    for (trace, conf), want in H200_PEAK_RESERVED_MIB.items():
        got = simulate_trace(allocator_check.TRACES[trace](), conf, capacity_bytes=1 << 40).peak_reserved_bytes
        assert got == want << 20, (trace, conf, got >> 20, want)
