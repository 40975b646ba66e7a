"""Shared fixtures: tiny random-initialised Hugging Face checkpoints made on the fly, one
``tailserve serve`` and an engine cache for the session (per xdist worker).

Each checkpoint is created with transformers (a test-only dependency) and saved with
``save_pretrained``, so the loader is tested on exactly what users' checkpoints look like.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import sys
import threading
import time
from collections.abc import Iterator

# Under pytest-xdist the workers share the cores: each gets its share of intra-op threads
# (set before torch is imported, and inherited by the servers and ranks a test starts). Two
# workers running two OpenMP threads each on two cores spin against each other: the suite's
# CPU time rose by two thirds, its wall time by a fifth. Tests of multi-threaded kernels set
# their thread counts themselves.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // _WORKERS))
# Engines keep their thread count fixed in tests: tests that compare two engines' outputs must
# not see one of them re-size its thread pool because other tests load the machine (the
# governor itself is tested directly, tests/test_cpu_threads.py).
os.environ.setdefault("TAILSERVE_CPU_THREADS_ADAPT", "0")
# The suite starts some sixty Python processes (servers, ranks, the demo's servers). With
# PYTHONDONTWRITEBYTECODE set (as in this project's CI image) each recompiled tailserve's
# sources, ~0.4 s a start: cache the bytecode (__pycache__ is ignored by git).
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None) is not None:
    sys.dont_write_bytecode = False

import gc  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402 - imported once here, so that its objects are frozen below

# The imports' ~200k objects live as long as the worker: frozen, the collector's full passes
# (thousands of engine requests allocate enough to trigger them) no longer walk them, as
# `tailserve serve` does after start-up.
gc.collect()
gc.freeze()

TINY_VOCAB = 384
_CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "import os\nimport sys\nprint(os.getcwd())\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for i in range(10):\n    if i % 2 == 0:\n        continue\n    print(i)\n",
    "Unicode: héllo wörld ✓ 你好\n",
] * 20


def make_tokenizer(path: pathlib.Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_VOCAB - 16, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        '{"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}')


ARCHS = {
    "llama": dict(arch="LlamaForCausalLM"),
    "llama_tied": dict(arch="LlamaForCausalLM", tie_word_embeddings=True),
    "llama_rope_linear": dict(arch="LlamaForCausalLM", rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "llama_rope_llama3": dict(arch="LlamaForCausalLM", rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}),
    "llama_biases": dict(arch="LlamaForCausalLM", attention_bias=True, mlp_bias=True),
    "qwen2": dict(arch="Qwen2ForCausalLM"),
    "qwen3": dict(arch="Qwen3ForCausalLM"),
    "mistral": dict(arch="MistralForCausalLM", sliding_window=None),
}


def build_hf_model(kind: str, seed: int = 0, **overrides):
    spec = dict(ARCHS[kind])
    arch = spec.pop("arch")
    rope_scaling = spec.pop("rope_scaling", None)
    cfg_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    kw = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    if arch == "Qwen3ForCausalLM":
        kw["head_dim"] = 16
    kw.update(spec)
    kw.update(overrides)
    cfg = cfg_cls(**kw)
    if rope_scaling is not None:
        # transformers >= 5 reads rope_parameters; older versions read rope_scaling.
        params = {"rope_theta": 10000.0, **rope_scaling}
        if hasattr(cfg, "rope_parameters"):
            cfg.rope_parameters = params
        else:
            cfg.rope_scaling = params
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(cfg).eval()
    # Random init gives tiny logits; scale embeddings up so greedy choices are not near-ties.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.mul_(3.0)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.5)  # transformers initialises biases to zero: make them count
    return model


def save_checkpoint(model, path: pathlib.Path, dtype: torch.dtype = torch.float32, **save_kw) -> pathlib.Path:
    path.mkdir(parents=True, exist_ok=True)
    model.to(dtype).save_pretrained(path, safe_serialization=True, **save_kw)
    model.float()
    make_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """tiny_checkpoint(kind) -> (folder, transformers model in float32), cached per kind."""
    cache: dict[str, tuple[pathlib.Path, object]] = {}

    def get(kind: str = "llama"):
        if kind not in cache:
            model = build_hf_model(kind)
            path = save_checkpoint(model, tmp_path_factory.mktemp(kind))
            cache[kind] = (path, model)
        return cache[kind]

    return get


@pytest.fixture(scope="session")
def llama_checkpoint(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="session")
def tiny_server(llama_checkpoint):
    """One ``tailserve serve`` of the tiny Llama for the whole session (no warm-up), shared by
    the HTTP and fuzz tests whose flags agree: names "tiny" (reported) and "fuzz", gateway
    metrics, vLLM's per-request metrics, a 256 KiB body limit."""
    from tailserve.bench.local_server import LocalServer

    path, _ = llama_checkpoint
    with LocalServer(["--model", str(path), "--dtype", "float32", "--no-warmup", "--kv-cache-memory", "8MiB",
                      "--max-request-body", "256KiB", "--served-model-name", "tiny", "fuzz",
                      "--gateway-metrics", "--enable-per-request-metrics"]) as srv:
        yield srv


# A chat template in the Qwen2.5 / Hermes style (ChatML turns; tools listed in the system turn
# between <tools> tags; calls written as <tool_call>{"name", "arguments"}</tool_call>; tool
# results sent back in a user turn between <tool_response> tags), written for these tests.
QWEN_STYLE_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{{ messages[0].content if messages[0].role == 'system' else 'You are a helpful assistant.' }}

# Tools

You may call functions. Their signatures are between <tools></tools> tags:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

