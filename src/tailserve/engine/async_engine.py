"""Drives ``LLMEngine`` for the server, so a step and the HTTP work never block each other long.

Two ways to run the engine loop (the plan's ``engine_loop``, ``--engine-loop``):

- **inline** (the default on the CPU): ``run_in_loop()`` is a task on the server's event
  loop, on the process's main thread. Each step blocks the loop while it runs; its outputs
  then go straight into the requests' queues and the loop gets one turn, in which the
  streaming handlers write them and new requests are read, before the next step. On the CPU
  the HTTP work and the steps share the cores anyway; on one thread they take turns without
  the two cross-thread wake-ups a hand-off costs each token (on 2 cores: the server's added
  TPOT 0.28-0.42 ms inline, 0.45-0.96 ms with the hand-off). A request whose bytes come in
  during a step is admitted before the next one: between steps the loop turns until every
  request handler that has started has submitted (``admitting``), at least twice (the first
  turn reads the socket and creates the handler's task, the second runs it).
- **thread**: the engine loop on its own thread (``run_forever()`` on the main thread for
  ``tailserve serve --engine-loop thread``, the default on a GPU, where the host mostly waits
  for the device; ``AsyncEngine(start_thread=True)`` on a background thread, for tests and
  embedding). Outputs go to the event loop's thread (``call_soon_threadsafe``); PyTorch and
  the compiled kernels release the GIL, so the event loop keeps accepting and streaming while
  a step runs. PyTorch's OpenMP intra-op pool is fastest when driven from the main thread
  (measured on 2 cores: 2.8 ms per decode step from the main thread, 5.5 ms from a second one).

Either way the engine loop owns the engine: it takes commands (add, abort, unpin) from a
queue and runs ``step()`` while there is work. Validation and tokenization happen in the
caller (``prepare_request`` has no side effects), so bad input is rejected before anything
is queued.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

from tailserve.engine.llm_engine import EngineStepError, LLMEngine, PreparedRequest
from tailserve.errors import EngineDeadError, TailserveError
from tailserve.outputs import RequestOutput

# Most turns of the event loop the inline engine loop gives request handlers to reach their
# submit before it steps anyway (a client that trickles its body must not stall the engine).
ADMISSION_TURNS = 16

log = logging.getLogger("tailserve.engine")


class EngineOverloadedError(TailserveError):
    """The waiting queue is at its bound; the client should retry later (HTTP 429)."""


class EngineRequestError(TailserveError):
    """The engine failed while serving this request (HTTP 500)."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_waiting_requests: int = 256, start_thread: bool = True) -> None:
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._pending_adds = 0  # queued for the engine thread, not yet in the scheduler
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._just_added: set[asyncio.AbstractEventLoop] = set()
        self.dead: str | None = None  # why the engine stopped for good (EngineDeadError), if it did
        self._thread: threading.Thread | None = None
        self._inline_loop: asyncio.AbstractEventLoop | None = None  # run_in_loop's loop
        self._wake: asyncio.Event | None = None
        self._admitting = 0  # request handlers started and not yet submitted (``admitting``)
        if start_thread:
            self._thread = threading.Thread(target=self._run, name="tailserve-engine", daemon=True)
            self._thread.start()

    def run_forever(self) -> None:
        """Run the engine loop on the calling thread until ``shutdown()`` (outputs handed to
        the event loops of their requests, another thread's)."""
        self._run()

    # -- called from the event loop -----------------------------------------------------
    @contextlib.contextmanager
    def admitting(self) -> Iterator[None]:
        """Around a request handler's work from its start to its ``submit``: the inline engine
        loop does not start a step while one is inside (a handler that waits for the rest of
        its body would otherwise miss the step, and wait for the next)."""
        self._admitting += 1
        try:
            yield
        finally:
            self._admitting -= 1

    @property
    def num_waiting(self) -> int:
        return self.engine.scheduler.num_waiting + self._pending_adds

    def submit(self, prepared: PreparedRequest, request_id: str, arrival_ns: int, final_only: bool = False) -> _Stream:
        """Queue a validated request; raises EngineOverloadedError at the waiting bound. With
        ``final_only`` (a response that is not streamed) only its finished output is delivered."""
        with self._lock:
            if self.dead is not None:
                raise EngineRequestError(f"the engine is down: {self.dead}")
            if self.num_waiting >= self.max_waiting_requests:
                raise EngineOverloadedError(
                    f"{self.num_waiting} requests are waiting (bound {self.max_waiting_requests}); retry later")
            if request_id in self._streams:
                raise EngineRequestError(f"request id {request_id!r} is already in flight")
            stream = _Stream(asyncio.get_running_loop())
            self._streams[request_id] = stream
            self._pending_adds += 1
        self._commands.put(("add", request_id, (prepared, final_only), arrival_ns))
        self._notify()
        return stream

    async def outputs(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until it finishes. If the consumer stops early
        (client gone, task cancelled), the request is aborted and its blocks freed."""
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    stream.finished = True
                    return
        finally:
            if not stream.finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id, None, None))
        self._notify()

    def unpin(self, request_id: str, num_samples: int = 1) -> None:
        """End a finished request's KV pin (its answer was not a tool call)."""
        self._commands.put(("unpin", request_id, num_samples, None))
        self._notify()

    def shutdown(self) -> None:
        self._stop.set()
        self._commands.put(("stop", None, None, None))
        self._notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    # -- the engine thread ------------------------------------------------------------------
    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> asyncio.AbstractEventLoop | None:
        stream = self._streams.get(request_id)
        if stream is None:
            return None
        if isinstance(item, BaseException) or item.finished:
            self._streams.pop(request_id, None)
        # RuntimeError: the event loop is closed, so nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
            return stream.loop
        return None

    def _handle(self, cmd: tuple) -> None:
        kind, rid, payload, arrival_ns = cmd  # add: (request, final_only); unpin: its number of samples
        if kind == "add":
            with self._lock:
                self._pending_adds -= 1
            stream = self._streams.get(rid)
            if stream is not None and self._inline_loop is None:
                self._just_added.add(stream.loop)
            try:
                self.engine.add_prepared(payload[0], rid, arrival_ns, final_only=payload[1])
            except TailserveError as e:
                self._deliver(rid, e)
        elif kind == "unpin":
            self.engine.unpin_request(rid, payload)
        elif kind == "abort":
            if rid in self.engine.output_processor:
                self.engine.abort_request(rid)
            self._streams.pop(rid, None)

    def _run(self) -> None:
        try:
            self._loop()
        except EngineDeadError as e:
            self._fail_all(e)

    def _fail_all(self, e: EngineDeadError) -> None:
        # Nothing can be served any more: fail everything in flight, say why, and return
        # (``tailserve serve`` then exits with the reason).
        self.dead = str(e)
        log.error("engine down, failing %d requests in flight: %s", len(self._streams), e)
        for rid in list(self._streams):
            self._deliver(rid, EngineRequestError(f"the engine is down: {e}"))

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                if self.engine.has_unfinished_requests():
                    cmd = self._commands.get_nowait()
                else:
                    cmd = self._commands.get(timeout=0.5)  # idle: sleep until work arrives
                if cmd[0] != "stop":
                    self._handle(cmd)
                continue  # drain every pending command before the next step
            except queue.Empty:
                pass
            if not self.engine.has_unfinished_requests():
                self.engine.check_health()  # idle: a dead worker still takes the engine down
                continue
            if self._just_added:
                # The handler that queued a request is still finishing (response headers);
                # let it, so the step that follows runs without a thread competing for the cores.
                self._yield_to(self._just_added)
                self._just_added = set()
            outputs = self._step()
            if outputs is None:
                continue
            loops = set()
            for out in outputs:
                loop = self._deliver(out.request_id, out)
                if loop is not None:
                    loops.add(loop)
            self._yield_to(loops)

    def _step(self) -> list[RequestOutput] | None:
        """One engine step; None when it failed (its requests are failed, serving goes on)."""
        try:
            return self.engine.step()
        except EngineDeadError:
            raise
        except EngineStepError as e:  # a bug or a device error in one step: fail its requests, keep serving
            log.error("engine step failed; failing its %d requests %s: %s", len(e.request_ids), e.request_ids,
                      e, exc_info=e.__cause__)
            for rid in e.request_ids:
                self._deliver(rid, EngineRequestError(f"internal error while generating request {rid}: {e}"))
        except Exception as e:  # outside any one step's work: fail every request in flight, keep serving
            ids = self.engine.request_ids()
            log.exception("engine step failed; failing %d requests: %s", len(ids), ids)
            for rid in ids:
                self.engine.abort_request(rid)
                self._deliver(rid, EngineRequestError(f"internal error while generating: {e}"))
            time.sleep(0.01)
        return None

    # -- the engine loop as a task on the event loop's own thread ---------------------------
    async def run_in_loop(self) -> None:
        """Run the engine loop on the calling event loop until ``shutdown()``.

        Each step blocks the loop while it runs; then the step's outputs go straight into
        their streams' queues and the loop gets one turn, in which the streaming handlers
        write them out and new requests are read and queued, before the next step. No
        thread hand-off: with the loop on a second thread, every token took two cross-thread
        wake-ups (the engine waking the loop, the loop releasing the engine), which on this
        2-core VM cost about 0.1 ms a token, as much as the HTTP work itself."""
        self._inline_loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        try:
            while not self._stop.is_set():
                turns = 0
                while self._admitting and turns < ADMISSION_TURNS:  # handlers half-way to submit
                    await asyncio.sleep(0)
                    turns += 1
                while True:  # every pending command before the next step
                    try:
                        cmd = self._commands.get_nowait()
                    except queue.Empty:
                        break
                    if cmd[0] != "stop":
                        self._handle(cmd)
                if self._stop.is_set():
                    break
                if not self.engine.has_unfinished_requests():
                    self.engine.check_health()  # idle: a dead worker still takes the engine down
                    self._wake.clear()
                    if self._commands.empty():
                        with contextlib.suppress(asyncio.TimeoutError):
                            await asyncio.wait_for(self._wake.wait(), 0.5)
                    continue
                outputs = self._step()
                if outputs:
                    for out in outputs:
                        stream = self._streams.get(out.request_id)
                        if stream is None:
                            continue
                        if out.finished:
                            self._streams.pop(out.request_id, None)
                        stream.queue.put_nowait(out)
                # A turn of the loop: the consumers just woken run (they were queued before this
                # task's own wake-up), and ready I/O is read, which creates the handler tasks of
                # requests that came in during the step; a second turn runs those handlers (on 2
                # cores: with one turn, 41 of 64 requests of a 16-stream load missed two steps).
                await asyncio.sleep(0)
                await asyncio.sleep(0)
        except EngineDeadError as e:
            self._fail_all(e)

    def _notify(self) -> None:
        """Wake the inline engine loop (if it runs) from any thread."""
        loop = self._inline_loop
        if loop is None:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        wake = self._wake
        assert wake is not None
        with contextlib.suppress(RuntimeError):  # the loop has closed
            if running is loop:
                wake.set()
            else:
                loop.call_soon_threadsafe(wake.set)

    def _yield_to(self, loops: set) -> None:
        """Let the event loop turn this step's outputs into bytes before the next step.

        On a small machine the engine's intra-op worker threads spin between kernels; an
        event loop thread running at the same time takes a core from them and stalls every
        parallel region (measured on 2 cores: 5.9 ms per token instead of 2.8 ms). Handing
        over explicitly keeps the two from overlapping. The wait is bounded, so a slow
        consumer can never stall generation for long."""
        for loop in loops:
            done = threading.Event()
            # Runs after the callbacks and task wake-ups already queued by _deliver.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(lambda d=done, lp=loop: lp.call_soon(d.set))
                done.wait(timeout=0.005)
