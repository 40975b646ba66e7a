"""KV-cache events (--kv-events-config): the log's merging, the pool's stores and evictions,
the portable block hash against an independent encoding, and a real ZMQ subscriber that
rebuilds the server's cached-block set from the events alone, through evictions, a restart of
the subscriber (replay) and the engine's shutdown."""

from __future__ import annotations

import hashlib
import time

import msgpack
import pytest
import zmq

from tailserve import LLM, SamplingParams
from tailserve.bench.local_server import free_port
from tailserve.config import EngineConfig, KVEventsConfig
from tailserve.errors import ConfigError
from tailserve.memory.block_hash import sha256_cbor_64bit
from tailserve.memory.block_pool import BlockPool
from tailserve.memory.kv_events import BlockRemoved, BlockStored, KVEventLog


# -- the log and the pool (stage tests) -------------------------------------------------------
def test_log_merges_a_chain_of_stores_and_runs_of_removals():
    log = KVEventLog()
    log.stored(11, None, (1, 2), 2)
    log.stored(12, 11, (3, 4), 2)  # continues the chain
    log.stored(21, None, (5, 6), 2)  # another prompt's first block: a new event
    log.removed(11)
    log.removed(12)
    assert log.drain() == [BlockStored((11, 12), None, (1, 2, 3, 4), 2), BlockStored((21,), None, (5, 6), 2),
                           BlockRemoved((11, 12))]
    assert log.drain() == []


def test_pool_announces_what_it_caches_and_what_it_evicts():
    pool = BlockPool(2, 2, events=KVEventLog())
    a, b = pool.allocate(2)
    h = pool.hash_blocks([1, 2, 3, 4], 2)
    pool.cache_block(a, h[0], (1, 2))
    pool.cache_block(b, h[1], (3, 4), parent_hash=h[0])
    pool.cache_block(b, h[1], (3, 4), parent_hash=h[0])  # already cached: nothing new
    assert pool.events.drain() == [BlockStored(tuple(h), None, (1, 2, 3, 4), 2)]
    pool.free([a, b])
    assert pool.events.drain() == []  # freed blocks stay cached: nothing removed yet
    pool.allocate(1)  # reuses the tail block first, dropping its hash
    assert pool.events.drain() == [BlockRemoved((h[1],))]
    assert pool.cached_block_hashes() == {h[0]}


def _cbor_uint(major: int, n: int) -> bytes:
    # RFC 8949 canonical (shortest) head, written out here independently of cbor2.
    m = major << 5
    if n < 24:
        return bytes([m | n])
    for info, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if n < 1 << (8 * size):
            return bytes([m | info]) + n.to_bytes(size, "big")
    raise ValueError(n)


def _llmd_hash(parent: int, tokens: list[int]) -> int:
    payload = _cbor_uint(4, 3) + _cbor_uint(0, parent) + _cbor_uint(4, len(tokens)) \
        + b"".join(_cbor_uint(0, t) for t in tokens) + b"\xf6"
    return int.from_bytes(hashlib.sha256(payload).digest()[-8:], "big")


