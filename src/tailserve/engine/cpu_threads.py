"""Sizes the CPU intra-op thread pool to the cores other processes leave free.

A decode step splits each matrix product across the OpenMP threads and waits for the last
one. When another process takes a core, the thread that shares it runs a fraction of the time,
and every product waits for it: on 2 AVX-512 cores, batch-1 decode beside one busy Python loop
fell from 107 to 28 tok/s with 2 threads, while 1 thread ran at 92 tok/s alone and beside it
(benchmarks/bench_busy_core.py, docs/benchmarks.md). So the governor measures, every
``interval_s``, how much CPU time processes other than this one took on the CPUs this process
may run on (``/proc/stat``'s per-CPU busy time minus this process's own CPU time), and runs
with as many threads as cores remain: one fewer as soon as another process takes more than
half a core, one more again once that core is free: at once when under a quarter of it is
taken, after two intervals in a row when it is between a quarter and a half. A window in which
the engine ran no steps for a while (idle) decides nothing.

It runs on the thread that executes the engine steps (``torch.set_num_threads`` and the
compiled kernels' thread count are per calling thread under OpenMP). On by default for a CPU
engine with more than one thread (``EngineConfig.cpu_threads_adapt``; the environment variable
``TAILSERVE_CPU_THREADS_ADAPT=0`` turns the default off); where ``/proc/stat`` cannot be read
it stays off and says so.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence

import torch

log = logging.getLogger("tailserve.engine")
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user nice system irq softirq steal (not idle, iowait)


def proc_stat_busy_s(cpus: Sequence[int], path: str = "/proc/stat") -> float:
    """Busy seconds so far, summed over ``cpus`` (all processes)."""
    want = {f"cpu{c}" for c in cpus}
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    with open(path) as f:
        for line in f:
            name, _, rest = line.partition(" ")
            if name in want:
                fields = rest.split()
                total += sum(int(fields[i]) for i in _BUSY_FIELDS if i < len(fields))
    return total / tick


class ThreadGovernor:
    def __init__(self, max_threads: int, cpus: Sequence[int], interval_s: float = 0.25,
                 read_busy_s: Callable[[], float] | None = None,
                 read_self_s: Callable[[], float] = time.process_time,
                 clock: Callable[[], float] = time.monotonic,
                 set_threads: Callable[[int], None] = torch.set_num_threads,
                 get_threads: Callable[[], int] = torch.get_num_threads) -> None:
        self.max_threads = max(1, max_threads)
        self.num_cpus = len(cpus)
        self.interval_s = interval_s
        self._read_busy = read_busy_s or (lambda: proc_stat_busy_s(cpus))
        self._read_self, self._clock = read_self_s, clock
        self._set, self._get = set_threads, get_threads
        self.threads = self.max_threads
        self.other_cores = 0.0  # the last interval's CPU taken by other processes, in cores
        self.num_changes = 0
        self._room = 0  # consecutive intervals that had room for one more thread
        self._t, self._busy, self._self = clock(), self._read_busy(), read_self_s()

    def on_step(self) -> None:
        """Before an engine step: re-measure when an interval has passed; apply the count."""
        now = self._clock()
        dt = now - self._t
        if dt >= self.interval_s:
            busy, own = self._read_busy(), self._read_self()
            other = max(0.0, (busy - self._busy) - (own - self._self)) / dt
            self._t, self._busy, self._self = now, busy, own
            if dt <= 4 * self.interval_s:
                self.other_cores = other
                self._decide()
            # else: the engine was idle for most of that window (no steps): what others did then
            # says little about now, so the next interval decides.
        if self._get() != self.threads:
            self._set(self.threads)

    def _decide(self) -> None:
        # Cores left for this process: a core counts as taken once another process uses more
        # than half of it (then the thread sharing it is the one every product waits for).
        free = max(1, min(self.max_threads, int(self.num_cpus - self.other_cores + 0.5)))
        if free < self.threads:
            self.threads, self._room = free, 0
            self.num_changes += 1
            log.info("CPU threads: %d (other processes took %.1f cores)", self.threads, self.other_cores)
        elif free > self.threads:
            # A core clearly free again (under a quarter taken) is taken back at once; a
            # borderline one after two intervals in a row, so the count does not flap.
            self._room += 2 if self.other_cores < self.num_cpus - self.threads - 0.75 else 1
            if self._room >= 2:
                self.threads, self._room = self.threads + 1, 0
                self.num_changes += 1
                log.info("CPU threads: %d (cores free again)", self.threads)
        else:
            self._room = 0


def make_governor(max_threads: int) -> ThreadGovernor | None:
    """A governor over the CPUs this process may use, or None where /proc/stat is unreadable
    or there is one thread to size."""
    if max_threads <= 1:
        return None
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    try:
        proc_stat_busy_s(cpus)
    except (OSError, ValueError) as e:
        log.info("CPU threads: fixed at %d (cannot read /proc/stat: %s)", max_threads, e)
        return None
    return ThreadGovernor(max_threads, cpus)
