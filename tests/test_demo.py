"""``tailserve demo``: each act's verdict follows its figures (synthetic figures, no server),
the delaying proxy holds what it says, and one quick run end to end whose HTML report a
headless browser lays out without overlapping labels or console errors."""

from __future__ import annotations

import copy
import json
import time

import httpx
import pytest

from tailserve.cli import main
from tailserve.demo import verdicts
from tailserve.demo.acts import Act
from tailserve.demo.proxy import DelayingProxy
from tailserve.demo.report import bar_chart, html_report, text_table


def _tail(dominant: str, p50: float = 200.0, p99: float = 600.0) -> dict:
    share = {"network": 0.0, "queue": 0.1, "prefill": 0.1, "decode": 0.8}
    share = {k: (0.7 if k == dominant else 0.1) for k in share}
    return {"p50_e2el_ms": p50, "p99_e2el_ms": p99, "dominant": dominant, "share": share}


def test_tail_verdict_names_the_network_only_when_the_figures_do():
    f = {"direct": _tail("decode"), "proxied": _tail("network", p99=900), "every": 5, "delay_ms": 500}
    v = verdicts.tail_verdict(f)
    assert "mostly decode (70%)" in v and "the network (70%)" in v and "900 ms (4.5x the median)" in v
    f["proxied"] = _tail("queue")
    v = verdicts.tail_verdict(f)
    assert "still mostly queue" in v and "not the network" in v
    f["direct"] = None
    assert "cannot be attributed" in verdicts.tail_verdict(f)


def _spec(tpot: float, tok_s: float, acc: float | None = None, dpt: float = 0.0) -> dict:
    return {"tpot_p50_ms": tpot, "tok_s": tok_s, "acceptance_pct": acc, "draft_per_token": dpt}


def test_speculation_verdict_follows_latency_at_batch_1_and_throughput_under_load():
    f = {"loads": [{"load": "batch 1", "by": "latency", "off": _spec(4.0, 200), "adaptive": _spec(3.0, 260, 70, 0.8)},
                   {"load": "concurrency 8", "by": "throughput", "off": _spec(9.0, 500),
                    "adaptive": _spec(9.5, 495, None, 0.01)}],
         "repeated": {"by": "latency", "off": _spec(4.0, 200), "suffix": _spec(4.1, 198, 60, 0.5)}}
    v = verdicts.speculation_verdict(f)
    assert "At batch 1 adaptive speculation pays: 4.00 -> 3.00 ms per token, 1.30x" in v and "25% less" in v
    assert v.startswith("At batch 1") and "; at concurrency 8 the controller turned adaptive speculation down" in v
    assert "costs nothing measurable" in v and "suffix decoding is even with off" in v
    worse = copy.deepcopy(f)
    worse["loads"][0]["adaptive"] = _spec(4.6, 175, 20, 0.9)
    worse["loads"][1]["adaptive"] = _spec(12.0, 400, None, 0.02)
    v = verdicts.speculation_verdict(worse)
    assert "adaptive speculation costs 15% of per-token latency" in v
    assert "yet tokens/s is 20% worse" in v
    # A gain beside a handful of drafts is not speculation's: the verdict says noise, not "pays".
    lucky = copy.deepcopy(f)
    lucky["loads"][0]["adaptive"] = _spec(3.0, 260, 61, 0.04)
    v = verdicts.speculation_verdict(lucky)
    assert "adaptive speculation pays" not in v
    assert "turned adaptive speculation down (0.04 draft tokens per output token), so the 25% less" in v
    assert "run-to-run noise, not speculation: 4.00 -> 3.00 ms per token" in v


