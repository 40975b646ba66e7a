"""Snapshot analysis on a hand-built snapshot whose figures are known."""

from __future__ import annotations

import json
import pickle
import zlib

from conftest import serve_in_thread
from tailserve.cli import main
from tailserve.memory.allocator.analyze import analyze_snapshot, segment_map_png

MiB = 1 << 20


def frames(fn, line):
    return [{"filename": "/usr/lib/python3/site-packages/torch/nn/functional.py", "line": 1, "name": "linear"},
            {"filename": fn, "line": line, "name": "forward"}]


SNAP = {
    "segments": [
        # 20 MiB large segment: 4 MiB allocated (model.py:10), 6 MiB pending, 10 MiB free -> stranded
        {"address": 0, "total_size": 20 * MiB, "stream": 0, "segment_type": "large", "blocks": [
            {"address": 0, "size": 4 * MiB, "state": "active_allocated", "frames": frames("model.py", 10)},
            {"address": 4 * MiB, "size": 6 * MiB, "state": "active_pending_free"},
            {"address": 10 * MiB, "size": 10 * MiB, "state": "inactive"}]},
        # 12 MiB segment wholly free: not stranded (empty_cache returns it)
        {"address": 1 << 30, "total_size": 12 * MiB, "stream": 0, "segment_type": "large", "blocks": [
            {"address": 1 << 30, "size": 12 * MiB, "state": "inactive"}]},
        # 2 MiB small segment on stream 7: 1 MiB allocated (kv.py:3), 1 MiB stranded
        {"address": 2 << 30, "total_size": 2 * MiB, "stream": 7, "segment_type": "small", "blocks": [
            {"address": 2 << 30, "size": MiB, "state": "active_allocated", "frames": frames("kv.py", 3)},
            {"address": (2 << 30) + MiB, "size": MiB, "state": "inactive"}]},
    ],
    "device_traces": [[
        {"action": "segment_alloc", "addr": 0, "size": 20 * MiB}, {"action": "alloc", "addr": 0, "size": 16 * MiB},
        {"action": "segment_alloc", "addr": 1, "size": 12 * MiB}, {"action": "free_completed", "addr": 0,
                                                                      "size": 16 * MiB},
        {"action": "segment_alloc", "addr": 2, "size": 2 * MiB},
    ]],
    "allocator_settings": {"max_split_size": -1},
}


def test_figures_of_a_known_snapshot():
    a = analyze_snapshot(SNAP)
    assert (a.num_segments, a.reserved_bytes, a.allocated_bytes, a.active_bytes) == (3, 34 * MiB, 5 * MiB, 11 * MiB)
    assert a.stranded_bytes == 11 * MiB and a.largest_free_block == 12 * MiB
    assert abs(a.inactive_split_over_reserved - 11 / 34) < 1e-12 and abs(a.unallocated_over_reserved - 29 / 34) < 1e-12
    assert (a.peak_active_bytes, a.peak_reserved_bytes) == (16 * MiB, 34 * MiB)
    assert a.pools["small/stream 7"].stranded_bytes == MiB and a.pools["large/stream 0"].segments == 2
    assert a.top_sites == [("model.py:10 forward", 4 * MiB), ("kv.py:3 forward", MiB)]  # torch frames skipped


def test_segment_map_png_is_a_valid_image():
    png = segment_map_png(SNAP, width=200, row=10, gap=2)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    w, h = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert (w, h) == (200, 3 * 12)
    idat = png.index(b"IDAT")
    raw = zlib.decompress(png[idat + 4 : idat + 4 + int.from_bytes(png[idat - 4 : idat], "big")])
    row0 = raw[1 : 1 + 200 * 3]  # largest segment first: 4/20 of it allocated (blue), then pending, then stranded
    assert tuple(row0[:3]) == (52, 101, 164) and tuple(row0[-3:]) == (204, 0, 0)


def test_cli_analyze(tmp_path, capsys):
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps(SNAP))
    png = tmp_path / "map.png"
    assert main(["memory", "analyze", str(path), "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "stranded in split segments: 11.0 MiB" in out and "model.py:10" in out and png.stat().st_size > 100
    assert main(["memory", "analyze", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stranded_bytes"] == 11 * MiB
    (tmp_path / "bad.pickle").write_bytes(b"not a pickle")
    assert main(["memory", "analyze", str(tmp_path / "bad.pickle")]) == 2


def test_html_page_of_an_analysis_in_headless_chromium(tmp_path, headless_chromium):
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps(SNAP))
    page = tmp_path / "analysis.html"
    assert main(["memory", "analyze", str(path), "--html", str(page)]) == 0
    driver = headless_chromium
    driver.get(page.as_uri())
    img = driver.execute_script("const i = document.getElementById('segment-map'); "
                                "return [i.complete, i.naturalWidth, i.naturalHeight]")
    assert img[0] and img[1] == 1024 and img[2] > 0
    text = driver.find_element("tag name", "body").text
    assert "stranded in split segments" in text and "11.0 MiB" in text and "model.py:10" in text
    assert "large/stream 0" in text or "large" in text


# -- taking snapshots from a running server ------------------------------------------------------
def test_memory_snapshot_from_a_running_server(llama_checkpoint, tmp_path, capsys):
    import httpx
    import pytest

    from tailserve.config import EngineConfig
    from tailserve.engine.llm_engine import LLMEngine
    from tailserve.errors import ConfigError
    from tailserve.memory.allocator.snapshot import load_snapshot
    from tailserve.server.app import Server

    path, _ = llama_checkpoint
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", kv_cache_memory_bytes=4 << 20))
    with pytest.raises(ConfigError, match="CUDA caching allocator"):  # on a CPU: nothing to snapshot
        engine.memory_snapshot()
    server = Server(engine, api_key="secret", start_engine_thread=True)
    with serve_in_thread(server) as url:
        r = httpx.post(url + "/debug/memory/snapshot")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.post(url + "/debug/memory/snapshot", headers={"Authorization": "Bearer secret"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "no_cuda_device"
        engine.attach_snapshot_source(lambda: SNAP)  # the stand-in for torch.cuda.memory._snapshot()
        out = tmp_path / "snap.pickle"
        assert main(["memory", "snapshot", "--url", url, "--api-key", "secret", "-o", str(out)]) == 0
        assert load_snapshot(out) == SNAP
        printed = capsys.readouterr().out
        assert "3 segments, 34.0 MiB reserved, 5.0 MiB allocated, 11.0 MiB stranded" in printed
        assert main(["memory", "snapshot", "--url", url, "--api-key", "wrong", "-o", str(out)]) == 2
        assert "401" in capsys.readouterr().err
        # The server keeps serving.
        assert httpx.post(url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2},
                          headers={"Authorization": "Bearer secret"}).status_code == 200
