"""``tailserve bench``: flags (named as ``vllm bench serve``'s where the concept is the same),
rate sweeps, the SLO search, the HTTP comparison, and the outputs."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import operator
import pathlib
import re
import shlex
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from tailserve.bench.agentic import AgenticConfig
from tailserve.bench.datasets import BenchRequest, DatasetConfig, load_dataset
from tailserve.bench.load import LoadConfig, LoadRun, run_load
from tailserve.bench.local_server import LocalServer
from tailserve.bench.results import build_result, parse_goodput, parse_metric_names, parse_percentiles
from tailserve.errors import ConfigError
from tailserve.model.tokenizer import Tokenizer

# -- SLO ----------------------------------------------------------------------------------

_OPS: dict[str, Callable[[float, float], bool]] = {"<=": operator.le, "<": operator.lt, ">=": operator.ge,
                                                   ">": operator.gt}


@dataclass(frozen=True)
class Bound:
    key: str
    op: str
    value: float

    def holds(self, result: dict[str, Any]) -> bool:
        v = result.get(self.key)
        return isinstance(v, (int, float)) and _OPS[self.op](float(v), self.value)

    def __str__(self) -> str:
        return f"{self.key}{self.op}{self.value:g}"


def parse_slo(text: str) -> list[Bound]:
    bounds = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*([a-z0-9_.]+)\s*(<=|>=|<|>)\s*([0-9.eE+-]+)\s*", part)
        if not m:
            raise ConfigError(f"--slo: cannot read {part!r}; write e.g. p99_ttft_ms<=500,p99_tpot_ms<=50")
        key, op, val = m.groups()
        if not re.fullmatch(r"(mean|median|std|p[0-9.]+)_(ttft|ttst|tpot|itl|e2el)_ms|request_throughput|"
                            r"output_throughput|request_goodput", key):
            raise ConfigError(f"--slo: {key!r} is not a result key (e.g. p99_ttft_ms, median_tpot_ms)")
        bounds.append(Bound(key, op, float(val)))
    if not bounds:
        raise ConfigError("--slo: no bounds")
    return bounds


# -- the command --------------------------------------------------------------------------

def _rates(text: str) -> list[float]:
    out = []
    for x in str(text).split(","):
        x = x.strip()
        try:
            r = math.inf if x.lower() == "inf" else float(x)
        except ValueError:
            raise ConfigError(f"--request-rate: {x!r} is not a number or inf") from None
        if r <= 0:
            raise ConfigError("--request-rate must be positive")
        out.append(r)
    return out


def _tokenizer(args: argparse.Namespace, local: bool) -> tuple[Tokenizer | None, str | None]:
    from tailserve.assets import DEFAULT_TARGET_DIR

    candidates = [args.tokenizer] if args.tokenizer else []
    if not args.tokenizer and args.model and pathlib.Path(args.model).is_dir():
        candidates.append(args.model)
    if not args.tokenizer and (local or not candidates):
        candidates.append(str(DEFAULT_TARGET_DIR) if local else "")
    for c in candidates:
        if c and (pathlib.Path(c) / "tokenizer.json").is_file():
            return Tokenizer(pathlib.Path(c)), c
    if args.tokenizer:
        raise ConfigError(f"--tokenizer {args.tokenizer}: no tokenizer.json there (a local folder is needed; "
                          "model hubs are not reached)")
    return None, None


def _dataset_config(args: argparse.Namespace, num_prompts: int) -> DatasetConfig:
    out_len = args.random_output_len
    in_len = args.random_input_len
    if args.dataset_name == "custom" and args.custom_output_len:
        out_len = args.custom_output_len
    if args.dataset_name == "prefix_repetition":
        in_len = args.prefix_repetition_prefix_len or in_len
        out_len = args.prefix_repetition_output_len or out_len
    return DatasetConfig(name=args.dataset_name, num_prompts=num_prompts, seed=args.seed, path=args.dataset_path,
                         input_len=in_len, output_len=out_len, range_ratio=args.random_range_ratio,
                         prefix_len=args.random_prefix_len, sharegpt_output_len=args.sharegpt_output_len,
                         num_prefixes=args.prefix_repetition_num_prefixes,
                         suffix_len=args.prefix_repetition_suffix_len, num_turns=args.multi_turn_num_turns,
                         trace_speedup=args.trace_speedup, trace_hash_block_size=args.trace_hash_block_size,
                         trace_timestamp_unit=args.trace_timestamp_unit,
                         agentic=AgenticConfig(num_turns=args.agentic_num_turns, num_tools=args.agentic_num_tools,
                                               tool_result_len=args.agentic_tool_result_len,
                                               think_time_s=args.agentic_think_time,
                                               system_len=args.agentic_system_prompt_len))


def _headers(args: argparse.Namespace) -> dict[str, str]:
    h = {}
    for item in args.header:
        k, sep, v = item.partition("=")
        if not sep or not k.strip():
            raise ConfigError(f"--header: expected KEY=VALUE, got {item!r}")
        h[k.strip()] = v.strip()
    if args.api_key:
        h.setdefault("Authorization", f"Bearer {args.api_key}")
    return h


@contextlib.contextmanager
def _target(args: argparse.Namespace) -> Iterator[tuple[str, str | None]]:
    """(base URL, h2c URL or None); starts a local server when no URL is given."""
    if args.url:
        yield args.url.rstrip("/").removesuffix("/v1"), None
    elif args.host or args.port:
        yield f"http://{args.host or '127.0.0.1'}:{args.port or 8000}", None
    else:
        with LocalServer(shlex.split(args.server_args)) as srv:
            yield srv.url, srv.url_h2


class _Progress:
    """A live line per run (rich), or nothing when disabled or not on a terminal."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and sys.stderr.isatty()

    @contextlib.contextmanager
    def run(self, label: str, total: int) -> Iterator[Callable[[Any], None]]:
        if not self.enabled:
            yield lambda rec: None
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      TextColumn("{task.fields[errors]} errors"), transient=True) as prog:
            task = prog.add_task(label, total=total, errors=0)
            errors = [0]

            def done(rec: Any) -> None:
                if not rec.success:
                    errors[0] += 1
                prog.update(task, advance=1, errors=errors[0])

            yield done


