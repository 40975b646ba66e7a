"""``tailserve demo``: four acts, each an A/B on the same load, one table and one computed
verdict per act, one HTML report. ``--only ACT`` reruns one act, ``--quick`` is the smaller
load the tests use, ``--model DIR`` runs it on a user's checkpoint."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import pathlib
import platform
import time

from tailserve.assets import DEFAULT_TARGET_DIR
from tailserve.demo.acts import DemoSetup, act_memory, act_prefix, act_speculation, act_tail, plan_cpus
from tailserve.demo.report import html_report, render_act
from tailserve.errors import ConfigError
from tailserve.model.tokenizer import Tokenizer

ACTS = ("tail", "speculation", "prefix", "memory")


def cpu_line() -> str:
    from tailserve.engine.plan import Capabilities
    from tailserve.platform_info import cpu_flags

    name = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{name}, {cores} cores, {Capabilities(cpu_flags=cpu_flags()).cpu_capability}"


def run_demo(args: argparse.Namespace) -> int:
    only = args.only or list(ACTS)
    model_dir = str(args.model or DEFAULT_TARGET_DIR)
    if not pathlib.Path(model_dir, "config.json").is_file():
        raise ConfigError(f"--model {model_dir}: no config.json there (a local checkpoint folder is needed)")
    builtin = pathlib.Path(model_dir).resolve() == pathlib.Path(DEFAULT_TARGET_DIR).resolve()
    spec_model = args.speculative_model or ("builtin" if builtin else None)
    client_cpus, server_cpus = plan_cpus()
    setup = DemoSetup(model_dir=model_dir, tokenizer=Tokenizer(pathlib.Path(model_dir)), quick=args.quick,
                      speculative_model=spec_model, client_cpus=client_cpus, server_cpus=server_cpus,
                      log=lambda s: print(s, flush=True))
    report_dir = pathlib.Path(args.report_dir)
    report_dir.mkdir(parents=True, exist_ok=True)
    machine = cpu_line()
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    pin = (f"load generator on core {min(client_cpus)}, server on core(s) {','.join(map(str, server_cpus))}"
           if client_cpus and server_cpus else "client and server share the cores (fewer than two)")
    print(f"tailserve demo on {machine}, {when}; {pin}. Model: {model_dir}"
          + (" (the built-in 11M-parameter toy trained on the standard library: expect Python-shaped text)"
             if builtin else ""), flush=True)
    t0 = time.perf_counter()
    acts = []
    served = [a for a in only if a != "memory"]
    with contextlib.ExitStack() as stack:
        off = stack.enter_context(setup.server(["--no-enable-prefix-caching"])) if served else None
        for key in served:
            print(f"\n[{key}]", flush=True)
            if key == "tail":
                act = act_tail(setup, off)
            elif key == "speculation":
                act = act_speculation(setup, off)
            else:
                act = act_prefix(setup, off)
            acts.append(act)
            print(render_act(act), flush=True)
    if "memory" in only:
        print("\n[memory]", flush=True)
        act = act_memory(setup)
        acts.append(act)
        print(render_act(act), flush=True)
    total = time.perf_counter() - t0
    header = {"machine": machine, "date": when, "model": model_dir, "pinning": pin,
              "command": "tailserve demo" + (" --quick" if args.quick else "")
              + (f" --only {' '.join(only)}" if args.only else "") + (f" --model {args.model}" if args.model else ""),
              "total time": f"{total:.0f} s"}
    (report_dir / "demo.json").write_text(json.dumps({"header": header, "acts": [
        {"key": a.key, "title": a.title, "verdict": a.verdict, "figures": a.figures, "columns": a.columns,
         "rows": a.rows, "seconds": a.seconds} for a in acts]}, indent=1, default=str))
    (report_dir / "report.html").write_text(html_report(acts, header))
    print(f"\n{len(acts)} act(s) in {total:.0f} s. HTML report: {report_dir / 'report.html'}")
    return 0