def test_prefix_verdict_states_the_cut_or_says_why_there_is_none():
    off = {"ttft_p50_ms": 800.0, "ttft_p99_ms": 820.0, "prompt_tokens": 10000, "computed_tokens": 10000,
           "hit_rate": 0.0}
    on = {"ttft_p50_ms": 60.0, "ttft_p99_ms": 830.0, "prompt_tokens": 10000, "computed_tokens": 2400,
          "hit_rate": 0.76}
    v = verdicts.prefix_verdict({"off": off, "on": on, "prefix_tokens": 1024})
    assert "cut TTFT P50 by 92%" in v and "computed 2400 of 10000" in v and "hit rate 76%" in v
    v = verdicts.prefix_verdict({"off": off, "on": {**on, "ttft_p50_ms": 790.0}, "prefix_tokens": 1024})
    assert "did not cut" in v
    v = verdicts.prefix_verdict({"off": off, "on": {**on, "ttft_p50_ms": 790.0, "hit_rate": 0.0},
                                 "prefix_tokens": 1024})
    assert "found nothing to reuse" in v


def _alloc(conf: str, peak: float, above: float, fires: bool) -> dict:
    return {"conf": conf, "peak_reserved_mib": peak, "stranded_at_peak": 0.0, "max_stranded_above_floor": above,
            "alert_fires": fires, "oom": False}


def test_memory_verdict_reads_capacity_and_the_alert_from_the_figures():
    f = {"capacity": {"kv_mib": 24.0, "max_model_len": 1024, "paged": {"max_concurrent": 18},
                      "contiguous": {"max_concurrent": 4}},
         "allocator": [_alloc("default", 28.0, 0.8, True), _alloc("max_split_size_mb:128", 28.0, 0.8, True),
                       _alloc("expandable_segments:True", 20.0, 0.0, False)], "alert_threshold": 0.3}
    v = verdicts.memory_verdict(f)
    assert "paging ran 18 sequences at once against 4" in v and "(4.5x)" in v
    assert "fire under default, max_split_size_mb:128 and not under expandable_segments:True" in v
    assert "max_split_size_mb:128 changes nothing here against default" in v
    assert "expandable_segments:True reserves the least" in v and "not a measurement of a GPU" in v
    f["allocator"] = [_alloc("default", 28.0, 0.1, False), _alloc("expandable_segments:True", 28.0, 0.05, False)]
    f["capacity"]["paged"]["max_concurrent"] = 8
    v = verdicts.memory_verdict(f)
    assert "(2.0x)" in v and "would fire under none of them (worst stranded share above the floor 10%)" in v


def test_the_proxy_holds_every_nth_completion_and_forwards_the_rest(tiny_server):
    body = {"model": "tiny", "prompt": "def f(", "max_tokens": 4, "temperature": 0}
    # A hold long beside a 4-token completion: on 2 cores shared with the suite's other
    # workers a request that was not held once took 0.42 s (a 0.4 s hold failed the test).
    delay_s = 1.5
    with DelayingProxy(tiny_server.url, every=2, delay_s=delay_s) as proxy:
        assert httpx.get(proxy.url + "/v1/models").json()["data"][0]["id"] == "tiny"
        times, texts = [], []
        for _ in range(4):
            t = time.perf_counter()
            r = httpx.post(proxy.url + "/v1/completions", json=body, timeout=30)
            times.append(time.perf_counter() - t)
            assert r.status_code == 200
            texts.append(r.json()["choices"][0]["text"])
        bad = httpx.post(proxy.url + "/v1/completions", json={"model": "nope", "prompt": "x"}, timeout=30)
    assert proxy.num_held == 2 and len(set(texts)) == 1
    assert times[1] >= delay_s and times[3] >= delay_s and times[0] < delay_s and times[2] < delay_s
    assert bad.status_code == 404 and "error" in bad.json()  # errors pass through unchanged


def test_bar_rows_keep_long_labels_apart_in_headless_chromium(tmp_path, headless_chromium):
    """A synthetic act with labels long enough to wrap: the layout check the quick run's
    report gets below, on a page that needs no server."""
    long = "concurrency 8, adaptive speculation with the built-in draft and a very long label: off"
    act = Act("speculation", "2. Speculative decoding", ["load", "TPOT"], [["batch 1", "3.0"]], "verdict", {},
              [("per-token latency", "ms", [(long, 3.2), ("b", 0.0), (long + " again", 12345.0)])], ["cmd"])
    page = tmp_path / "r.html"
    page.write_text(html_report([act], {"machine": "test"}))
    _assert_laid_out(headless_chromium, page, {"act-speculation"})


