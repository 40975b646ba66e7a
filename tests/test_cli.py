"""The command line: run as a user would (a subprocess) where the process itself is the point
(output, exit codes, a closed pipe, no torch import for --help); the one-line errors through
``tailserve.cli.main`` in this process (the same parser and handler, without an interpreter
start per case)."""

from __future__ import annotations

import subprocess
import sys

import pytest


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tailserve", *args], capture_output=True, text=True, timeout=300)


def run_in_process(capsys, *args: str) -> subprocess.CompletedProcess:
    """``tailserve ARGS`` through ``cli.main``: its exit status and what it printed."""
    from tailserve.cli import main

    capsys.readouterr()
    try:
        code = main(list(args))
    except SystemExit as e:  # argparse's own errors
        code = e.code if isinstance(e.code, int) else 2
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), code, out, err)


def test_generate_prints_completion(llama_checkpoint):
    path, _ = llama_checkpoint
    p = run("generate", "--model", str(path), "--max-tokens", "8", "--dtype", "float32",
            "--kv-cache-memory", "1MiB", "--ignore-eos", "--stats", "def add(a, b):")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("def add(a, b):")
    assert "8 output tokens" in p.stderr


def test_closed_stdout_stops_quietly(llama_checkpoint):
    """`tailserve generate ... | head`: the reader has gone; no traceback, the shell's 141."""
    path, _ = llama_checkpoint
    proc = subprocess.Popen([sys.executable, "-m", "tailserve", "generate", "--model", str(path), "--max-tokens", "8",
                             "--dtype", "float32", "--kv-cache-memory", "1MiB", "def add(a, b):"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # nobody will read the completion
    stderr = proc.stderr.read()
    proc.stderr.close()
    assert proc.wait(timeout=300) == 141
    assert "Traceback" not in stderr, stderr


def test_missing_model_is_one_line_error(tmp_path, capsys):
    p = run_in_process(capsys, "generate", "--model", str(tmp_path / "missing"), "hello")
    assert p.returncode == 2
    assert p.stderr.strip().count("\n") == 0
    assert p.stderr.startswith("tailserve: error:") and "not found" in p.stderr


def test_bad_sampling_value_is_one_line_error(llama_checkpoint, capsys):
    path, _ = llama_checkpoint
    p = run_in_process(capsys, "generate", "--model", str(path), "--temperature", "-1", "hi")
    assert p.returncode == 2 and "temperature must be >= 0" in p.stderr
    assert "Traceback" not in p.stderr


def _one_line_error(p: subprocess.CompletedProcess) -> str:
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert "Traceback" not in p.stderr and p.stderr.strip().count("\n") == 0, p.stderr
    return p.stderr


@pytest.mark.parametrize("flags, message", [
    (["--port", "65535"], "--port 65535 leaves no port for the h2c listener"),
    (["--port", "99999"], "--port 99999: a TCP port is 1-65535"),
    (["--port", "-1"], "--port -1: a TCP port is 1-65535"),
    (["--port", "8000", "--http2-port", "70000"], "--http2-port 70000"),
])
def test_bad_ports_are_one_line_errors(flags, message, capsys):
    assert message in _one_line_error(run_in_process(capsys, "serve", *flags))


def test_errors_name_the_flag_the_user_typed(llama_checkpoint, capsys):
    path, _ = llama_checkpoint

    def err(*args: str) -> str:
        return _one_line_error(run_in_process(capsys, "generate", "--model", str(path), *args, "hi"))

    assert "--max-tokens must be >= 1" in err("--max-tokens", "-1")
    assert "--max-num-seqs must be" in err("--max-num-seqs", "0")
    assert "--kv-cache-memory 1 holds no block" in err("--kv-cache-memory", "1")
    assert "--cuda-memory-fraction" in err("--cuda-memory-fraction", "2")


def test_version_and_help_show_defaults_without_importing_torch():
    p = run("--version")
    assert p.returncode == 0 and p.stdout.strip().startswith("tailserve 0.")
    probe = ("import sys\nfrom tailserve.cli import main\nfor argv in (['--help'], ['serve', '--help'], "
             "['bench', '--help']):\n    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
             "print('TORCH', 'torch' in sys.modules)\n")
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert "TORCH False" in p.stdout, p.stdout[-300:]
    assert "--max-num-seqs MAX_NUM_SEQS" in p.stdout and "(default: 256)" in p.stdout
    assert "(default: inf)" in p.stdout  # bench --request-rate


@pytest.mark.parametrize("flags, message", [
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
    (["--chat-template", "/nonexistent/template.jinja"], "--chat-template /nonexistent/template.jinja: cannot read"),
    (["--chat-template", "BAD"], "not a valid Jinja template"),
])
def test_tool_calling_flags_are_checked_before_loading(flags, message, capsys, tmp_path):
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m.content }}")  # no endfor
    flags = [str(bad) if f == "BAD" else f for f in flags]
    assert message in _one_line_error(run_in_process(capsys, "serve", *flags))


def test_a_bad_slo_is_one_line_error(capsys):
    p = run_in_process(capsys, "generate", "--speculative-method", "ngram", "--speculative-objective", "goodput",
                       "--slo", "p99_tpot_ms<40", "hi")
    assert "slo: expected KEY<=MS" in _one_line_error(p)


@pytest.mark.parametrize("name", ["max_long_partial_prefills", "max_num_partial_prefills"])
def test_the_prefill_limits_are_left_to_the_plan_only_when_serving(name):
    from tailserve.cli import _engine_kwargs, build_parser

    parser = build_parser()
    serve, gen = parser.parse_args(["serve"]), parser.parse_args(["generate", "x"])
    assert _engine_kwargs(serve, serving=True)[name] is None  # the plan's, on the CPU
    assert _engine_kwargs(gen)[name] == 0  # offline: every prompt of a batch at once
    told = parser.parse_args(["serve", "--" + name.replace("_", "-"), "0"])
    assert _engine_kwargs(told, serving=True)[name] == 0