@dataclass
class BenchSession:
    """Everything one ``tailserve bench`` invocation needs to run a load level."""

    args: argparse.Namespace
    base: LoadConfig
    dataset: DatasetConfig
    tokenizer: Tokenizer | None
    tokenizer_id: str | None
    percentile_metrics: list[str]
    percentiles: list[float]
    goodput: dict[str, float]
    progress: _Progress

    level: int = 0

    def requests(self) -> tuple[list[BenchRequest], list[BenchRequest]]:
        """(measured, warm-up) prompts for the next load level: a fresh sample per level
        (seed + level), so a sweep's later levels do not find the earlier levels' prompts in
        the server's prefix cache, and warm-ups of their own for the same reason."""
        n_warm = self.base.num_warmups
        cfg = replace(self.dataset, seed=self.dataset.seed + self.level,
                      num_prompts=self.dataset.num_prompts + n_warm)
        self.level += 1
        reqs = load_dataset(cfg, self.tokenizer)
        if any(r.arrival_s is not None for r in reqs):  # a trace: replay it whole; warm-ups repeat its start
            return reqs[: self.dataset.num_prompts], reqs[:n_warm]
        return reqs[n_warm:], reqs[:n_warm]

    def measure(self, cfg: LoadConfig, label: str) -> dict[str, Any]:
        requests, warmups = self.requests()
        total = sum(r.num_turns for r in requests)
        with self.progress.run(label, total) as done:
            run: LoadRun = asyncio.run(run_load(cfg, requests, self.tokenizer, on_done=done, warmups=warmups))
        return build_result(run, self.percentile_metrics, self.percentiles, self.goodput or None, label=label,
                            tokenizer_id=self.tokenizer_id, dataset_name=self.args.dataset_name)


