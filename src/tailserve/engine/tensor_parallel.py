"""Tensor parallelism: the target model split over ``tensor_parallel_size`` processes.

Rank 0 is the engine's own process: it schedules, and runs a ``Worker`` like any other
rank. Ranks 1..N-1 are worker processes (from a fork server, ``_mp_context``), each with
its own ``Worker`` built with its ``TensorParallel`` place: it loads only its slices of the checkpoint (column-parallel
QKV and gate/up, row-parallel o/down with an all-reduce, the vocabulary-parallel LM head
with an all-gather; the embedding and the norms are replicated) and holds only its KV heads.

Every step, rank 0 sends the ``SchedulerOutput`` to each worker over a pipe, then executes
it itself; all ranks run the same runner code on the same data, so they meet in the same
collectives in the same order. After the all-gather every rank has the same logits, so
every rank samples the same tokens (the generators are seeded alike, and every rank uses
the same number of threads so that its replicated arithmetic rounds alike); each worker
returns its sampled token ids and rank 0 checks them against its own, so a divergence is an
error, never silent.

The draft model (speculative decoding) is replicated: each rank runs the whole draft, with
no collective. It is small, so this costs each rank little; a draft on rank 0 alone would
have to broadcast its proposals and their probabilities to the others every step.

A worker that dies (or fails) takes the engine down: the collective rank 0 is in fails
when the peer's sockets close (and times out otherwise), the pipe reports the death, and
``EngineDeadError`` names the rank. A watcher thread notices a death between steps too.
Workers exit when rank 0's end of their pipe closes, so none outlives the engine.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import multiprocessing as mp
import os
import socket
import threading
import traceback
import weakref
from multiprocessing.connection import Connection, wait

import torch

from tailserve.config import EngineConfig
from tailserve.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from tailserve.engine.worker import Worker
from tailserve.errors import EngineDeadError, TailserveError
from tailserve.model.linear import TensorParallel

log = logging.getLogger("tailserve.engine")

# A collective waiting longer than this for a peer fails (a peer that hangs rather than dies).
COLLECTIVE_TIMEOUT_S = 120.0
START_TIMEOUT_S = 600.0  # a worker's start-up: imports and loading its slices


def threads_per_rank(size: int) -> int:
    """Intra-op threads for each rank on the CPU: the cores shared out (OMP_NUM_THREADS, when
    set, is the per-rank count). Equal on every rank, so replicated work rounds alike."""
    env = os.environ.get("OMP_NUM_THREADS")
    if env and env.isdigit() and int(env) > 0:
        return int(env)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, cores // size)


def _init_group(rank: int, size: int, port: int, device_type: str) -> None:
    torch.distributed.init_process_group(
        "nccl" if device_type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
        world_size=size, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_main(config: EngineConfig, rank: int, size: int, port: int, conn: Connection, threads: int) -> None:
    """A worker process: join the group, build this rank's worker, then execute what rank 0
    sends until it says stop or its pipe closes."""
    device_type = torch.device(config.device).type
    try:
        if device_type == "cpu":
            torch.set_num_threads(threads)
        _init_group(rank, size, port, device_type)
        worker = Worker(config, TensorParallel(size, rank))
    except BaseException as e:  # reported to rank 0, which raises it
        conn.send(("error", f"rank {rank} failed to start: {type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            kind, payload = conn.recv()
        except (EOFError, OSError):
            break  # the engine is gone
        if kind == "stop":
            break
        try:
            if kind == "execute":
                out = worker.execute(payload)
                conn.send(("ok", out.sampled_token_ids))
            elif kind == "free":
                worker.free(payload)
            elif kind == "warm_up":
                worker.warm_up(*payload)
                conn.send(("ok", {}))
        except BaseException as e:  # the group is unusable now: report and exit
            conn.send(("error", f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}"))
            os._exit(1)  # closes this rank's sockets, so rank 0's pending collective fails fast
    torch.distributed.destroy_process_group()


def _mp_context() -> mp.context.BaseContext:
    """Worker processes come from a fork server that has imported the worker's modules (torch
    included) once, where the platform has one: a rank then starts in about 2 s instead of
    the 5 s of a fresh interpreter (``spawn``, the fallback). The fork server never touches
    CUDA, so its children initialise CUDA themselves, as spawned ones do. It is started with
    the first tensor-parallel engine of a process and keeps that moment's environment. The
    ranks' exit is watched through it: should the fork server itself be killed, the engine
    reports the ranks dead (exit code 255) and goes down, as it does for a dead rank."""
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["tailserve.engine.worker"])
        return ctx
    return mp.get_context("spawn")


def _stop_processes(procs: list[mp.process.BaseProcess], conns: list[Connection]) -> None:
    for c in conns:
        with contextlib.suppress(OSError, ValueError):  # already closed, or the worker is gone
            c.send(("stop", None))
        c.close()
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)


class TensorParallelExecutor:
    """Rank 0's worker plus the processes of the other ranks, behind the ``ModelExecutor``
    seam the engine core uses (``local`` is rank 0's in-process worker)."""

    def __init__(self, config: EngineConfig) -> None:
        size = config.tensor_parallel_size
        self.size = size
        device_type = torch.device(config.device).type
        threads = threads_per_rank(size)
        port = _free_port()
        ctx = _mp_context()
        self._procs: list[mp.process.BaseProcess] = []
        self._conns: list[Connection] = []
        self._dead: str | None = None
        for rank in range(1, size):
            ours, theirs = ctx.Pipe()
            p = ctx.Process(target=_worker_main, args=(config, rank, size, port, theirs, threads),
                            name=f"tailserve-tp-rank{rank}", daemon=True)
            p.start()
            theirs.close()
            self._procs.append(p)
            self._conns.append(ours)
        # Whatever happens from here on, no worker process outlives this object.
        self._finalizer = weakref.finalize(self, _stop_processes, self._procs, self._conns)
        try:
            if device_type == "cpu":
                torch.set_num_threads(threads)
            _init_group(0, size, port, device_type)
            self.local = Worker(config, TensorParallel(size, 0))
            # Rank 0's description: the same on every rank, except what is per rank by design
            # (the KV heads it holds, so its bytes per block).
            self.info = self.local.info
            for rank, conn in enumerate(self._conns, start=1):
                kind, msg = self._recv(rank, conn, START_TIMEOUT_S)
                if kind != "ready":
                    raise TailserveError(msg)
        except BaseException:
            self.shutdown()
            raise
        log.info("tensor parallel: %d ranks (%s), %d threads each", size,
                 "nccl" if device_type == "cuda" else "gloo", threads)
        self._watcher = threading.Thread(target=self._watch, name="tailserve-tp-watch", daemon=True)
        self._watcher.start()

    # -- the Worker interface ------------------------------------------------------------------
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self.check_health()
        for rank, conn in enumerate(self._conns, start=1):
            try:
                conn.send(("execute", sched))
            except OSError:
                self._fail(f"tensor-parallel rank {rank} is gone ({self._exit_note(rank)})")
        try:
            out = self.local.execute(sched)
        except Exception as e:
            # A peer that died mid-step shows up here as a failed collective: say which. Any
            # failure leaves the ranks at different points of the step, so none is recoverable.
            self._fail(self._first_failure() or f"tensor-parallel rank 0 failed: {type(e).__name__}: {e}", e)
        for rank, conn in enumerate(self._conns, start=1):
            kind, msg = self._recv(rank, conn, COLLECTIVE_TIMEOUT_S)
            if kind == "error":
                self._fail(msg)
            if msg != out.sampled_token_ids:
                self._fail(f"tensor-parallel rank {rank} sampled {msg}, rank 0 {out.sampled_token_ids}: "
                           "the ranks diverged")
        return out

    def warm_up(self, decode_batch_sizes: list[int], prefill_lens: list[int], prefill_batch_tokens: int = 0) -> None:
        """Every rank runs the same warm-up forwards (they meet in the same collectives)."""
        self.check_health()
        for rank, conn in enumerate(self._conns, start=1):
            try:
                conn.send(("warm_up", (decode_batch_sizes, prefill_lens, prefill_batch_tokens)))
            except OSError:
                self._fail(f"tensor-parallel rank {rank} is gone ({self._exit_note(rank)})")
        try:
            self.local.warm_up(decode_batch_sizes, prefill_lens, prefill_batch_tokens)
        except Exception as e:
            self._fail(self._first_failure() or f"tensor-parallel rank 0 failed: {type(e).__name__}: {e}", e)
        for rank, conn in enumerate(self._conns, start=1):
            kind, msg = self._recv(rank, conn, START_TIMEOUT_S)
            if kind == "error":
                self._fail(str(msg))

    def free(self, request_ids: list[str]) -> None:
        self.check_health()
        self.local.free(request_ids)
        for rank, conn in enumerate(self._conns, start=1):
            try:
                conn.send(("free", request_ids))
            except OSError:
                self._fail(f"tensor-parallel rank {rank} is gone ({self._exit_note(rank)})")

    def check_health(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    def shutdown(self) -> None:
        self._finalizer()
        if torch.distributed.is_initialized():
            try:
                torch.distributed.destroy_process_group()
            except Exception:  # a broken group cannot be torn down cleanly
                log.debug("destroying a broken process group failed", exc_info=True)

    # -- failures ----------------------------------------------------------------------------
    def _recv(self, rank: int, conn: Connection, timeout_s: float) -> tuple[str, object]:
        proc = self._procs[rank - 1]
        ready = wait([conn, proc.sentinel], timeout=timeout_s)
        if conn in ready:
            try:
                return conn.recv()
            except (EOFError, OSError):
                pass
        elif not ready:
            self._fail(f"tensor-parallel rank {rank} did not answer within {timeout_s:.0f} s")
        proc.join(timeout=5)
        self._fail(f"tensor-parallel rank {rank} died ({self._exit_note(rank)})")
        raise AssertionError("unreachable")

    def _exit_note(self, rank: int) -> str:
        p = self._procs[rank - 1]
        code = p.exitcode
        if code is None:
            return f"pid {p.pid}, still running"
        return f"pid {p.pid}, killed by signal {-code}" if code < 0 else f"pid {p.pid}, exit code {code}"

    def _first_failure(self) -> str | None:
        """A worker's own error report, or the first worker found dead."""
        for rank, (p, conn) in enumerate(zip(self._procs, self._conns), start=1):
            try:
                if conn.poll(0):
                    kind, msg = conn.recv()
                    if kind == "error":
                        return str(msg)
            except (EOFError, OSError):
                pass
            p.join(timeout=0.5)
            if not p.is_alive():
                return f"tensor-parallel rank {rank} died ({self._exit_note(rank)})"
        return None

    def _fail(self, message: str, cause: BaseException | None = None) -> None:
        if self._dead is None:
            self._dead = message
            log.error("engine down: %s", message)
        self.shutdown()
        raise EngineDeadError(self._dead) from cause

    def _watch(self) -> None:
        """Notice a worker's death while the engine is idle, so the next call (or the server's
        health check) reports it."""
        sentinels = {p.sentinel: rank for rank, p in enumerate(self._procs, start=1)}
        while sentinels and self._dead is None:
            done = wait(list(sentinels), timeout=1.0)
            for s in done:
                rank = sentinels.pop(s)
                self._procs[rank - 1].join(timeout=1)  # reap it, for its exit code
                if self._finalizer.alive and self._dead is None:
                    self._dead = f"tensor-parallel rank {rank} died ({self._exit_note(rank)})"
                    log.error("engine down: %s", self._dead)
            if not self._finalizer.alive:
                return
