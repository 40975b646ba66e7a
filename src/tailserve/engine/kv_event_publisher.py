"""KV-cache events over ZMQ in vLLM's wire form (``--kv-events-config``), for prefix-aware
routers: llm-d's KV-cache indexer, Dynamo's KV router, or anything that speaks vLLM's events.

Wire form, as vLLM's ``ZmqEventPublisher`` sends it:

- a PUB socket at ``endpoint`` sends one multipart message per engine step that changed the
  cache: ``(topic, seq, payload)``, ``seq`` an 8-byte big-endian counter from 0, ``payload``
  the msgpack of a ``KVEventBatch`` in msgspec's array form: ``[ts, events,
  data_parallel_rank]`` with each event a tagged array:
  ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]``,
  ``["BlockRemoved", block_hashes, medium]``, ``["AllBlocksCleared"]``;
- a ROUTER socket at ``replay_endpoint`` answers a request whose one frame is an 8-byte
  big-endian start sequence number (from a DEALER: ``[b"", start]``; a REQ socket adds the
  empty frame itself) with every buffered batch from that number on, one ``(seq, payload)``
  message each, then ``(-1, b"")``: a subscriber that missed messages (it started late, the
  network dropped them, or it restarted) resyncs without a restart of the server.

The first batch (seq 0) is ``AllBlocksCleared``: a router that sees it drops what it held for
this server (it restarted, its cache is empty); the last, at shutdown, is another. Block
hashes are the prefix cache's own (memory/block_hash.py: ``sha256_cbor_64bit`` unless
``--prefix-caching-hash-algo`` says otherwise), so a router recomputes them from a prompt.
Sockets are created and bound here, at start-up (a port in use is a one-line error), then
used only by the publisher thread: the engine step only queues the batch.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence

from tailserve.config import KVEventsConfig
from tailserve.errors import ConfigError
from tailserve.memory.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

log = logging.getLogger("tailserve.kv_events")
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def encode_event(e: KVEvent, medium: str) -> list:
    if isinstance(e, BlockStored):
        return ["BlockStored", list(e.block_hashes), e.parent_block_hash, list(e.token_ids), e.block_size, None,
                medium]
    if isinstance(e, BlockRemoved):
        return ["BlockRemoved", list(e.block_hashes), medium]
    return ["AllBlocksCleared"]


def _binds(endpoint: str) -> bool:
    # vLLM's rule: a wildcard address (or ipc/inproc) is bound, a host is connected to.
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    def __init__(self, config: KVEventsConfig, medium: str, data_parallel_rank: int = 0) -> None:
        try:
            import msgpack
            import zmq
        except ImportError:
            raise ConfigError("--kv-events-config needs pyzmq and msgpack: pip install 'tailserve[kv-events]'") \
                from None
        self.config = config
        self.medium = medium
        self.data_parallel_rank = data_parallel_rank
        self._pack = msgpack.Packer(use_bin_type=True).pack
        self._zmq = zmq
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay = None
        try:
            if _binds(config.endpoint):
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ConfigError(f"--kv-events-config: cannot open {e.strerror.lower()} "
                              f"({config.endpoint}, replay {config.replay_endpoint})") from None
        self._queue: queue.Queue[list[KVEvent] | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self.num_published = 0  # batches sent (the next sequence number)
        self.num_dropped = 0  # batches dropped because the queue was full
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        self.publish([AllBlocksCleared()])

    def publish(self, events: Sequence[KVEvent]) -> None:
        """Queue one batch (the engine step's); never blocks the step."""
        if not events:
            return
        try:
            self._queue.put_nowait(list(events))
        except queue.Full:
            # A router that misses this resyncs from replay; the step must not wait on it.
            self.num_dropped += 1
            log.warning("kv events: queue full (%d batches), a batch was dropped", self.config.max_queue_size)

    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                if not self._running:
                    return
                continue
            if batch is None:
                return
            payload = self._pack([time.time(), [encode_event(e, self.medium) for e in batch],
                                  self.data_parallel_rank])
            seq = self.num_published
            self._pub.send_multipart((self.config.topic.encode(), seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))
            self.num_published = seq + 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("kv events: a replay request is [identity, b'', 8-byte start]; got %d frames", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))

    def shutdown(self, timeout_s: float = 2.0) -> None:
        """Announce the cache gone, send what is queued (up to ``timeout_s``), close."""
        if not self._running:
            return
        self.publish([AllBlocksCleared()])
        self._running = False
        self._queue.put(None)
        self._thread.join(timeout=timeout_s)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