def _assert_laid_out(driver, page, sections: set[str]) -> None:
    driver.set_window_size(1000, 900)
    driver.get(page.as_uri())
    assert {e.get_attribute("id") for e in driver.find_elements("css selector", "section")} == sections
    boxes = driver.execute_script("""
        return Array.from(document.querySelectorAll('.chart')).map(c =>
            Array.from(c.querySelectorAll('.bar-label, .bar-track, .bar-value')).map(e => {
                const r = e.getBoundingClientRect();
                return [e.className, e.textContent, r.left, r.top, r.right, r.bottom];
            }));""")
    assert boxes
    width = driver.execute_script("return document.documentElement.clientWidth")
    for chart in boxes:
        assert chart
        for i, a in enumerate(chart):
            assert a[4] <= width + 0.5, f"{a[1]!r} runs off the page"
            if a[0] != "bar-track":
                assert a[4] > a[2] and a[5] > a[3], f"{a[1]!r} has no box"
            for b in chart[i + 1:]:
                overlap = min(a[4], b[4]) - max(a[2], b[2]) > 0.5 and min(a[5], b[5]) - max(a[3], b[3]) > 0.5
                assert not overlap, f"{a[1]!r} overlaps {b[1]!r}"
    errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors


def test_text_table_and_bar_chart_escape_and_align():
    t = text_table(["a", "bb"], [["x", "1"], ["long", "22"]])
    assert t.splitlines()[0] == "a     bb" and t.splitlines()[3] == "long  22"
    assert "&lt;b&gt;" in bar_chart("t", "ms", [("<b>", 1.0)])


@pytest.fixture(scope="module")
def quick_demo(tmp_path_factory):
    d = tmp_path_factory.mktemp("demo")
    assert main(["demo", "--quick", "--report-dir", str(d)]) == 0
    return d


@pytest.mark.slow
def test_demo_quick_runs_four_acts_whose_verdicts_match_their_figures(quick_demo, capsys):
    data = json.loads((quick_demo / "demo.json").read_text())
    acts = {a["key"]: a for a in data["acts"]}
    assert list(acts) == ["tail", "speculation", "prefix", "memory"]
    tail = acts["tail"]["figures"]
    assert tail["held"] >= 2 and acts["tail"]["verdict"] == verdicts.tail_verdict(tail)
    assert acts["speculation"]["verdict"] == verdicts.speculation_verdict(acts["speculation"]["figures"])
    rep = acts["speculation"]["figures"]["repeated"]["suffix"]
    assert rep["acceptance_pct"] > 0 and rep["draft_per_token"] > 0
    pre = acts["prefix"]["figures"]
    assert pre["on"]["hit_rate"] > 0.3 and pre["on"]["computed_tokens"] < pre["off"]["computed_tokens"]
    assert acts["prefix"]["verdict"] == verdicts.prefix_verdict(pre)
    mem = acts["memory"]["figures"]
    assert mem["capacity"]["paged"]["max_concurrent"] >= 2 * mem["capacity"]["contiguous"]["max_concurrent"]
    assert mem["allocator"][0]["conf"] == "default"
    assert "AVX" in data["header"]["machine"] or "unknown" in data["header"]["machine"]


@pytest.mark.slow
def test_demo_report_lays_out_in_headless_chromium(quick_demo, headless_chromium):
    _assert_laid_out(headless_chromium, quick_demo / "report.html",
                     {"act-tail", "act-speculation", "act-prefix", "act-memory"})
    text = headless_chromium.find_element("tag name", "body").text
    assert "tailserve bench --url http://HOST:PORT" in text
    for act in json.loads((quick_demo / "demo.json").read_text())["acts"]:
        assert act["verdict"] in text


def test_demo_only_rejects_an_unknown_act(capsys):
    with pytest.raises(SystemExit) as e:
        main(["demo", "--only", "everything"])
    assert e.value.code == 2
