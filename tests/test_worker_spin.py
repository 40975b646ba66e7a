"""libgomp's spin after a parallel region: ``tailserve serve`` shortens it before torch loads
(engine/worker_spin.py), the user's own setting wins, and the plan reports what applies."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from tailserve.engine import worker_spin

# A subprocess: runs 40 small parallel regions 15 ms apart on 2 threads and prints the CPU
# seconds the worker threads (every thread but the main one) took meanwhile. libgomp's
# default spin (300,000 spins after each region) is ~11 ms on a Zen 3 core and ~3.5 ms on a
# Sapphire Rapids one, so 0.14-0.45 s; the server's (20,000 spins) a fifteenth of that. The
# count is of spins, not time: a busy machine stretches the spin's wall time, not its CPU
# time; and /proc counts in ticks of 10 ms, hence 40 regions.
_PROBE = """
import os, sys, time
from tailserve.engine import worker_spin
if sys.argv[1] == "serve":
    worker_spin.limit_for_serving()
import torch
torch.set_num_threads(2)
x = torch.randn(256, 256)
for _ in range(5):
    torch.mm(x, x)
me = str(os.getpid())
def workers_s():
    tick, total = os.sysconf("SC_CLK_TCK"), 0
    for t in os.listdir("/proc/self/task"):
        if t != me:
            f = open(f"/proc/self/task/{t}/stat").read().rsplit(")", 1)[1].split()
            total += int(f[11]) + int(f[12])
    return total / tick
time.sleep(0.05)
c0 = workers_s()
for _ in range(40):
    torch.mm(x, x)
    time.sleep(0.015)
print(workers_s() - c0)
"""


def test_the_server_sets_the_spin_unless_the_user_chose_the_wait():
    env: dict[str, str] = {}
    spin, why = worker_spin.limit_for_serving(env, torch_loaded=False)
    assert env == {"GOMP_SPINCOUNT": str(worker_spin.SERVE_SPIN_COUNT)}
    assert spin == str(worker_spin.SERVE_SPIN_COUNT) and why.startswith("tailserve serve")

    env = {"GOMP_SPINCOUNT": "300"}
    assert worker_spin.limit_for_serving(env, torch_loaded=False) == ("300", "GOMP_SPINCOUNT as set")
    env = {"OMP_WAIT_POLICY": "active"}
    assert worker_spin.limit_for_serving(env, torch_loaded=False)[0] == "OMP_WAIT_POLICY=active"
    assert env == {"OMP_WAIT_POLICY": "active"}

    env = {}
    spin, why = worker_spin.limit_for_serving(env, torch_loaded=True)  # libgomp read its settings already
    assert env == {} and spin == str(worker_spin.LIBGOMP_DEFAULT) and "torch was loaded" in why


@pytest.mark.skipif((os.cpu_count() or 1) < 2 or not os.path.isdir("/proc/self/task"),
                    reason="needs 2 cores and Linux /proc")
def test_after_the_limit_the_workers_sleep_between_steps_and_by_default_they_spin():
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "OMP_NUM_THREADS")}

    def workers_cpu_s(mode: str) -> float:
        out = subprocess.run([sys.executable, "-c", _PROBE, mode], env=env, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        return float(out.stdout.strip().splitlines()[-1])

    served, offline = workers_cpu_s("serve"), workers_cpu_s("offline")
    assert offline > 0.08, f"libgomp's default spin took only {offline:.3f} s: the probe no longer measures it"
    assert served < offline / 4, f"workers took {served:.3f} s of CPU over 40 idle gaps under the server's " \
                                 f"limit, against {offline:.3f} s by default"


def test_the_served_plan_reports_the_spin(tiny_server):
    plan = httpx.get(tiny_server.url + "/health", timeout=30).json()["plan"]
    if "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ:
        assert plan["cpu_worker_spin"].endswith("as set)")
    else:
        assert plan["cpu_worker_spin"].startswith(f"{worker_spin.SERVE_SPIN_COUNT} (tailserve serve: ")