def _llmd_chain(tokens: list[int], block_size: int, seed: str = "") -> list[int]:
    """What llm-d's indexer computes for a prompt: root = low 64 bits of SHA-256 over the CBOR
    text of the seed, then each full block hashed over [parent, tokens, null]."""
    parent = int.from_bytes(hashlib.sha256(_cbor_uint(3, len(seed)) + seed.encode()).digest()[-8:], "big")
    out = []
    for i in range(len(tokens) // block_size):
        parent = _llmd_hash(parent, tokens[i * block_size:(i + 1) * block_size])
        out.append(parent)
    return out


def test_portable_hash_is_the_one_a_router_recomputes(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    fn = sha256_cbor_64bit()
    tokens = [1, 23, 24, 255, 256, 65535, 65536, 31999] * 4  # every CBOR integer width
    pool = BlockPool(4, 8, hash_fn=fn)
    assert pool.hash_blocks(tokens, 4) == _llmd_chain(tokens, 8)
    monkeypatch.setenv("PYTHONHASHSEED", "42")
    assert sha256_cbor_64bit()(None, tuple(tokens[:8])) == _llmd_chain(tokens[:8], 8, seed="42")[0]


def test_kv_events_config_takes_vllms_json_and_refuses_what_it_does_not_know():
    c = KVEventsConfig.from_json('{"enable_kv_cache_events": true, "endpoint": "tcp://*:6000", "topic": "kv"}')
    assert c.enabled and c.publisher == "zmq" and c.replay_endpoint is None and c.buffer_steps == 10_000
    assert not KVEventsConfig.from_json('{"enable_kv_cache_events": false}').enabled
    with pytest.raises(ConfigError, match=r"unknown field.*endpointt"):
        KVEventsConfig.from_json('{"enable_kv_cache_events": true, "endpointt": "tcp://*:6000"}')
    with pytest.raises(ConfigError, match="not JSON"):
        KVEventsConfig.from_json("{enable")
    with pytest.raises(ConfigError, match="ZMQ address"):
        KVEventsConfig(enable_kv_cache_events=True, endpoint="localhost:5557")
    on = EngineConfig(model="m", kv_events_config='{"enable_kv_cache_events": true}')
    assert on.prefix_caching_hash_algo == "sha256_cbor_64bit"  # the hash a router can recompute
    assert EngineConfig(model="m").prefix_caching_hash_algo == "builtin"


# -- a real subscriber -------------------------------------------------------------------------
class Router:
    """What a KV-aware router does with the events: a set of the server's cached block
    hashes, kept by sequence number, resynced from the replay socket on a gap or a start."""

    def __init__(self, pub: str, replay: str, topic: bytes = b"") -> None:
        ctx = zmq.Context.instance()
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(pub)
        self.replay = ctx.socket(zmq.DEALER)
        self.replay.connect(replay)
        self.blocks: set[int] = set()
        self.last_seq = -1
        self.stored: list[list] = []
        self.num_replayed = 0

    def _apply(self, seq: int, payload: bytes) -> None:
        if seq <= self.last_seq:
            return  # seen already (live and replayed both)
        assert seq == self.last_seq + 1, (seq, self.last_seq)
        ts, events, dp_rank = msgpack.unpackb(payload)
        assert isinstance(ts, float) and dp_rank == 0
        for e in events:
            if e[0] == "BlockStored":
                hashes, _parent, tokens, block_size, lora_id, medium = e[1:]
                assert len(tokens) == len(hashes) * block_size and lora_id is None and medium == "CPU"
                self.blocks.update(hashes)
                self.stored.append(e)
            elif e[0] == "BlockRemoved":
                self.blocks.difference_update(e[1])
            else:
                assert e == ["AllBlocksCleared"]
                self.blocks.clear()
        self.last_seq = seq

    def resync(self) -> None:
        self.replay.send_multipart([b"", (self.last_seq + 1).to_bytes(8, "big")])
        while True:
            assert self.replay.poll(5000), "no replay answer"
            _, seq_b, payload = self.replay.recv_multipart()
            seq = int.from_bytes(seq_b, "big", signed=True)
            if seq == -1:
                return
            self.num_replayed += 1
            self._apply(seq, payload)

    def catch_up(self, published: int, timeout_s: float = 10.0) -> None:
        """Read live batches until ``published`` are applied; resync on a gap."""
        deadline = time.monotonic() + timeout_s
        while self.last_seq < published - 1:
            assert time.monotonic() < deadline, f"at {self.last_seq}, {published} published"
            if self.sub.poll(100):
                _, seq_b, payload = self.sub.recv_multipart()
                seq = int.from_bytes(seq_b, "big")
                if seq > self.last_seq + 1:
                    self.resync()
                self._apply(seq, payload)
            else:
                self.resync()  # nothing live (joined late, or quiet): ask

    def close(self) -> None:
        self.sub.close(linger=0)
        self.replay.close(linger=0)


def _published(llm) -> int:
    """Batches sent so far, once the publisher's queue is empty."""
    pub = llm.engine.kv_events
    deadline = time.monotonic() + 10
    while not pub._queue.empty() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    return pub.num_published


def test_router_rebuilds_the_cached_set_through_evictions_and_its_own_restart(llama_checkpoint):
    path, _ = llama_checkpoint
    pub, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint=pub.replace("127.0.0.1", "*"),
                         replay_endpoint=rep.replace("127.0.0.1", "*"))
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=256 << 10, kv_events_config=cfg)  # 32 blocks
    pool = llm.engine.block_pool
    assert pool.num_blocks == 32 and llm.engine.config.prefix_caching_hash_algo == "sha256_cbor_64bit"
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prompts = [[(7 * i + j) % 200 + 3 for j in range(64)] for i in range(12)]  # 4 full blocks each
    router = Router(pub, rep)
    try:
        llm.generate(prompts[:4], params)
        router.catch_up(_published(llm))
        assert router.blocks == pool.cached_block_hashes() and len(router.blocks) >= 16
        # the hashes a router computes from the prompt's tokens are the ones announced
        assert set(_llmd_chain(prompts[0], 16)) <= router.blocks
        first = next(e for e in router.stored if e[1][0] == _llmd_chain(prompts[0], 16)[0])
        assert first[2] is None and first[3][:64] == prompts[0] and first[4] == 16

        router.close()  # the router goes away; the server goes on and evicts
        evictions = pool.stats.evictions
        llm.generate(prompts[4:], params)
        assert pool.stats.evictions > evictions
        restarted = Router(pub, rep)  # a fresh router: everything from replay
        restarted.catch_up(_published(llm))
        assert restarted.num_replayed > 0
        assert restarted.blocks == pool.cached_block_hashes()
        assert not set(_llmd_chain(prompts[0], 16)) & restarted.blocks  # evicted, and said so

        router = Router(pub, rep)  # a router restarted from a saved state: resumes from its sequence number
        router.blocks, router.last_seq = set(restarted.blocks), restarted.last_seq
        resumed_from = router.last_seq
        llm.generate(prompts[:2], params)
        n = _published(llm)
        router.catch_up(n)
        restarted.catch_up(n)
        assert router.blocks == restarted.blocks == pool.cached_block_hashes()
        assert resumed_from < router.last_seq
    finally:
        llm.engine.shutdown()
    router.catch_up(router.last_seq + 2)  # the shutdown's AllBlocksCleared
    assert router.blocks == set()
    router.close()
    restarted.close()


def test_engine_refuses_an_endpoint_in_use_before_loading(llama_checkpoint):
    path, _ = llama_checkpoint
    port = free_port()
    taken = zmq.Context.instance().socket(zmq.PUB)
    taken.bind(f"tcp://*:{port}")
    try:
        with pytest.raises(ConfigError, match="--kv-events-config: cannot open"):
            LLM(str(path), dtype="float32", kv_events_config=KVEventsConfig(
                enable_kv_cache_events=True, endpoint=f"tcp://*:{port}"))
    finally:
        taken.close(linger=0)


def test_serve_rejects_bad_kv_events_config_in_one_line(capsys):
    from tailserve.cli import main

    assert main(["serve", "--model", "/nonexistent", "--port", str(free_port()), "--kv-events-config",
                 '{"enable_kv_cache_events": true, "publisher": "kafka"}']) == 2
    err = capsys.readouterr().err.strip()
    assert "publisher must be zmq or null" in err and len(err.splitlines()) == 1
