"""int8 targets: weight-only (``--quantization int8``, model/linear.py
Int8WeightOnlyLinearMethod) and with int8 activations (``w8a8_int8``,
Int8DynamicActivationLinearMethod): the per-row quantisation, the product it computes, and the
engine on it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tailserve import LLM, SamplingParams
from tailserve.config import EngineConfig
from tailserve.errors import ConfigError
from tailserve.kernels import cpu as cpu_kernels
from tailserve.model.linear import Int8WeightOnlyLinearMethod, Linear, build_linear_method
from tailserve.model.loader import load_model


def test_rows_are_quantised_symmetrically_within_half_a_step():
    torch.manual_seed(0)
    w = torch.randn(48, 96) * torch.linspace(0.01, 5.0, 48)[:, None]  # rows of very different ranges
    w[3] = 0.0  # an all-zero row must not divide by zero
    q, scales = Int8WeightOnlyLinearMethod.quantize(w)
    assert q.dtype == torch.int8 and scales.shape == (48,)
    assert q.abs().max() <= 127 and (q.abs().amax(1)[torch.arange(48) != 3] == 127).all()
    err = (q.float() * scales[:, None] - w).abs()
    assert (err <= scales[:, None] / 2 + 1e-6).all()  # round to nearest: at most half a step per element
    assert (q[3] == 0).all()


def _layer(w: torch.Tensor, bias: torch.Tensor | None, method) -> Linear:
    layer = Linear(w.shape[0], w.shape[1], bias is not None)
    layer.weight = torch.nn.Parameter(w.clone(), requires_grad=False)
    if bias is not None:
        layer.bias = torch.nn.Parameter(bias.clone(), requires_grad=False)
    layer.set_method(method)
    return layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_the_product_is_that_of_the_dequantised_weight(dtype, rows):
    torch.manual_seed(1)
    w, b = torch.randn(40, 64).to(dtype), torch.randn(40).to(dtype)
    x = torch.randn(rows, 64).to(dtype)
    layer = _layer(w, b, Int8WeightOnlyLinearMethod())
    assert layer.weight.device.type == "meta" and layer.qweight.dtype == torch.int8  # no full-precision copy kept
    q, scales = Int8WeightOnlyLinearMethod.quantize(w)
    want = F.linear(x.float(), q.float() * scales[:, None], b.float())
    got = layer.forward(x)
    assert got.dtype == dtype and got.shape == (rows, 40)
    # The kernel multiplies in bf16 on the CPU: bf16's rounding of x and of the sum bound the error.
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=5e-2)
    # The dequantise-per-call fallback computes the same product.
    layer.use_int8_kernel = False
    layer.scales = scales.to(dtype)
    torch.testing.assert_close(layer.forward(x).float(), want, rtol=2e-2, atol=5e-2)


def test_an_unknown_quantization_is_refused():
    with pytest.raises(ConfigError, match="quantization"):
        EngineConfig(model="builtin", quantization="int4")
    with pytest.raises(ValueError, match="unknown linear method"):
        build_linear_method("int4-weight-only")


def _prompt_logits(model, cfg) -> torch.Tensor:
    """The logits of a 40-token prompt (the same random ids for every model) in one forward."""
    from tailserve.attention.reference import build_attention_metadata

    ids = torch.randint(0, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(2))
    caches = [torch.zeros(2, 5, 16, cfg.num_kv_heads, cfg.head_dim) for _ in range(cfg.num_layers)]
    meta = build_attention_metadata([40], [40], [list(range(5))], 16, cfg.sliding_window, torch.device("cpu"))
    with torch.inference_mode():
        return model.compute_logits(model(ids, torch.arange(40), caches, meta))


@pytest.mark.parametrize("kind", ["llama", "qwen2", "llama_tied"])
def test_the_int8_model_stays_close_to_the_full_precision_one(tiny_checkpoint, kind):
    """Every projection and the LM head go int8 (biases and norms stay); the logits move by
    a small fraction of their spread, and most greedy choices are unchanged."""
    path, _ = tiny_checkpoint(kind)
    full, cfg = load_model(path, torch.float32, linear_method=build_linear_method("plain"))
    q8, _ = load_model(path, torch.float32, linear_method=build_linear_method("int8-weight-only"))
    linears = [m for m in q8.modules() if isinstance(m, Linear)]
    assert linears and all(m.method.name == "int8-weight-only" and m.qweight is not None for m in linears)
    a, b = (_prompt_logits(m, cfg) for m in (full, q8))
    assert ((b - a).abs().mean() / a.std()) < 0.05
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.85


needs_kernels = pytest.mark.skipif(cpu_kernels.kernels() is None, reason="compiled CPU kernels unavailable")


@needs_kernels
@pytest.mark.parametrize("kind", ["llama", "llama_tied"])
def test_the_w8a8_model_stays_close_to_the_full_precision_one(tiny_checkpoint, kind):
    """int8 weights and per-row int8 activations in every projection and the LM head: the
    logits move more than weight-only int8's, still by a small fraction of their spread."""
    path, _ = tiny_checkpoint(kind)
    full, cfg = load_model(path, torch.float32, linear_method=build_linear_method("plain"))
    w8a8, _ = load_model(path, torch.float32, linear_method=build_linear_method("int8-w8a8", cpu_kernels.kernels()))
    assert all(m.method.name == "int8-w8a8" for m in w8a8.modules() if isinstance(m, Linear))
    a, b = (_prompt_logits(m, cfg) for m in (full, w8a8))
    assert ((b - a).abs().mean() / a.std()) < 0.08
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.8