To call one, write <tool_call>{"name": <function-name>, "arguments": <args-json-object>}</tool_call>.<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'system' %}
{%- elif m.role == 'assistant' %}<|im_start|>assistant
{{ m.content }}
{%- for c in m.tool_calls or [] %}
<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@pytest.fixture(scope="session")
def chat_checkpoint(tmp_path_factory):
    """A tiny random Qwen2 with ChatML special tokens, <tool_call> markup tokens and the
    Qwen-style template above (chat_template.jinja), its EOS <|im_end|>: what an agent
    framework talks to (constrained decoding makes its forced calls valid whatever the weights)."""
    import json

    from tokenizers import AddedToken, Tokenizer

    path = tmp_path_factory.mktemp("chat_qwen")
    make_tokenizer(path)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens([AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)])
    tok.add_tokens([AddedToken("<tool_call>", special=False), AddedToken("</tool_call>", special=False)])
    eos = tok.token_to_id("<|im_end|>")
    model = build_hf_model("qwen2", eos_token_id=eos, bos_token_id=None, max_position_embeddings=8192)
    model.save_pretrained(path, safe_serialization=True)
    tok.post_processor = None
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>"}))
    (path / "chat_template.jinja").write_text(QWEN_STYLE_TEMPLATE)
    return path


@pytest.fixture(scope="session")
def tool_server(chat_checkpoint):
    """``tailserve serve`` of the chat checkpoint with auto tool choice (hermes parser), shared
    by the tool-calling and structured-output HTTP tests."""
    from tailserve.bench.local_server import LocalServer

    with LocalServer(["--model", str(chat_checkpoint), "--dtype", "float32", "--no-warmup", "--kv-cache-memory",
                      "16MiB", "--served-model-name", "qwen-tiny", "--enable-auto-tool-choice",
                      "--tool-call-parser", "hermes"]) as srv:
        yield srv


@pytest.fixture(scope="session")
def engine_cache():
    """engine_cache(**llm_kwargs) -> an ``LLM``, one per distinct configuration for the whole
    session (tests that only read or generate share it instead of loading their own)."""
    from tailserve import LLM
    from tailserve.config import EngineConfig

    cache: dict[EngineConfig, object] = {}

    def get(**kwargs):
        key = EngineConfig(model=str(kwargs.pop("model", None) or "builtin"), **kwargs)
        if key not in cache:
            cache[key] = LLM(key.model, **kwargs)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def llm_builtin_spec(engine_cache):
    """The built-in pair with draft-model speculation (k fixed at 3), shared by the session."""
    return engine_cache(speculative_model="builtin", num_speculative_tokens=3)


@pytest.fixture(scope="session")
def noisy_draft(tmp_path_factory):
    """The tiny Llama's weights plus noise: a draft that agrees often but not always, so both
    acceptance and rejection (with KV rollback) are exercised."""
    hf = build_hf_model("llama")
    g = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn(p.shape, generator=g) * p.std() * 0.15)
    return save_checkpoint(hf, tmp_path_factory.mktemp("noisy_draft"))


@pytest.fixture
def headless_chromium(tmp_path):
    """A Selenium driver for Debian's Chromium, headless (CI installs chromium and
    chromium-driver; elsewhere the test is skipped when they are missing)."""
    import os
    import shutil

    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    chromedriver = shutil.which("chromedriver")
    if not (browser and chromedriver):
        if os.environ.get("CI"):
            pytest.fail("CI must install Debian's chromium and chromium-driver (.ci/run does)")
        pytest.skip("chromium / chromedriver not installed (apt-get install chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = browser
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--no-first-run", f"--user-data-dir={tmp_path / 'chromium-profile'}"):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # console messages: driver.get_log("browser")
    driver = webdriver.Chrome(service=Service(chromedriver), options=opts)
    try:
        yield driver
    finally:
        driver.quit()


@contextlib.contextmanager
def serve_in_thread(server) -> Iterator[str]:
    """A real HTTP server on 127.0.0.1 for an in-process ``Server`` (so a test can reach into
    its engine: a stand-in, an injected fault); yields its URL, stops it and its engine after.

    A ``Server(start_engine_thread=True)`` keeps its engine loop on its own thread (the
    "thread" engine loop); with ``start_engine_thread=False`` the engine loop runs inline, a
    task on the server's event loop (as ``tailserve serve`` on the CPU)."""
    import asyncio

    import uvicorn

    from tailserve.bench.local_server import free_port
    from tailserve.server.app import build_app

    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(build_app(server), host="127.0.0.1", port=port, log_level="warning"))
    if server.async_engine._thread is None:
        async def both() -> None:
            engine = asyncio.ensure_future(server.async_engine.run_in_loop())
            try:
                await srv.serve()
            finally:
                server.async_engine.shutdown()
                await engine

        thread = threading.Thread(target=asyncio.run, args=(both(),), daemon=True)
    else:
        thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not srv.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("the in-process server did not start")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(timeout=10)
        server.async_engine.shutdown()


class OTLPCollector:
    """An OTLP/HTTP traces collector on 127.0.0.1 (stdlib HTTP server): ``url`` to export to,
    ``spans()`` the spans received so far, decoded with OpenTelemetry's protobuf types."""

    def __init__(self) -> None:
        import http.server

        received = self.received = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                received.append((self.path, self.headers.get("Content-Type"), body))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1/traces"

    def spans(self) -> list:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        out = []
        for path, ctype, body in list(self.received):
            assert path == "/v1/traces" and ctype == "application/x-protobuf", (path, ctype)
            req = ExportTraceServiceRequest()
            req.ParseFromString(body)
            out += [s for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]
        return out

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
