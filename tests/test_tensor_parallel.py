"""Tensor parallelism over gloo on the CPU: two ranks, two processes, outputs identical to
one rank; a worker that dies takes the engine down with an error naming it, never a hang,
and no worker process outlives the engine."""

from __future__ import annotations

import os
import pathlib
import signal
import threading
import time

import pytest

from conftest import build_hf_model, save_checkpoint
from tailserve import LLM, SamplingParams
from tailserve.bench.local_server import LocalServer
from tailserve.errors import ConfigError, EngineDeadError

PROMPTS = [[5, 17, 33, 2, 90, 41], [7, 7, 8, 100, 3], list(range(20, 60))]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _workers(llm: LLM):
    return llm.engine.core.worker._procs


def _greedy_ids(llm: LLM, params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, params)]


@pytest.fixture(scope="module")
def mqa_odd_vocab(tmp_path_factory):
    # One KV head for two ranks (replicated on both) and a vocabulary that does not split
    # evenly (the LM head's gather pads the last rank's slice).
    hf = build_hf_model("llama", num_key_value_heads=1, vocab_size=385)
    return save_checkpoint(hf, tmp_path_factory.mktemp("mqa"))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "llama_tied", "qwen2", "qwen3", "mistral", "mqa_odd_vocab"])
def test_two_ranks_give_the_same_greedy_output_as_one(tiny_checkpoint, mqa_odd_vocab, kind):
    path = mqa_odd_vocab if kind == "mqa_odd_vocab" else tiny_checkpoint(kind)[0]
    want = _greedy_ids(LLM(str(path), dtype="float32"))
    with LLM(str(path), dtype="float32", tensor_parallel_size=2) as tp:
        attn = tp.engine.core.worker.local.model.layers[0].self_attn
        assert attn.num_heads == 2 and attn.num_kv_heads == 1  # this rank's share
        assert _greedy_ids(tp) == want
        procs = _workers(tp)
    assert not any(p.is_alive() for p in procs)


@pytest.mark.slow
def test_tiny_llama_with_a_draft_model_on_two_ranks(llama_checkpoint, noisy_draft):
    path, _ = llama_checkpoint
    kw = dict(dtype="float32", speculative_model=str(noisy_draft), num_speculative_tokens=3)
    want = _greedy_ids(LLM(str(path), dtype="float32"))
    with LLM(str(path), tensor_parallel_size=2, **kw) as tp:
        assert _greedy_ids(tp) == want
        assert tp.engine.spec_stats.num_drafts > 0 and tp.engine.spec_stats.num_accepted_tokens > 0


def test_built_in_model_with_speculative_decoding_on_two_ranks():
    ref = LLM(dtype="float32")
    prompts = ["def add(a, b):", "import os\n", "class Point:\n    def __init__(self"]
    params = SamplingParams(temperature=0, max_tokens=24)
    want = [o.token_ids for o in ref.generate(prompts, params)]
    with LLM(dtype="float32", tensor_parallel_size=2, speculative_model="builtin", num_speculative_tokens=3) as tp:
        assert [o.token_ids for o in tp.generate(prompts, params)] == want
        assert tp.engine.spec_stats.num_drafts > 0
        # Sampled requests run too (every rank samples the same tokens, checked each step).
        outs = tp.generate(prompts, SamplingParams(temperature=0.8, seed=5, max_tokens=12, n=2))
        assert all(len(o.outputs) == 2 for o in outs)


def test_a_worker_killed_while_idle_takes_the_engine_down(llama_checkpoint):
    path, _ = llama_checkpoint
    llm = LLM(str(path), dtype="float32", tensor_parallel_size=2)
    proc = _workers(llm)[0]
    os.kill(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the watcher notices within about a second
        try:
            llm.engine.check_health()
        except EngineDeadError:
            break
        time.sleep(0.1)
    with pytest.raises(EngineDeadError, match=r"rank 1 died \(pid \d+, killed by signal 9\)"):
        llm.generate(PROMPTS, GREEDY)
    llm.shutdown()
    assert not proc.is_alive()


def test_a_worker_killed_mid_generation_fails_the_step_instead_of_hanging(llama_checkpoint):
    path, _ = llama_checkpoint
    llm = LLM(str(path), dtype="float32", tensor_parallel_size=2)
    proc = _workers(llm)[0]
    result: list[BaseException | None] = []

    def run() -> None:
        try:
            llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
            result.append(None)
        except BaseException as e:  # the test inspects it
            result.append(e)

    t = threading.Thread(target=run)
    t.start()
    time.sleep(1.0)
    os.kill(proc.pid, signal.SIGKILL)
    t.join(timeout=60)
    assert not t.is_alive(), "generate hung after its worker died"
    assert isinstance(result[0], EngineDeadError) and "rank 1" in str(result[0])
    llm.shutdown()


def test_ranks_that_cannot_split_the_heads_are_a_config_error(llama_checkpoint):
    path, _ = llama_checkpoint  # 4 heads: not over 3 ranks
    with pytest.raises(ConfigError, match="tensor_parallel_size 3 does not fit this model"):
        LLM(str(path), dtype="float32", tensor_parallel_size=3)


def _children(pid: int) -> list[int]:
    """Worker processes of ``pid``: its descendants, less multiprocessing's helpers (the
    resource tracker, and the fork server the ranks are forked from)."""
    kids: dict[int, list[tuple[int, bytes]]] = {}
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        kids.setdefault(int(fields[1]), []).append((int(stat.parent.name), cmdline))
    out, todo = [], [(pid, False)]
    while todo:
        parent, under_fork_server = todo.pop()
        for child, cmdline in kids.get(parent, []):
            # A rank forked by the fork server carries its command line: only the server's
            # own (a child of the engine's process) is the helper.
            fork_server = b"forkserver" in cmdline and not under_fork_server
            todo.append((child, fork_server))
            if b"resource_tracker" not in cmdline and not fork_server:
                out.append(child)
    return out


def _serve_two_ranks(path) -> LocalServer:
    """A started ``tailserve serve`` on two ranks (log to a file; new ports if one was taken)."""
    return LocalServer(["--no-warmup", "--model", str(path), "--dtype", "float32", "--http2-port", "0",
                        "--tensor-parallel-size", "2"]).__enter__()


def _alive(pid: int) -> bool:
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow
def test_server_on_two_ranks_serves_and_exits_when_a_worker_dies(llama_checkpoint):
    from openai import OpenAI

    path, _ = llama_checkpoint
    srv = _serve_two_ranks(path)
    try:
        client = OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        out = client.completions.create(model=str(path), prompt=PROMPTS[2], max_tokens=16, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.choices[0].text == LLM(str(path), dtype="float32").generate(PROMPTS[2], GREEDY)[0].text
        workers = _children(srv.proc.pid)
        assert len(workers) == 1
        os.kill(workers[0], signal.SIGKILL)
        code = srv.proc.wait(timeout=60)
        log = srv.output()
        assert code == 1 and "engine down: tensor-parallel rank 1 died" in log, log[-2000:]
    finally:
        srv.__exit__(None, None, None)


@pytest.mark.slow
def test_workers_exit_when_the_server_is_killed(llama_checkpoint):
    path, _ = llama_checkpoint
    srv = _serve_two_ranks(path)
    workers = _children(srv.proc.pid)
    assert len(workers) == 1 and _alive(workers[0])
    srv.proc.kill()  # SIGKILL: no clean-up runs; the worker sees its pipe close
    srv.proc.wait(timeout=10)
    srv.__exit__(None, None, None)
    deadline = time.monotonic() + 20
    while _alive(workers[0]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(workers[0]), "a worker outlived its engine"