@needs_kernels
def test_the_engine_serves_a_w8a8_model_losslessly_under_speculation(tiny_checkpoint, noisy_draft):
    """--quantization w8a8_int8 (its plan says so): speculative decoding over it gives its own
    greedy tokens; refused where the compiled kernels cannot run it."""
    path, _ = tiny_checkpoint("llama")
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    kw = dict(dtype="float32", kv_cache_memory_bytes=2 << 20, quantization="w8a8_int8")
    plain = LLM(str(path), **kw)
    assert plain.engine.health()["plan"]["linear"].startswith("int8-w8a8 (--quantization w8a8_int8")
    want = plain.generate([[5, 6, 7, 8]], params)[0].token_ids
    spec = LLM(str(path), speculative_model=str(noisy_draft), num_speculative_tokens=3, **kw)
    assert spec.engine.core.worker.linear_method.name == "int8-w8a8"
    assert spec.generate([[5, 6, 7, 8]], params)[0].token_ids == want
    with pytest.raises(ConfigError, match="compiled CPU kernels"):
        LLM(str(path), cpu_kernels=False, **kw)
    with pytest.raises(ConfigError, match="float32 model"):
        LLM(str(path), **{**kw, "dtype": "bfloat16"})
    with pytest.raises(ConfigError, match="needs device cpu"):
        EngineConfig(model="builtin", device="cuda", quantization="w8a8_int8")


def test_the_engine_serves_an_int8_model_and_a_full_precision_draft(tiny_checkpoint, noisy_draft):
    path, _ = tiny_checkpoint("llama")
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    kw = dict(dtype="float32", kv_cache_memory_bytes=2 << 20, quantization="int8")
    plain_q8 = LLM(str(path), **kw).generate([[5, 6, 7, 8]], params)[0].token_ids
    spec = LLM(str(path), speculative_model=str(noisy_draft), num_speculative_tokens=3, **kw)
    worker = spec.engine.core.worker
    assert worker.linear_method.name == "int8-weight-only"
    assert worker.draft_linear_method.name != "int8-weight-only"  # the draft keeps its precision
    # Speculative decoding stays lossless over the int8 target: the same greedy tokens.
    assert spec.generate([[5, 6, 7, 8]], params)[0].token_ids == plain_q8
