"""The CPU thread governor: one thread fewer while another process takes a core, one more
after two intervals with it free; driven by scripted CPU readings, then by a real busy process
against the real /proc/stat."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest

from tailserve.engine.cpu_threads import ThreadGovernor, make_governor, proc_stat_busy_s


class Machine:
    """Scripted clocks: each interval, how many cores other processes used and this one."""

    def __init__(self) -> None:
        self.t = self.busy = self.own = 0.0
        self.threads = 2

    def advance(self, other_cores: float, own_cores: float = 2.0, dt: float = 0.5) -> None:
        self.t += dt
        self.busy += (other_cores + own_cores) * dt
        self.own += own_cores * dt

    def governor(self) -> ThreadGovernor:
        return ThreadGovernor(2, [0, 1], 0.5, read_busy_s=lambda: self.busy, read_self_s=lambda: self.own,
                              clock=lambda: self.t, set_threads=self._set, get_threads=lambda: self.threads)

    def _set(self, n: int) -> None:
        self.threads = n


def test_governor_gives_up_a_taken_core_at_once_and_takes_it_back_once_free():
    m = Machine()
    g = m.governor()
    m.advance(0.1)
    g.on_step()
    assert m.threads == 2  # a tenth of a core elsewhere: not worth a thread
    m.advance(0.7, own_cores=1.3)
    g.on_step()
    assert m.threads == 1 and g.other_cores == pytest.approx(0.7)
    m.advance(1.0, own_cores=1.0)
    g.on_step()
    assert m.threads == 1  # still taken
    m.advance(0.4, own_cores=1.0)
    g.on_step()
    assert m.threads == 1  # 0.4 of a core taken: borderline, one interval is not enough
    m.advance(0.4, own_cores=1.0)
    g.on_step()
    assert m.threads == 2 and g.num_changes == 2
    m.advance(0.9, own_cores=1.1)
    g.on_step()
    m.advance(0.0, own_cores=1.0)
    g.on_step()
    assert m.threads == 2 and g.num_changes == 4  # clearly free: taken back at once


def test_a_window_of_idle_engine_decides_nothing():
    m = Machine()
    g = m.governor()
    m.advance(1.0, own_cores=0.0, dt=3.0)  # no steps for 3 s while another process ran
    g.on_step()
    assert m.threads == 2 and g.num_changes == 0
    m.advance(1.0, own_cores=1.0)  # a normal interval with it running decides
    g.on_step()
    assert m.threads == 1


def test_governor_measures_only_once_per_interval_and_reapplies_its_count():
    m = Machine()
    g = m.governor()
    m.advance(1.0, own_cores=1.0, dt=0.2)  # not an interval yet
    g.on_step()
    assert m.threads == 2 and g.num_changes == 0
    m.threads = 4  # something else set the pool (another library): the governor's count wins
    g.on_step()
    assert m.threads == 2


def test_one_thread_has_nothing_to_size():
    assert make_governor(1) is None


def _spin(stop) -> None:
    while not stop.is_set():
        pass


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs /proc/stat")
def test_governor_sees_a_real_busy_process():
    cpus = sorted(os.sched_getaffinity(0))
    busy = proc_stat_busy_s(cpus)
    assert busy > 0
    applied = []
    g = ThreadGovernor(len(cpus) + 1, cpus, interval_s=0.3, set_threads=applied.append, get_threads=lambda: -1)
    stop = mp.Event()
    proc = mp.Process(target=_spin, args=(stop,), daemon=True)
    proc.start()
    try:
        time.sleep(0.35)
        g.on_step()
    finally:
        stop.set()
        proc.join(5)
    # the spinning process took (nearly) a core: at least 0.5 of one is seen, so the pool shrinks
    assert g.other_cores > 0.5 and g.threads <= len(cpus) - 1
    assert applied[-1] == g.threads
