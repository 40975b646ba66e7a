"""The allocator monitor, fed recorded memory_stats() sequences (the one place a stand-in
is right: CUDA does not exist here): the measures, the floor, hysteresis, one log line per
episode, /health and Prometheus."""

from __future__ import annotations

import logging

import pytest

from tailserve import LLM, SamplingParams
from tailserve.memory.allocator.monitor import AllocatorMonitor, AllocatorSample

GiB = 1 << 30


def stats(reserved, allocated, inactive_split, active=None, peak_active=None, peak_reserved=None, retries=0):
    active = allocated if active is None else active
    return {"reserved_bytes.all.current": reserved, "allocated_bytes.all.current": allocated,
            "active_bytes.all.current": active, "inactive_split_bytes.all.current": inactive_split,
            "requested_bytes.all.current": allocated, "active_bytes.all.peak": peak_active or active,
            "reserved_bytes.all.peak": peak_reserved or reserved, "num_alloc_retries": retries, "num_ooms": 0}


class Recorded:
    def __init__(self, seq):
        self.seq, self.i = seq, 0

    def __call__(self):
        s = self.seq[min(self.i, len(self.seq) - 1)]
        self.i += 1
        return s


def test_the_three_measures():
    s = AllocatorSample.from_memory_stats(stats(10 * GiB, 6 * GiB, 3 * GiB, active=7 * GiB, peak_active=8 * GiB,
                                                peak_reserved=12 * GiB))
    assert s.inactive_split_over_reserved == 0.3 and s.unallocated_over_reserved == 0.4
    assert abs(s.one_minus_peak_ratio - (1 - 8 / 12)) < 1e-12


def test_one_episode_one_log_line_with_hysteresis(caplog):
    frag, ok = stats(10 * GiB, 5 * GiB, 4 * GiB), stats(10 * GiB, 8 * GiB, 1 * GiB)
    # Above, above (not yet: 3 needed), above -> episode; a dip of one sample does not end it;
    # three samples below end it; a second rise is a second episode.
    seq = [frag, frag, ok, frag, frag, frag, ok, frag, frag, ok, ok, ok, frag, frag, frag]
    mon = AllocatorMonitor(Recorded(seq), threshold=0.30, trigger_samples=3, clear_samples=3)
    states = []
    with caplog.at_level(logging.WARNING, logger="tailserve.memory"):
        for _ in seq:
            mon.sample()
            states.append(mon.alerting)
    assert states == [False, False, False, False, False, True, True, True, True, True, True, False, False, False,
                      True]
    assert mon.num_episodes == 2
    lines = [r for r in caplog.records if "fragmentation" in r.getMessage()]
    assert len(lines) == 2 and "40%" in lines[0].getMessage()


def test_an_idle_process_below_the_floor_never_alarms():
    tiny = stats(64 << 20, 1 << 20, 60 << 20)  # 94% stranded, but only 64 MiB reserved
    mon = AllocatorMonitor(Recorded([tiny] * 10), min_reserved_bytes=1 << 30, trigger_samples=2)
    for _ in range(10):
        mon.sample()
    assert not mon.alerting and mon.num_episodes == 0 and mon.health() == {"status": "ok"}


def test_samples_every_n_steps_or_t_seconds():
    t = [0.0]
    src = Recorded([stats(GiB, GiB, 0)])
    mon = AllocatorMonitor(src, every_steps=10, every_s=5.0, clock=lambda: t[0])
    taken = [mon.maybe_sample(step) is not None for step in range(1, 25)]
    # The first call samples (nothing yet), then every 10th step.
    assert [i + 1 for i, x in enumerate(taken) if x] == [1, 10, 20]
    t[0] = 6.0
    assert mon.maybe_sample(21) is not None  # 5 s passed


@pytest.mark.parametrize("metrics", [True, False])
def test_engine_health_and_metrics(llama_checkpoint, metrics):
    path, _ = llama_checkpoint
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=4 << 20, enable_metrics=metrics)
    assert llm.engine.allocator_monitor is None  # no CUDA: nothing to sample by default
    frag = stats(10 * GiB, 5 * GiB, 4 * GiB)
    llm.engine.attach_allocator_monitor(AllocatorMonitor(Recorded([frag] * 100), every_steps=1, trigger_samples=3))
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    h = llm.engine.health()
    assert h["status"] == "degraded" and "stranded in split blocks" in h["reason"]
    assert h["cuda_memory"]["inactive_split_over_reserved"] == 0.4 and h["cuda_memory"]["num_episodes"] == 1
    if metrics:
        text = llm.engine.metrics_exposition().decode()
        assert 'tailserve:cuda_memory_inactive_split_over_reserved{model_name="llama0"} 0.4' in text
        assert 'tailserve:cuda_memory_fragmentation_episodes_total{model_name="llama0"} 1.0' in text
