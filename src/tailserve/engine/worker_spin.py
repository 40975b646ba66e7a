"""How long the CPU's OpenMP worker threads spin after a parallel region before they sleep.

PyTorch's x86 Linux wheels use GNU OpenMP (libgomp), and so do tailserve's compiled kernels
(they link the same library). After each parallel region a worker waits for the next one by
spinning 300,000 times (``GOMP_SPINCOUNT``'s default when ``OMP_WAIT_POLICY`` is unset), ~11
ms on an AMD EPYC (Zen 3) core, before it sleeps on a futex. Offline, steps run back to back
and the spin only saves wake-ups. A server runs HTTP work between steps on the main thread,
and its clients need a core too: with the worker spinning through every gap, each streamed
chunk's socket write took ~200 us at one stream and ~90 us at sixteen (the write wakes the
reader while both cores are taken), against ~55 and ~15 us with a spin of ~0.7 ms. Measured
on 2 AVX2 cores under ``vllm bench serve`` (55M Llama, docs/benchmarks.md, session 32): the
time between steps fell from 0.24-0.29 to 0.13-0.15 ms a token at one stream, and from 2.1-2.3
to 0.66-0.75 ms a step at sixteen, where output throughput rose from 877-919 to 967-1,022
tok/s. Within a step the regions follow each other by microseconds, so a spin that ends after
~0.7 ms still never sleeps between them (the steps measured the same).

So ``tailserve serve`` sets ``GOMP_SPINCOUNT`` to ``SERVE_SPIN_COUNT`` before PyTorch loads
(libgomp reads it once, when it loads), unless the user chose ``GOMP_SPINCOUNT`` or
``OMP_WAIT_POLICY`` themselves; a Ray Serve replica (integrations/ray_serve.py) gets it in its
actor's ``runtime_env``, which Ray sets before the actor's process starts. The offline API
leaves the environment alone. This module imports nothing heavy: it runs before torch is
imported.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

SERVE_SPIN_COUNT = 20_000  # ~0.7 ms of spinning on a Zen 3 core (~37 ns a spin)
LIBGOMP_DEFAULT = 300_000

_decided: tuple[str, str] | None = None  # (spin, reason) once ``limit_for_serving`` ran here


def _users_choice(env: MutableMapping[str, str]) -> tuple[str, str] | None:
    """The wait the user set (``GOMP_SPINCOUNT``, else ``OMP_WAIT_POLICY``), if any."""
    if "GOMP_SPINCOUNT" in env:
        return env["GOMP_SPINCOUNT"], "GOMP_SPINCOUNT as set"
    if "OMP_WAIT_POLICY" in env:
        return f"OMP_WAIT_POLICY={env['OMP_WAIT_POLICY']}", "as set"
    return None


def limit_for_serving(env: MutableMapping[str, str] | None = None, torch_loaded: bool | None = None) -> tuple[str, str]:
    """Set ``GOMP_SPINCOUNT`` for a server unless the user chose the wait themselves, or it
    is too late (torch, and with it libgomp, already loaded in this process). Returns what
    applies and why, as the plan reports it."""
    global _decided
    real = env is None
    env = os.environ if env is None else env
    loaded = "torch" in sys.modules if torch_loaded is None else torch_loaded
    out = _users_choice(env)
    if out is None and loaded:
        out = (str(LIBGOMP_DEFAULT), "libgomp's default: torch was loaded before the server could set GOMP_SPINCOUNT")
    elif out is None:
        env["GOMP_SPINCOUNT"] = str(SERVE_SPIN_COUNT)
        out = (str(SERVE_SPIN_COUNT), "tailserve serve: workers sleep soon after a step, leaving the core to the "
                                      "HTTP work and the clients between steps")
    if real:  # this process's own decision (a mapping passed in is a what-if)
        _decided = out
    return out


def serving_env(env: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """The variables a server process started by someone else (a Ray Serve replica's actor)
    should start with: ``GOMP_SPINCOUNT`` for serving, or nothing where the user chose the wait
    (in ``env``, this process's environment by default, which Ray hands on to its workers)."""
    env = os.environ if env is None else env
    return {} if _users_choice(env) is not None else {"GOMP_SPINCOUNT": str(SERVE_SPIN_COUNT)}


def current(env: MutableMapping[str, str] | None = None) -> tuple[str, str]:
    """The spin in effect in this process and why (the plan's ``cpu_worker_spin``)."""
    if _decided is not None:
        return _decided
    return _users_choice(os.environ if env is None else env) or (
        str(LIBGOMP_DEFAULT), "libgomp's default: steps run back to back offline")
