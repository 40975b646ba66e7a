"""The ``tailserve`` command line: ``generate``, ``serve``, ``bench [compare]``, ``demo``,
``memory simulate | recommend | analyze``.

Flag names follow vLLM's where the concept is the same. User errors print one line on
stderr and exit with status 2; nothing prints a traceback for a bad flag or a bad model.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time
from collections.abc import Sequence

from tailserve.config import (
    DEFAULT_ADMISSION_RESERVE_TOKENS,
    DEFAULT_KV_CACHE_MEMORY_BYTES,
    DEFAULT_TOOL_CALL_KV_TTL_S,
    DRAFT_QUANTIZATIONS,
    KV_CACHE_DTYPES,
    parse_bytes,
)
from tailserve.errors import ConfigError, TailserveError


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="Hugging Face-format checkpoint folder (default: the built-in model)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    g.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="the KV cache's element type: auto takes the model's dtype, and on the CPU the float32 model "
                        "--dtype auto makes of a bf16/fp16 checkpoint stores K/V in the checkpoint's dtype (half "
                        "the bytes of float32)")
    g.add_argument("--kv-cache-memory", default=None,
                   help="KV-cache size in bytes; units allowed (e.g. 512MiB, 2GiB). Default: "
                        f"{DEFAULT_KV_CACHE_MEMORY_BYTES >> 20} MiB on the CPU; on CUDA what --gpu-memory-utilization "
                        "leaves after a profiling pass")
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--admission-reserve-tokens", type=int, default=DEFAULT_ADMISSION_RESERVE_TOKENS,
                   help="admit a request only while the KV blocks the running requests need for their next N tokens "
                        "(each at most its max_tokens) stay free; 0: admit while any block is free and preempt when "
                        "blocks run out (vLLM V1's rule)")
    g.add_argument("--max-num-partial-prefills", type=int, default=None,
                   help="at most N requests are prefilled per step (a prompt with more than one token to compute), "
                        "so prompts that arrive together start decoding a few at a time; 0: no limit. "
                        "Default: 2 for tailserve serve on the CPU, else no limit")
    g.add_argument("--max-long-partial-prefills", type=int, default=None,
                   help="at most N of them with long prompts (over 4%% of --max-model-len tokens still to compute); "
                        "0: no limit. Default: 1 for tailserve serve on the CPU, else no limit")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--prefix-caching-hash-algo", choices=["builtin", "sha256_cbor_64bit"], default=None,
                   help="the prefix cache's block hash: builtin (Python's hash, fastest) or sha256_cbor_64bit "
                        "(what llm-d's KV-cache indexer recomputes; seed PYTHONHASHSEED). Default: "
                        "sha256_cbor_64bit with --kv-events-config, else builtin")
    g.add_argument("--kv-events-config", default=None, metavar="JSON",
                   help="publish KV-cache events (BlockStored, BlockRemoved, AllBlocksCleared) over ZMQ as vLLM does, "
                        "for prefix-aware routers, e.g. '{\"enable_kv_cache_events\": true, \"endpoint\": "
                        "\"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\"}' (needs pip install "
                        "'tailserve[kv-events]')")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--cuda-alloc-conf", default=None,
                   help="PYTORCH_CUDA_ALLOC_CONF for this process, e.g. max_split_size_mb:128 (validated; applied "
                        "before CUDA initialises)")
    g.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="share of the GPU's memory the engine plans for (vLLM's meaning): without "
                        "--kv-cache-memory the KV cache takes what this share leaves after a profiling pass "
                        "(default 0.9); it caps nothing by itself (see --cuda-memory-fraction)")
    g.add_argument("--cuda-memory-fraction", type=float, default=None,
                   help="hard cap on this process's CUDA memory (torch.cuda.set_per_process_memory_fraction); "
                        "the allocator's garbage_collection_threshold acts only with one set")
    g.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"],
                   help="attention kernels: the PyTorch reference (auto, torch) or the paged Triton kernel "
                        "(needs pip install triton; tested in Triton's interpreter, not yet on a GPU)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="ranks to split the target model over, one process each (gloo on the CPU, NCCL on CUDA)")
    g.add_argument("--quantization", "-q", default=None, choices=["int8", "w8a8_int8"],
                   help="int8: weight-only int8 for the target's projections and LM head (per-row scales; "
                        "activations stay in --dtype); w8a8_int8: int8 weights and int8 activations quantised "
                        "per row (CPU, compiled kernels; lossier, faster products)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: run decodes eagerly instead of replaying CUDA graphs captured at start-up")
    g.add_argument("--no-cpu-kernels", dest="cpu_kernels", action="store_false",
                   help="use PyTorch's kernels only, not tailserve's compiled CPU kernels (compact bf16/fp16/int8 "
                        "weights with float32 arithmetic, fused decode layers and attention, sampling cut-offs)")
    g.add_argument("--no-cpu-onednn", dest="cpu_onednn", action="store_false",
                   help="use PyTorch's plain linear kernels on the CPU instead of oneDNN-packed weights")
    s = p.add_argument_group("speculative decoding")
    s.add_argument("--speculative-model", default=None,
                   help="draft checkpoint folder, or 'builtin' for the built-in draft model")
    s.add_argument("--speculative-method", default=None, choices=["draft_model", "ngram", "suffix", "hybrid"],
                   help="hybrid: n-gram lookup where it matches >= --ngram-min tokens, the draft model elsewhere")
    s.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="fixed number of draft tokens per step (default: adaptive)")
    s.add_argument("--speculative-max-tokens", type=int, default=8, help="upper bound for adaptive k")
    s.add_argument("--speculative-draft-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="the draft model's dtype (auto: the target's)")
    s.add_argument("--speculative-draft-quantization", default=None, choices=list(DRAFT_QUANTIZATIONS),
                   help="int8 for the draft model (lossless: only acceptance can change): int8 weight-only, "
                        "w8a8_int8 int8 weights and per-row int8 activations (CPU, compiled kernels); "
                        "default: w8a8_int8 for a bf16/fp16 draft on the compiled CPU kernels, none elsewhere")
    s.add_argument("--speculative-draft-numpy", action=argparse.BooleanOptionalAction, default=None,
                   help="run a single sequence's draft steps in NumPy on the CPU (float32 draft); "
                        "default: on the CPU for drafts of up to 8M parameters")
    s.add_argument("--speculative-draft-stop-margin", type=float, default=None,
                   help="stop a request's draft chain after a draft whose top-1 minus top-2 draft "
                        "probability is below this; 0: always draft k tokens (default: 0.02 with "
                        "adaptive k, 0 with --num-speculative-tokens)")
    s.add_argument("--ngram-min", type=int, default=1)
    s.add_argument("--ngram-max", type=int, default=4)
    s.add_argument("--speculative-synthetic-acceptance", type=float, default=None, metavar="A",
                   help="benchmarks only, LOSSY: accept each draft with probability A whatever the target says "
                        "(needs TAILSERVE_BENCHMARK=1)")
    s.add_argument("--speculative-verification", default="token", choices=["token", "block"],
                   help="token: verify drafts token by token; block: as a whole (block verification, "
                        "the same distribution, at least as many drafts accepted)")
    s.add_argument("--speculative-objective", default="throughput", choices=["throughput", "goodput"],
                   help="what adaptive k maximises: tokens/s, or tokens/s of the requests that meet --slo")
    s.add_argument("--slo", default=None, metavar="BOUNDS",
                   help='latency bounds for --speculative-objective goodput, e.g. "p99_tpot_ms<=40,p99_ttft_ms<=500"')
    s.add_argument("--suffix-max-depth", type=int, default=24,
                   help="suffix decoding: the longest context suffix matched")
    s.add_argument("--suffix-max-spec-factor", type=float, default=1.0,
                   help="suffix decoding: drafts at most this times the match length")
    s.add_argument("--suffix-min-token-prob", type=float, default=0.1,
                   help="suffix decoding: stop a draft once its cumulative empirical probability falls below this")
    s.add_argument("--suffix-cache-max-requests", type=int, default=4096,
                   help="suffix decoding: finished requests kept in the global cache (0: the request's own text only)")


def _engine_kwargs(args: argparse.Namespace, serving: bool = False) -> dict[str, object]:
    """EngineConfig's fields from the shared engine flags. ``serving``: settings left to the
    plan for a server keep None (``--max-num-partial-prefills``, ``--max-long-partial-prefills``);
    offline they default to 0."""
    prefills, long_prefills = args.max_num_partial_prefills, args.max_long_partial_prefills
    return dict(
        max_num_partial_prefills=prefills if prefills is not None or serving else 0,
        max_long_partial_prefills=long_prefills if long_prefills is not None or serving else 0,
        dtype=args.dtype, device=args.device, block_size=args.block_size, kv_cache_dtype=args.kv_cache_dtype,
        kv_cache_memory_bytes=None if args.kv_cache_memory is None else parse_bytes(args.kv_cache_memory),
        max_num_seqs=args.max_num_seqs, admission_reserve_tokens=args.admission_reserve_tokens,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching, enable_chunked_prefill=args.enable_chunked_prefill,
        seed=args.seed, cpu_onednn=args.cpu_onednn, cpu_kernels=args.cpu_kernels,
        tensor_parallel_size=args.tensor_parallel_size,
        attention_backend=args.attention_backend, quantization=args.quantization,
        enforce_eager=args.enforce_eager,
        cuda_alloc_conf=args.cuda_alloc_conf, gpu_memory_utilization=args.gpu_memory_utilization,
        cuda_memory_fraction=args.cuda_memory_fraction,
        speculative_model=args.speculative_model, speculative_method=args.speculative_method,
        num_speculative_tokens=args.num_speculative_tokens, speculative_max_tokens=args.speculative_max_tokens,
        speculative_draft_dtype=args.speculative_draft_dtype,
        speculative_draft_quantization=args.speculative_draft_quantization,
        speculative_draft_stop_margin=args.speculative_draft_stop_margin,
        speculative_draft_numpy=args.speculative_draft_numpy,
        ngram_min=args.ngram_min, ngram_max=args.ngram_max, suffix_max_depth=args.suffix_max_depth,
        suffix_max_spec_factor=args.suffix_max_spec_factor, suffix_min_token_prob=args.suffix_min_token_prob,
        suffix_cache_max_requests=args.suffix_cache_max_requests,
        speculative_synthetic_acceptance=args.speculative_synthetic_acceptance,
        speculative_verification=args.speculative_verification,
        speculative_objective=args.speculative_objective, slo=args.slo,
        prefix_caching_hash_algo=args.prefix_caching_hash_algo, kv_events_config=args.kv_events_config,
    )


def _cmd_generate(args: argparse.Namespace) -> int:
    from tailserve.engine.llm import LLM
    from tailserve.sampling_params import SamplingParams

    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, seed=args.sampling_seed,
        max_tokens=args.max_tokens, stop=tuple(args.stop or ()), ignore_eos=args.ignore_eos,
    )
    llm = LLM(args.model, **_engine_kwargs(args))
    t0 = time.perf_counter()
    outputs = llm.generate(list(args.prompts), params)
    elapsed = time.perf_counter() - t0
    for i, out in enumerate(outputs):
        if len(outputs) > 1:
            print(f"--- [{i}] finish_reason={out.finish_reason}")
        print((out.prompt or "") + out.text)
    if args.stats:
        from tailserve.metrics import render_table, summarize

        n_out = sum(o.num_output_tokens for o in outputs)
        n_in = sum(o.num_prompt_tokens for o in outputs)
        metrics = [o.metrics for o in outputs if o.metrics is not None]
        if metrics:
            print(render_table(summarize(metrics, duration_s=elapsed)), file=sys.stderr, end="")
        print(f"--- {len(outputs)} requests, {n_in} prompt tokens, {n_out} output tokens in {elapsed:.3f} s "
              f"({n_out / elapsed:.1f} output tok/s)", file=sys.stderr)
        spec = llm.engine.spec_stats
        if spec.num_drafts:
            print(f"--- speculative decoding: {spec.num_draft_tokens} draft tokens, acceptance rate "
                  f"{spec.acceptance_rate:.3f}, mean acceptance length {spec.mean_acceptance_length:.2f}",
                  file=sys.stderr)
    return 0


def _check_port(flag: str, port: int, allow_zero: bool = False) -> None:
    if not (0 if allow_zero else 1) <= port <= 65535:
        raise ConfigError(f"{flag} {port}: a TCP port is {'0 (off) or ' if allow_zero else ''}1-65535")


def _cmd_serve(args: argparse.Namespace) -> int:
    from tailserve.engine import worker_spin

    # Before torch (and with it libgomp, which reads it once) loads: engine/worker_spin.py.
    worker_spin.limit_for_serving()
    from tailserve.config import EngineConfig
    from tailserve.engine.llm_engine import LLMEngine
    from tailserve.server.run import check_bindable, resolve_http2_port, run_server

    _check_port("--port", args.port)
    if args.http2_port is not None:
        _check_port("--http2-port", args.http2_port, allow_zero=True)
    elif args.port == 65535:
        raise ConfigError("--port 65535 leaves no port for the h2c listener (--port + 1); pass --http2-port N "
                          "or --http2-port 0")
    tools = _tool_options(args)
    if args.ray_replicas is not None:
        return _serve_on_ray(args, tools)
    http2_port = resolve_http2_port(args.port, args.http2_port)
    # As vLLM: the served name is --served-model-name (several allowed, the first is the
    # main one), else --model exactly as given; the checkpoint folder's name works too.
    names = list(args.served_model_name or ([args.model] if args.model else []))
    # The settings are checked before the address: a bad flag is the user's error whatever
    # the port (and a test's free port may be taken by another meanwhile).
    config = EngineConfig(model=args.model or "builtin", served_model_name=names[0] if names else None,
                          enable_metrics=not args.disable_metrics, gateway_metrics=args.gateway_metrics,
                          record_memory_history=args.record_memory_history, warmup=not args.no_warmup,
                          custom_histogram_buckets=args.custom_histogram_buckets, engine_loop=args.engine_loop,
                          **_engine_kwargs(args, serving=True))  # type: ignore[arg-type]
    check_bindable(args.host, args.port)  # fail before spending seconds loading the model
    tracer = None
    if args.otlp_traces_endpoint is not None:
        from tailserve.server.tracing import RequestTracer

        tracer = RequestTracer(args.otlp_traces_endpoint)  # a missing extra fails here, before the load
    if http2_port:
        check_bindable(args.host, http2_port)
    engine = LLMEngine(config)
    aliases = [*names[1:], engine.model_dir.name]
    run_server(engine, host=args.host, port=args.port, http2_port=http2_port, api_key=args.api_key,
               max_body_bytes=parse_bytes(args.max_request_body), max_waiting_requests=args.max_waiting_requests,
               access_log=args.access_log, model_aliases=aliases,
               per_request_metrics=args.enable_per_request_metrics, tracer=tracer, **tools)
    return 0


def _tool_options(args: argparse.Namespace) -> dict[str, object]:
    """--chat-template, --enable-auto-tool-choice, --tool-call-parser, checked before loading."""
    from tailserve.server.tools import ToolCallingConfig

    template = None
    if args.chat_template is not None:
        path = pathlib.Path(args.chat_template)
        try:
            template = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"--chat-template {path}: cannot read it ({e})") from None
        from jinja2 import TemplateSyntaxError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        try:
            ImmutableSandboxedEnvironment().parse(template)
        except TemplateSyntaxError as e:
            raise ConfigError(f"--chat-template {path}: not a valid Jinja template (line {e.lineno}: {e.message})") \
                from None
    from tailserve.server.tool_pruning import ToolPruning

    try:
        pruning = ToolPruning(args.tool_pruning, args.tool_pruning_max_tools)
        config = ToolCallingConfig(args.enable_auto_tool_choice, args.tool_call_parser, args.tool_call_kv_ttl, pruning)
    except ValueError as e:
        raise ConfigError(str(e).replace("tool pruning mode", "--tool-pruning").replace(
            "tool pruning max_tools", "--tool-pruning-max-tools")) from None
    return {"chat_template": template, "tool_calling": config}


def _serve_on_ray(args: argparse.Namespace, tools: dict[str, object]) -> int:
    """``--ray-replicas N``: N engines as Ray Serve replicas behind one endpoint on --port
    (tailserve/integrations/ray_serve.py), until SIGINT/SIGTERM."""
    import signal
    import threading

    if args.ray_replicas < 1:
        raise ConfigError(f"--ray-replicas must be >= 1, got {args.ray_replicas}")
    if args.http2_port:
        raise ConfigError("--http2-port: Ray Serve's proxy speaks HTTP/1.1 only; drop it with --ray-replicas")
    if args.engine_loop != "auto":
        raise ConfigError("--engine-loop: Ray Serve replicas run each engine on its own thread; drop it with "
                          "--ray-replicas")
    if args.access_log:
        raise ConfigError("--access-log: Ray Serve logs each request itself; drop it with --ray-replicas")
    if args.kv_events_config is not None:
        raise ConfigError("--kv-events-config is not available with --ray-replicas yet (each replica would need "
                          "its own endpoint); drop one of them")
    if args.otlp_traces_endpoint is not None:
        from tailserve.server.tracing import RequestTracer

        RequestTracer(args.otlp_traces_endpoint).shutdown()  # the URL and the extra, checked before Ray starts
    try:
        import ray
        from ray import serve
    except ImportError:
        raise ConfigError("--ray-replicas needs Ray Serve: pip install 'tailserve[ray]'") from None
    from tailserve.integrations.ray_serve import build_openai_app
    from tailserve.server.run import check_bindable

    check_bindable(args.host, args.port)
    kw = _engine_kwargs(args, serving=True)
    kw.update(model=args.model, enable_metrics=not args.disable_metrics, gateway_metrics=args.gateway_metrics,
              record_memory_history=args.record_memory_history, warmup=not args.no_warmup,
              custom_histogram_buckets=args.custom_histogram_buckets)
    names = list(args.served_model_name or ([args.model] if args.model else ["builtin"]))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    ray.init(num_cpus=max(cores, args.ray_replicas), include_dashboard=False)
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(build_openai_app(
        num_replicas=args.ray_replicas, engine_kwargs=kw, served_model_names=names,
        num_cpus_per_replica=max(cores, args.ray_replicas) / args.ray_replicas,
        server_kwargs={"api_key": args.api_key, "max_body_bytes": parse_bytes(args.max_request_body),
                       "max_waiting_requests": args.max_waiting_requests,
                       "per_request_metrics": args.enable_per_request_metrics,
                       "otlp_traces_endpoint": args.otlp_traces_endpoint, **tools}), route_prefix="/",
        name="tailserve")
    print(f"serving {names[0]} on http://{args.host}:{args.port} with {args.ray_replicas} Ray Serve replicas",
          file=sys.stderr)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass
    serve.shutdown()
    ray.shutdown()
    return 0


def _cmd_memory_snapshot(args: argparse.Namespace) -> int:
    import pathlib

    import httpx

    from tailserve.memory.allocator.analyze import analyze_snapshot
    from tailserve.memory.allocator.snapshot import load_snapshot_bytes

    url = args.url.rstrip("/") + "/debug/memory/snapshot"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        r = httpx.post(url, headers=headers, timeout=120)
    except httpx.HTTPError as e:
        raise ConfigError(f"--url: cannot reach {url}: {e}") from None
    if r.status_code != 200:
        try:
            msg = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            msg = r.text[:200]
        raise ConfigError(f"the server answered {r.status_code}: {msg}")
    snap = load_snapshot_bytes(r.content, url)  # plain data only, or refused
    out = pathlib.Path(args.output)
    out.write_bytes(r.content)
    a = analyze_snapshot(snap)
    mib = 1 << 20
    print(f"wrote {out} ({len(r.content)} bytes): {a.num_segments} segments, {a.reserved_bytes / mib:.1f} MiB "
          f"reserved, {a.allocated_bytes / mib:.1f} MiB allocated, {a.stranded_bytes / mib:.1f} MiB stranded in "
          f"split blocks; details: tailserve memory analyze {out}")
    return 0


def _cmd_memory_simulate(args: argparse.Namespace) -> int:
    import json

    from tailserve.memory.allocator.simulator import simulate_trace
    from tailserve.memory.allocator.snapshot import read_trace

    events = read_trace(args.trace)
    confs = args.conf or [""]
    capacity = parse_bytes(args.capacity)
    floor = parse_bytes(args.alert_min_reserved)
    results = [simulate_trace(events, c, capacity, args.memory_fraction, alert_min_reserved_bytes=floor)
               for c in confs]
    if args.json:
        for r in results:
            print(json.dumps(r.as_dict()))
        return 0
    print(format_simulation(results, len(events), capacity, floor), end="")
    return 0


def format_simulation(results, num_events: int, capacity: int, floor: int) -> str:
    """The simulate table: fragmentation as the monitor alerts on it (stranded = inactive split
    / reserved), at the peak and while reserved is above the alert's floor, never a ratio taken
    when almost nothing was reserved."""
    from tailserve.memory.allocator.simulator import ALERT_THRESHOLD, ALERT_TRIGGER

    mib = 1 << 20
    names = [r.conf or "default" for r in results]
    w = max(len("PYTORCH_CUDA_ALLOC_CONF"), *map(len, names))
    lines = [f"{num_events} events, capacity {capacity / mib:.0f} MiB; stranded = inactive split / reserved; "
             f"the alert: stranded > {ALERT_THRESHOLD:.0%} while reserved >= {floor / mib:.0f} MiB, "
             f"{ALERT_TRIGGER} evaluations in a row",
             f"{'PYTORCH_CUDA_ALLOC_CONF':{w}s} {'peak reserved':>14s} {'peak allocated':>15s} "
             f"{'stranded at peak':>17s} {'max above floor':>16s} {'alert':>6s} {'retries':>8s}  out of memory"]
    for name, r in zip(names, results):
        oom = f"at event {r.oom_at_event}" if r.oom else "no"
        above = (f"{r.max_stranded_above_floor:16.1%}" if r.peak_reserved_bytes >= floor
                 else f"{'below floor':>16s}")
        lines.append(f"{name:{w}s} {r.peak_reserved_bytes / mib:10.1f} MiB {r.peak_allocated_bytes / mib:11.1f} MiB "
                     f"{r.stranded_at_peak:17.1%} {above} {'fires' if r.alert_fires else 'no':>6s} "
                     f"{r.num_alloc_retries:8d}  {oom}")
    return "\n".join(lines) + "\n"


def _cmd_memory_recommend(args: argparse.Namespace) -> int:
    import json

    from tailserve.memory.allocator.simulator import recommend
    from tailserve.memory.allocator.snapshot import read_trace

    ranked, why = recommend(read_trace(args.trace), parse_bytes(args.capacity), args.memory_fraction)
    if args.json:
        print(json.dumps({"recommendation": ranked[0].conf, "why": why, "ranked": [r.as_dict() for r in ranked]}))
        return 0
    mib = 1 << 20
    for r in ranked:
        oom = f"out of memory at event {r.oom_at_event}" if r.oom else f"{r.num_alloc_retries} retries"
        print(f"{(r.conf or 'default'):52s} peak reserved {r.peak_reserved_bytes / mib:10.1f} MiB  {oom}")
    print(why)
    return 0


def _cmd_memory_record(args: argparse.Namespace) -> int:
    from tailserve.bench.datasets import DatasetConfig, load_dataset
    from tailserve.engine.llm import LLM
    from tailserve.memory.allocator.record import record_generation_trace, write_jsonl
    from tailserve.sampling_params import SamplingParams

    llm = LLM(args.model, **_engine_kwargs(args))
    if llm.engine.tokenizer is None:
        raise ConfigError("memory record builds its prompts with the model's tokenizer; this model has none")
    prompts = [r.prompt for r in load_dataset(DatasetConfig(name="python", num_prompts=args.num_prompts,
                                                            input_len=args.input_len, seed=args.seed),
                                              llm.engine.tokenizer)]
    events = record_generation_trace(llm, prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0,
                                                                  ignore_eos=True))
    write_jsonl(events, args.out)
    allocs = [e for e in events if e.action == "alloc"]
    print(f"{len(events)} events ({len(allocs)} allocations, largest {max((e.size for e in allocs), default=0)} "
          f"bytes) from {args.num_prompts} prompts x {args.max_tokens} tokens: {args.out}")
    return 0


def _cmd_memory_analyze(args: argparse.Namespace) -> int:
    import json
    import pathlib

    from tailserve.memory.allocator.analyze import analyze_snapshot, format_report, html_report, segment_map_png
    from tailserve.memory.allocator.snapshot import load_snapshot

    snap = load_snapshot(args.snapshot)
    a = analyze_snapshot(snap, top=args.top)
    print(json.dumps(a.as_dict()) if args.json else format_report(a))
    if args.png:
        pathlib.Path(args.png).write_bytes(segment_map_png(snap))
        if not args.json:
            print(f"segment map: {args.png}")
    if args.html:
        pathlib.Path(args.html).write_text(html_report(a, snap, title=f"tailserve memory analysis: {args.snapshot}"))
        if not args.json:
            print(f"HTML page: {args.html}")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from tailserve.bench.main import run_bench, run_compare

    return run_compare(args) if getattr(args, "bench_command", None) == "compare" else run_bench(args)


def _cmd_demo(args: argparse.Namespace) -> int:
    from tailserve.demo.main import run_demo

    return run_demo(args)


def _option_actions(parser: argparse.ArgumentParser):
    """Every option of the parser and of its sub-commands, however deep."""
    stack = [parser]
    while stack:
        p = stack.pop()
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                stack.extend(action.choices.values())
            elif action.option_strings:
                yield action


def _help_for_defaults(parser: argparse.ArgumentParser) -> None:
    """Every option's help ends with its default (argparse shows none by itself, and its
    defaults formatter skips options without help text)."""
    for action in _option_actions(parser):
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in text or text == argparse.SUPPRESS:
            continue
        action.help = f"{text} (default: %(default)s)".strip()


def build_parser() -> argparse.ArgumentParser:
    import tailserve

    parser = argparse.ArgumentParser(prog="tailserve", description="LLM inference engine and performance toolkit")
    parser.add_argument("--version", action="version", version=f"tailserve {tailserve.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete prompts with a local model")
    gen.add_argument("prompts", nargs="+", help="prompt text(s)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default here)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--stats", action="store_true", help="print token counts and throughput on stderr")
    _add_engine_args(gen)
    gen.set_defaults(func=_cmd_generate)

    srv = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API (HTTP/1.1 and h2c)")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000, help="HTTP/1.1 (Uvicorn)")
    srv.add_argument("--http2-port", type=int, default=None,
                     help="cleartext HTTP/2 with prior knowledge, h2c (Hypercorn; also HTTP/1.1); "
                          "default: --port + 1, 0 = off")
    srv.add_argument("--served-model-name", nargs="+", default=None,
                     help="name(s) requests may use, the first is the main one (default: --model as given; the "
                          "checkpoint folder's name is always accepted too)")
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    srv.add_argument("--max-waiting-requests", type=int, default=256,
                     help="beyond this many waiting requests, answer 429 with Retry-After")
    srv.add_argument("--max-request-body", default="1MiB", help="larger bodies get 413")
    srv.add_argument("--disable-metrics", action="store_true")
    srv.add_argument("--no-warmup", action="store_true",
                     help="skip the start-up warm-up (one forward per decode batch size up to 32 and per "
                          "power-of-two prefill length up to 512), leaving its one-time costs to the first requests")
    srv.add_argument("--record-memory-history", action="store_true",
                     help="record the CUDA caching allocator's history from start-up, so memory snapshots "
                          "(POST /debug/memory/snapshot, tailserve memory snapshot) carry allocation sites")
    srv.add_argument("--ray-replicas", type=int, default=None, metavar="N",
                     help="run N engines as Ray Serve replicas behind one endpoint, with prefix-aware routing "
                          "(needs pip install 'tailserve[ray]'; see docs/scaling.md)")
    srv.add_argument("--gateway-metrics", action="store_true",
                     help="also export the load gauges Kubernetes inference gateways read, under vLLM's names "
                          "(vllm:num_requests_waiting, vllm:num_requests_running, vllm:kv_cache_usage_perc, "
                          "vllm:cache_config_info); see docs/scaling.md")
    srv.add_argument("--custom-histogram-buckets", default=None, metavar="JSON",
                     help="replace the default buckets of a family of Prometheus histograms (vLLM's flag), e.g. "
                          "'{\"request_latency\": [0.01, 0.05, 0.1, 0.25, 0.5, 1, 5, 30]}'; families: "
                          "request_latency, time_to_first_token, inter_token_latency, request_tokens, engine_step. "
                          "The vllm:* mirrors under --gateway-metrics follow")
    srv.add_argument("--enable-per-request-metrics", action="store_true",
                     help="also answer with vLLM's per-request 'metrics' object (queue_time_ms, "
                          "time_to_first_token_ms from scheduling, generation_time_ms, mean_itl_ms, "
                          "tokens_per_second) in the body, or in the final usage chunk when streaming, beside "
                          "tailserve's 'timing'; as vLLM, only for one prompt and one choice")
    srv.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                     help="export one OpenTelemetry span per request (phase events queued, scheduled, preempted, "
                          "first_token, finished; a child of the request's W3C traceparent) to this OTLP/HTTP "
                          "traces endpoint, e.g. http://127.0.0.1:4318/v1/traces (needs pip install "
                          "'tailserve[otel]')")
    srv.add_argument("--engine-loop", default="auto", choices=["auto", "inline", "thread"],
                     help="where the engine loop runs: inline = a task on the HTTP event loop's thread (steps and "
                          "streaming take turns, no hand-off between threads per token), thread = its own thread "
                          "(the event loop streams and accepts while a step runs); auto = inline on the CPU, "
                          "thread on a GPU")
    srv.add_argument("--access-log", action="store_true")
    srv.add_argument("--chat-template", default=None, metavar="FILE",
                     help="a Jinja chat template to use instead of the checkpoint's (it sees messages, tools, "
                          "add_generation_prompt, bos_token, eos_token)")
    srv.add_argument("--enable-auto-tool-choice", action="store_true",
                     help='answer tool_choice "auto" (the default when a request sends tools) by parsing the '
                          "model's own tool-call markup; needs --tool-call-parser")
    srv.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json", "mistral"],
                     help="the model family's tool-call markup: hermes (Qwen2.5/Qwen3, Hermes: <tool_call>...), "
                          "llama3_json (Llama 3.x JSON calls), mistral ([TOOL_CALLS])")
    srv.add_argument("--tool-call-kv-ttl", type=float, default=DEFAULT_TOOL_CALL_KV_TTL_S, metavar="SECONDS",
                     help="after a response that ends in a tool call, keep its KV blocks the last to be evicted "
                          f"for this long (the agent's next turn reuses them; default {DEFAULT_TOOL_CALL_KV_TTL_S:g}, "
                          "0: off)")
    srv.add_argument("--tool-pruning", default="off", choices=["off", "prune", "mask"],
                     help="the default for requests without tool_pruning: send only the most relevant tools "
                          "(prune: render only those, in catalogue order; mask: render all, allow calls to those "
                          "only); see docs/agents.md")
    srv.add_argument("--tool-pruning-max-tools", type=int, default=8, metavar="N",
                     help="tools kept by pruning when a request does not say (default 8)")
    _add_engine_args(srv)
    srv.set_defaults(func=_cmd_serve)

    from tailserve.bench.cli_args import add_bench_args, add_compare_args

    bench = sub.add_parser("bench", help="load-test any OpenAI-compatible server and say where each request's "
                                         "time went (no --url: starts tailserve serve itself)")
    add_bench_args(bench)
    bench_sub = bench.add_subparsers(dest="bench_command", required=False)
    cmp_ = bench_sub.add_parser("compare",
                                help="compare two result JSONs, flagging differences inside noise")
    add_compare_args(cmp_)
    bench.set_defaults(func=_cmd_bench)

    demo = sub.add_parser("demo", help="the three layers on the same load with and without each: where the tail "
                                       "comes from, speculative decoding, prefix caching, KV and allocator memory")
    demo.add_argument("--report-dir", default="tailserve-demo", help="where report.html and demo.json go")
    demo.add_argument("--quick", action="store_true", help="smaller loads (the tests, a first look)")
    demo.add_argument("--only", action="append", choices=["tail", "speculation", "prefix", "memory"], default=None,
                      help="run this act only (repeatable)")
    demo.add_argument("--model", default=None, help="a local checkpoint folder (default: the built-in target)")
    demo.add_argument("--speculative-model", default=None,
                      help="the draft for act 2 (default: the built-in draft with the built-in target, else "
                           "suffix decoding)")
    demo.set_defaults(func=_cmd_demo)

    mem = sub.add_parser("memory", help="PyTorch CUDA caching-allocator tools")
    mem_sub = mem.add_subparsers(dest="memory_command", required=True)
    sim = mem_sub.add_parser("simulate", help="replay an allocation trace through a model of the caching "
                                              "allocator, once per PYTORCH_CUDA_ALLOC_CONF")
    sim.add_argument("trace", help="JSONL trace ({action, addr, size, stream} per line) or a PyTorch memory "
                                   "snapshot pickle with device_traces")
    sim.add_argument("--conf", action="append", help="a PYTORCH_CUDA_ALLOC_CONF value (repeatable; default: "
                                                     "PyTorch's defaults)")
    sim.add_argument("--capacity", default="80GiB", help="device memory, units allowed (default 80GiB)")
    sim.add_argument("--memory-fraction", type=float, default=None,
                     help="as torch.cuda.set_per_process_memory_fraction (needed for garbage collection)")
    sim.add_argument("--alert-min-reserved", default="1GiB",
                     help="the monitor's reserved-bytes floor: the fragmentation alert is judged only while "
                          "reserved is at least this (default 1GiB, the monitor's own; a small CPU trace needs a "
                          "smaller one)")
    sim.add_argument("--json", action="store_true", help="one JSON object per configuration")
    sim.set_defaults(func=_cmd_memory_simulate)
    rec = mem_sub.add_parser("recommend", help="simulate candidate PYTORCH_CUDA_ALLOC_CONF settings on a trace "
                                               "and say which to use and why")
    rec.add_argument("trace", help="as for simulate")
    rec.add_argument("--capacity", required=True, help="device memory the workload must fit in, e.g. 80GiB")
    rec.add_argument("--memory-fraction", type=float, default=None)
    rec.add_argument("--json", action="store_true")
    rec.set_defaults(func=_cmd_memory_recommend)
    rec_t = mem_sub.add_parser("record", help="record the engine's own allocation trace (CPU, torch.profiler) "
                                               "for simulate / recommend")
    rec_t.add_argument("--out", required=True, help="JSONL trace to write")
    rec_t.add_argument("--num-prompts", type=int, default=16, help="Python prompts generated in one batch")
    rec_t.add_argument("--input-len", type=int, default=128, help="prompt tokens (at most)")
    rec_t.add_argument("--max-tokens", type=int, default=32)
    rec_t.set_defaults(func=_cmd_memory_record)
    _add_engine_args(rec_t)
    snp = mem_sub.add_parser("snapshot", help="fetch a CUDA memory snapshot from a running tailserve server "
                             "(needs its --api-key) and summarise it")
    snp.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    snp.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="the server's --api-key")
    snp.add_argument("-o", "--output", default="memory_snapshot.pickle", help="where to write the snapshot")
    snp.set_defaults(func=_cmd_memory_snapshot)
    ana = mem_sub.add_parser("analyze", help="explain a PyTorch memory snapshot: pools, stranded bytes, sites, a map")
    ana.add_argument("snapshot", help="a pickle from torch.cuda.memory._dump_snapshot (loaded as plain data only)")
    ana.add_argument("--png", help="also write the segment map as a PNG here")
    ana.add_argument("--html", help="also write one self-contained HTML page of the analysis here")
    ana.add_argument("--top", type=int, default=10, help="allocation sites to list")
    ana.add_argument("--json", action="store_true")
    ana.set_defaults(func=_cmd_memory_analyze)
    _help_for_defaults(parser)
    return parser


# Settings whose Python name differs from the flag in more than dashes.
_FIELD_FLAGS = {"kv_cache_memory_bytes": "--kv-cache-memory"}


def _name_flags(message: str, parser: argparse.ArgumentParser) -> str:
    """Say ``--max-tokens`` where an error names the Python field ``max_tokens``."""
    import re

    flags: dict[str, str] = {}
    for action in _option_actions(parser):
        if "_" in action.dest:
            flags.setdefault(action.dest, max(action.option_strings, key=len))
    flags.update(_FIELD_FLAGS)
    for name in sorted(flags, key=len, reverse=True):
        message = re.sub(rf"(?<![-\w]){re.escape(name)}(?![\w])", flags[name], message)
    return message


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except TailserveError as e:
        print(f"tailserve: error: {_name_flags(str(e), parser)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`tailserve generate ... | head`): stop quietly, as `cat` does.
        # Point stdout at /dev/null so the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