def slo_search(session: BenchSession, bounds: Sequence[Bound], iterations: int) -> tuple[list[dict], dict]:
    """Highest request rate whose run meets every bound: one run at full load to find the
    capacity, then bisection between 0 and it. Returns every run and a summary."""
    runs = []
    cap = session.measure(replace(session.base, request_rate=math.inf), "slo: inf")
    runs.append(cap)
    if all(b.holds(cap) for b in bounds):
        return runs, {"best_rate": "inf", "meets": [str(b) for b in bounds], "best_label": cap["label"],
                      "sentence": f"every bound holds even at full load ({cap['request_throughput']:.2f} req/s)"}
    lo, hi, best = 0.0, max(cap["request_throughput"], 1e-3), None
    for _ in range(max(1, iterations)):
        mid = (lo + hi) / 2
        res = session.measure(replace(session.base, request_rate=mid), f"slo: {mid:.3g} req/s")
        runs.append(res)
        if all(b.holds(res) for b in bounds):
            lo, best = mid, res
        else:
            hi = mid
    if best is None:
        return runs, {"best_rate": None, "sentence": f"no tested rate met {', '.join(map(str, bounds))} (lowest "
                                                     f"tried {hi:.3g} req/s)"}
    return runs, {"best_rate": lo, "best_label": best["label"],
                  "sentence": f"highest rate meeting {', '.join(map(str, bounds))}: {lo:.3g} req/s "
                              f"(achieved {best['request_throughput']:.3g} req/s; the next rate tried, "
                              f"{hi:.3g} req/s, missed)"}


def _result_path(args: argparse.Namespace, result: dict[str, Any], multi: bool) -> pathlib.Path:
    if args.result_filename and not multi:
        name = args.result_filename
    else:
        model = pathlib.Path(str(result["model_id"])).name
        rate = result["request_rate"]
        base = args.result_filename.removesuffix(".json") + "-" if args.result_filename else \
            f"{result['backend']}-"
        name = f"{base}{rate}qps-{model}-{result['date']}-{re.sub(r'[^A-Za-z0-9_.-]+', '_', result['label'])}.json"
    return pathlib.Path(args.result_dir) / name


def write_outputs(args: argparse.Namespace, results: list[dict[str, Any]], extra: dict[str, Any] | None = None,
                  samples: Sequence[tuple[str, str]] = ()) -> list[pathlib.Path]:
    from tailserve.bench.report import html_report, plots

    written = []
    if args.save_result:
        pathlib.Path(args.result_dir).mkdir(parents=True, exist_ok=True)
        for r in results:
            path = _result_path(args, r, len(results) > 1)
            path.write_text(json.dumps({**r, **(extra or {})}, indent=1))
            written.append(path)
    if args.report_dir:
        d = pathlib.Path(args.report_dir)
        d.mkdir(parents=True, exist_ok=True)
        pngs = plots(results)
        for name, data in pngs.items():
            (d / f"{name}.png").write_bytes(data)
            written.append(d / f"{name}.png")
        cmd = "tailserve " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:] else None
        (d / "report.html").write_text(html_report(results, command=cmd, pngs=pngs, samples=samples))
        written.append(d / "report.html")
    return written


def run_bench(args: argparse.Namespace) -> int:
    from tailserve.bench.report import compare, render_compare, render_table

    percentile_metrics = parse_metric_names(args.percentile_metrics)
    percentiles = parse_percentiles(args.metric_percentiles)
    goodput = parse_goodput(args.goodput)
    bounds = parse_slo(args.slo) if args.slo else None
    rates = _rates(args.request_rate)
    extra_body: dict[str, Any] = {}
    if args.extra_body:
        try:
            extra_body = json.loads(args.extra_body)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--extra-body is not JSON: {e.msg}") from None
        if not isinstance(extra_body, dict):
            raise ConfigError("--extra-body must be a JSON object")
    ramp = None
    if args.ramp_up_strategy:
        if args.ramp_up_start_rps is None or args.ramp_up_end_rps is None:
            raise ConfigError("--ramp-up-strategy needs --ramp-up-start-rps and --ramp-up-end-rps")
        ramp = (args.ramp_up_start_rps, args.ramp_up_end_rps)
    chat_default = args.backend == "openai-chat" or args.dataset_name == "agentic"  # tools need chat
    endpoint = args.endpoint or ("/v1/chat/completions" if chat_default else "/v1/completions")
    if args.dataset_name == "agentic" and endpoint != "/v1/chat/completions":
        raise ConfigError("--dataset-name agentic sends tools: it needs --endpoint /v1/chat/completions")
    local = not (args.url or args.host or args.port)
    tokenizer, tokenizer_id = _tokenizer(args, local)
    num_prompts = args.num_prompts
    if args.duration is not None:
        from tailserve.bench.arrivals import count_for_duration

        num_prompts = max(num_prompts, count_for_duration(args.duration, max(r for r in rates if not math.isinf(r))
                                                          if any(not math.isinf(r) for r in rates) else math.inf))
    dataset = _dataset_config(args, num_prompts)
    load_dataset(replace(dataset, num_prompts=1), tokenizer)  # a bad file or flag fails before a server starts
    with _target(args) as (base_url, h2_url):
        base = LoadConfig(base_url=base_url, endpoint=endpoint, model=args.model if not local else None,
                          request_rate=rates[0], burstiness=args.burstiness, max_concurrency=args.max_concurrency,
                          num_warmups=args.num_warmups, ramp=ramp,
                          ramp_strategy=args.ramp_up_strategy or "linear", duration_s=args.duration,
                          probe_rate=args.probe_request_rate, stop_on_oversaturation=args.stop_on_oversaturation,
                          ignore_eos=args.ignore_eos, temperature=args.temperature, top_p=args.top_p,
                          extra_body=extra_body, headers=_headers(args), http2=args.http2,
                          keep_alive=not args.no_keep_alive, timeout_s=args.timeout, seed=args.seed,
                          tool_choice=args.agentic_tool_choice)
        if base.http2 and h2_url:
            base = replace(base, base_url=h2_url)
        session = BenchSession(args, base, dataset, tokenizer, tokenizer_id, percentile_metrics, percentiles,
                               goodput, _Progress(not args.disable_tqdm))
        label = args.label or ("tailserve-local" if local else base.endpoint.rsplit("/", 1)[-1])
        extra: dict[str, Any] = {}
        compare_rows = None
        if bounds:
            results, summary = slo_search(session, bounds, args.slo_iterations)
            extra["slo_search"] = summary
        elif args.compare_http:
            # Each way warms its own connections and the server first, so the first way does not
            # pay for a cold server alone.
            base = replace(base, num_warmups=max(base.num_warmups, 4))
            ways = [("HTTP/1.1 keep-alive", replace(base, http2=False, keep_alive=True)),
                    ("HTTP/1.1 new connection each", replace(base, http2=False, keep_alive=False)),
                    ("HTTP/2 h2c", replace(base, http2=True, keep_alive=True,
                                           base_url=h2_url or base.base_url))]
            results = [session.measure(cfg, name) for name, cfg in ways]
            compare_rows = [(results[0]["label"], r["label"], compare(results[0], r)) for r in results[1:]]
        else:
            results = [session.measure(replace(base, request_rate=r),
                                       label if len(rates) == 1 else f"{label} @ {r:g} req/s") for r in rates]
    print(render_table(results), end="")
    if bounds:
        print(extra["slo_search"]["sentence"])
    for name_a, name_b, rows in compare_rows or ():
        print(render_compare([row for row in rows if "ttft" in row["metric"] or "throughput" in row["metric"]],
                             name_a, name_b), end="")
    for path in write_outputs(args, results, extra):
        print(f"wrote {path}")
    return 0


def run_compare(args: argparse.Namespace) -> int:
    from tailserve.bench.report import compare, render_compare

    def load(path: str) -> dict[str, Any]:
        try:
            data = json.loads(pathlib.Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"{path}: cannot read a result JSON ({e})") from None
        if not isinstance(data, dict) or "completed" not in data:
            raise ConfigError(f"{path}: not a bench result (no 'completed' key)")
        return data

    a, b = load(args.a), load(args.b)
    rows = compare(a, b, noise_floor=args.noise_floor)
    if args.json:
        print(json.dumps(rows))
    else:
        print(render_compare(rows, args.a, args.b), end="")
    return 0
