"""The compiled CPU kernels (kernels/cpu): compact-weight products with float32
arithmetic, the build and its fallbacks, and the linear methods that use them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tailserve.kernels import cpu as cpu_kernels
from tailserve.model.linear import Int8WeightOnlyLinearMethod, Linear, build_linear_method
from tailserve.model.loader import load_model
from tailserve.platform_info import cpu_flags

KERNELS = cpu_kernels.kernels()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason=f"compiled CPU kernels: {cpu_kernels.unavailable_reason()}")


@needs_kernels
@pytest.mark.parametrize("fmt", [torch.bfloat16, torch.float16, torch.int8])
@pytest.mark.parametrize("m, n, k", [(1, 1, 8), (1, 67, 64), (2, 5, 520), (3, 64, 64), (16, 130, 136), (17, 9, 8),
                                     (5, 7, 24), (8, 4, 16)])
@pytest.mark.parametrize("threads", [1, 2])
def test_each_format_computes_the_widened_product(fmt, m, n, k, threads):
    """Every row count (4-row blocks and the rows left over), every column count (3-row
    blocks and the rows left over per thread) and thread count gives F.linear of the
    widened weight."""
    g = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    x = torch.randn(m, k, generator=g)
    if fmt == torch.int8:
        w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        scale = torch.rand(n, generator=g) + 0.01
        want = F.linear(x, w.float()) * scale
    else:
        w = torch.randn(n, k, generator=g).to(fmt)
        scale = None
        want = F.linear(x, w.float())
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = KERNELS.gemm(x, w, scale)
    finally:
        torch.set_num_threads(before)
    assert got.shape == (m, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4 * k ** 0.5)


@needs_kernels
@pytest.mark.parametrize("n, k", [(1, 8), (67, 64), (5, 520), (130, 136), (48, 3)])
@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_packed_in_panels_computes_the_widened_product(n, k, threads):
    """Every tile of the outer-product kernel (1 row over 4 panels, 2 and 3 rows over 2, tiles
    of 4-6 rows over one, the panels left over), N cut inside a panel, K of any size, and each
    thread count: F.linear of the widened weight. The layout unpacks to the weight."""
    g = torch.Generator().manual_seed(n * 10 + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    packed = cpu_kernels.pack_panels(w)
    assert packed.shape == (n, k) and torch.equal(packed.unpack(), w)
    assert packed.data.numel() * 4 == -(-n // 16) * 16 * k * 2  # the bf16 bytes, N rounded up to 16
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for m in (1, 2, 3, 4, 5, 6, 7, 13, 16, 17, 130):
            x = torch.randn(m, k, generator=g)
            got = KERNELS.gemm(x, packed)
            assert got.shape == (m, n) and got.dtype == torch.float32
            torch.testing.assert_close(got, F.linear(x, w.float()), rtol=1e-5, atol=1e-4 * k ** 0.5)
    finally:
        torch.set_num_threads(before)


@needs_kernels
def test_panels_refuse_what_they_cannot_hold():
    with pytest.raises(ValueError, match="bf16"):
        cpu_kernels.pack_panels(torch.randn(4, 8))
    packed = cpu_kernels.pack_panels(torch.randn(4, 8).bfloat16())
    with pytest.raises(ValueError, match="row scales"):
        KERNELS.gemm(torch.randn(1, 8), packed, torch.ones(4))
    with pytest.raises(ValueError, match="float32 x"):
        KERNELS.gemm(torch.randn(1, 16), packed)


@needs_kernels
def test_a_rows_product_in_panels_does_not_depend_on_its_batch():
    """Bitwise, through every tile shape up to a prompt's 140 rows: a row's product is the
    same alone, in a decode batch or in a prompt (each output sums in k order)."""
    g = torch.Generator().manual_seed(2)
    n, k = 83, 200
    packed = cpu_kernels.pack_panels(torch.randn(n, k, generator=g).bfloat16())
    x = torch.randn(140, k, generator=g)
    alone = torch.cat([KERNELS.gemm(x[i : i + 1], packed) for i in range(140)])
    for m in (*range(2, 18), 31, 64, 65, 140):
        assert torch.equal(KERNELS.gemm(x[:m], packed), alone[:m]), m


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2])
def test_the_avx512_tiles_give_the_avx2_tiles_bits(threads):
    """Where the CPU has AVX-512, panel products of 3+ rows run 512-bit tiles (R rows x 4 panels,
    lanes widened out of column order and put back at the store); each output is still one
    accumulator in k order, so every row count gives the AVX2 tiles' bits, N cut inside a panel
    and with panels left over past the groups of 4. Elsewhere the switch stays off."""
    has = {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= cpu_flags()
    before, threads_before = KERNELS.wide_tiles, torch.get_num_threads()
    try:
        assert KERNELS.set_wide_tiles(True) == has
        if not has:
            pytest.skip("the CPU has no AVX-512")
        torch.set_num_threads(threads)
        g = torch.Generator().manual_seed(44)
        for n, k in ((16 * 7 + 5, 72), (640, 384), (40, 1032)):
            packed = cpu_kernels.pack_panels(torch.randn(n, k, generator=g).bfloat16())
            x = torch.randn(40, k, generator=g)
            for m in (*range(1, 20), 40):
                KERNELS.set_wide_tiles(True)
                wide = KERNELS.gemm(x[:m], packed)
                KERNELS.set_wide_tiles(False)
                assert torch.equal(wide, KERNELS.gemm(x[:m], packed)), (n, k, m)
    finally:
        KERNELS.set_wide_tiles(before)
        torch.set_num_threads(threads_before)


@needs_kernels
@pytest.mark.parametrize("fmt", [torch.bfloat16, torch.int8])
def test_a_rows_product_does_not_depend_on_its_batch(fmt):
    """Bitwise: each row of an M-row product equals that row alone, for every M and every
    position in the blocks, so a request's logits do not depend on what shares its step."""
    g = torch.Generator().manual_seed(1)
    n, k = 41, 200
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8) if fmt == torch.int8 \
        else torch.randn(n, k, generator=g).to(fmt)
    scale = torch.rand(n, generator=g) + 0.01 if fmt == torch.int8 else None
    x = torch.randn(17, k, generator=g)
    alone = torch.cat([KERNELS.gemm(x[i : i + 1], w, scale) for i in range(17)])
    for m in range(1, 18):
        assert torch.equal(KERNELS.gemm(x[:m], w, scale), alone[:m]), m


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2])
def test_int8_panels_compute_the_scaled_product_the_same_for_every_batch_and_tile(threads):
    """Weight-only int8 in 16-column panels (a draft's small batches): the layout round-trips,
    the product is x @ (q * scale)^T, a row's output is bitwise the same alone or in any batch
    of up to 20 rows (N cut inside a panel, panels left over past the groups of 4), and where
    the CPU has AVX-512 its tiles give the AVX2 tiles' bits."""
    has = {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= cpu_flags()
    before, threads_before = KERNELS.wide_tiles, torch.get_num_threads()
    g = torch.Generator().manual_seed(45)
    try:
        torch.set_num_threads(threads)
        for n, k in ((16 * 7 + 5, 72), (640, 384), (33, 24)):
            q, scale = Int8WeightOnlyLinearMethod.quantize(torch.randn(n, k, generator=g))
            packed = cpu_kernels.pack_panels_int8(q, scale)
            back_q, back_scale = packed.unpack()
            assert torch.equal(back_q, q) and torch.equal(back_scale, scale)
            assert cpu_kernels.weight_format(packed) == cpu_kernels.PANEL_PACKED_INT8
            x = torch.randn(20, k, generator=g)
            ref = x.double() @ (q.double() * scale.double()[:, None]).T
            results = {}
            for wide in ((True, False) if has else (False,)):
                KERNELS.set_wide_tiles(wide)
                alone = torch.cat([KERNELS.gemm(x[i : i + 1], packed) for i in range(20)])
                torch.testing.assert_close(alone.double(), ref, rtol=1e-5, atol=1e-4)
                for m in range(2, 21):
                    assert torch.equal(KERNELS.gemm(x[:m], packed), alone[:m]), (n, k, m, wide)
                results[wide] = alone
            if has:
                assert torch.equal(results[True], results[False])
        with pytest.raises(ValueError, match="carry their own scales"):
            KERNELS.gemm(torch.randn(1, 24), cpu_kernels.pack_panels_int8(*Int8WeightOnlyLinearMethod.quantize(
                torch.randn(4, 24))), torch.ones(4))
        with pytest.raises(ValueError, match="int8 weight"):
            cpu_kernels.pack_panels_int8(torch.randn(4, 8), torch.ones(4))
    finally:
        KERNELS.set_wide_tiles(before)
        torch.set_num_threads(threads_before)


def w8a8_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The W8A8 products' definition (kernels.cpu ``tailserve_gemm_w8a8p``): each row of x
    quantised by 127 / max|row| (round half to even, in [-127, 127]), the int8 products summed
    exactly, then times the row's max|row| / 127 and the column's scale, in float32."""
    amax = x.abs().amax(1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    xq = torch.round(x * inv[:, None]).clamp(-127, 127).to(torch.int64)
    acc = xq @ q.to(torch.int64).T  # exact
    return (acc.float() * (amax / 127.0)[:, None]) * scale[None, :]


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2])
def test_w8a8_panels_are_the_quantised_product_bitwise_for_every_batch_and_tile(threads):
    """int8 weights and per-row int8 activations (a draft's products): the layout round-trips
    (K padded to 4, column sums after the panels), every output is bitwise the definition's
    (``w8a8_reference``), for 1-20 rows and past the parallel threshold, N cut inside a panel,
    K not a multiple of 4 or 8, a row of zeros; so a row alone equals it in any batch, and the
    AVX-512 VNNI tiles give the AVX2 tiles' bits."""
    has = {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= cpu_flags()
    before, threads_before = KERNELS.wide_tiles, torch.get_num_threads()
    g = torch.Generator().manual_seed(46)
    try:
        torch.set_num_threads(threads)
        for n, k, m in ((16 * 7 + 5, 72, 20), (4096, 256, 5), (33, 37, 9), (1300, 640, 3)):
            q, scale = Int8WeightOnlyLinearMethod.quantize(torch.randn(n, k, generator=g))
            packed = cpu_kernels.pack_panels_w8a8(q, scale)
            back_q, back_scale = packed.unpack()
            assert torch.equal(back_q, q) and torch.equal(back_scale, scale) and packed.shape == (n, k)
            assert torch.equal(packed.column_sums()[:n], q.sum(1, dtype=torch.int32))
            assert cpu_kernels.weight_format(packed) == cpu_kernels.PANEL_PACKED_W8A8
            x = torch.randn(m, k, generator=g) * 4
            x[1 % m] = 0.0
            want = w8a8_reference(x, q, scale)
            for wide in ((True, False) if has else (False,)):
                KERNELS.set_wide_tiles(wide)
                assert torch.equal(KERNELS.gemm(x, packed), want), (n, k, wide)
                for i in (0, m - 1):
                    assert torch.equal(KERNELS.gemm(x[i : i + 1], packed)[0], want[i])
        with pytest.raises(ValueError, match="carry their own scales"):
            KERNELS.gemm(torch.randn(1, k), packed, torch.ones(n))
        with pytest.raises(ValueError, match=r"\[-127, 127\]"):
            cpu_kernels.pack_panels_w8a8(torch.full((4, 8), -128, dtype=torch.int8), torch.ones(4))
    finally:
        KERNELS.set_wide_tiles(before)
        torch.set_num_threads(threads_before)


@needs_kernels
def test_a_w8a8_layer_quantises_its_activations_per_row():
    """``Int8DynamicActivationLinearMethod`` on a float32 layer: int8 panels for the W8A8
    kernel are its only copy; its output is the definition's for any batch, a row alone
    included, and stays close to the weight-only product (the activations' rounding)."""
    from tailserve.model.linear import Int8DynamicActivationLinearMethod

    g = torch.Generator().manual_seed(47)
    w, b = torch.randn(40, 64, generator=g), torch.randn(40, generator=g)
    layer = Linear(40, 64, True)
    layer.weight = torch.nn.Parameter(w.clone(), requires_grad=False)
    layer.bias = torch.nn.Parameter(b.clone(), requires_grad=False)
    layer.set_method(Int8DynamicActivationLinearMethod(KERNELS))
    assert isinstance(layer.qweight, cpu_kernels.PanelPackedW8A8Weight) and layer.weight.device.type == "meta"
    q, scale = Int8WeightOnlyLinearMethod.quantize(w)
    x = torch.randn(200, 64, generator=g)
    full = layer.forward(x)
    assert torch.equal(full, w8a8_reference(x, q, scale) + b)
    assert torch.equal(layer.forward(x[7:8])[0], full[7])
    weight_only = F.linear(x, q.float() * scale[:, None], b)
    assert float((full - weight_only).norm() / weight_only.norm()) < 0.01  # ~1/254 of a row's range per input
    with pytest.raises(ValueError, match="compiled CPU kernels"):
        Int8DynamicActivationLinearMethod(None)


@needs_kernels
def test_an_int8_layer_in_panels_multiplies_every_batch_through_them():
    """``Int8WeightOnlyLinearMethod(kernels, panel_packed=True)`` on a float32 layer: the panels
    are its only int8 copy, and every batch, a prompt's too, goes through them: a row alone
    equals it in any batch, and the product is that of the dequantised weight."""
    w = torch.randn(40, 64)
    b = torch.randn(40)
    layer = Linear(40, 64, True)
    layer.weight = torch.nn.Parameter(w.clone(), requires_grad=False)
    layer.bias = torch.nn.Parameter(b.clone(), requires_grad=False)
    layer.set_method(Int8WeightOnlyLinearMethod(KERNELS, panel_packed=True))
    assert isinstance(layer.qweight, cpu_kernels.PanelPackedInt8Weight) and layer.qpanels is layer.qweight
    assert layer.weight.device.type == "meta"
    q, scale = Int8WeightOnlyLinearMethod.quantize(w)
    x = torch.randn(200, 64)
    full = layer.forward(x)
    torch.testing.assert_close(full, F.linear(x, q.float() * scale[:, None], b), rtol=1e-5, atol=1e-4)
    for i in (0, 15, 199):
        assert torch.equal(layer.forward(x[i : i + 1])[0], full[i])


def test_the_build_falls_back_with_a_reason(monkeypatch, tmp_path):
    monkeypatch.setenv("TAILSERVE_CPU_KERNELS", "0")
    assert cpu_kernels._build() == (None, "TAILSERVE_CPU_KERNELS=0")
    monkeypatch.delenv("TAILSERVE_CPU_KERNELS")
    monkeypatch.setenv("TAILSERVE_CACHE_DIR", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("PATH", str(tmp_path))  # no compiler anywhere
    monkeypatch.delenv("CC", raising=False)
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        assert cpu_kernels._build() == (None, "no C compiler found ($CC, cc, gcc, clang)")


def test_an_unwritable_cache_folder_falls_back_with_a_reason(monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("TAILSERVE_CACHE_DIR", str(blocker / "kernels"))  # under a file: mkdir fails
    monkeypatch.setattr(cpu_kernels, "_state", {})
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") and cpu_kernels._compiler():
        assert cpu_kernels.kernels() is None
        assert cpu_kernels.unavailable_reason().startswith("building the kernels failed")


@needs_kernels
def test_a_fresh_cache_builds_the_library_once(monkeypatch, tmp_path):
    monkeypatch.setenv("TAILSERVE_CACHE_DIR", str(tmp_path))
    k, why = cpu_kernels._build()
    assert k is not None and why == ""
    (built,) = tmp_path.glob("gemv_avx2-*.so")
    mtime = built.stat().st_mtime_ns
    assert cpu_kernels._build()[0] is not None and built.stat().st_mtime_ns == mtime  # reused, not rebuilt


@needs_kernels
@pytest.mark.parametrize("kind", ["llama", "qwen2", "llama_tied"])
def test_compact_weights_give_the_float32_model_of_a_bf16_checkpoint(tmp_path, kind):
    """bf16 -> float32 is exact, so keeping a bf16 checkpoint's weights in bf16 and computing
    in float32 is the float32 model of that checkpoint, decode rows and prefill rows alike."""
    from conftest import build_hf_model, save_checkpoint
    from tailserve.attention.reference import build_attention_metadata

    # A model of its own: saving in bf16 rounds the weights of the model it is given.
    path = save_checkpoint(build_hf_model(kind), tmp_path / "bf16", dtype=torch.bfloat16)
    cpu = torch.device("cpu")
    full, cfg = load_model(path, torch.float32, linear_method=build_linear_method("plain"))
    method = build_linear_method("cpu-compact-weights", KERNELS, torch.bfloat16)
    assert method.name == "cpu-compact-weights"
    compact, _ = load_model(path, torch.float32, linear_method=method)
    linears = [m for m in compact.modules() if isinstance(m, Linear)]
    assert all(m.method.name == "cpu-compact-weights" and m.qweight.dtype == torch.bfloat16 for m in linears)
    g = torch.Generator().manual_seed(4)
    for n in (1, 5, 40):  # kernel rows (<= 16) and widened-weight rows (> 16)
        ids = torch.randint(0, cfg.vocab_size, (n,), generator=g)
        outs = []
        for model in (full, compact):
            caches = [torch.zeros(2, 4, 16, cfg.num_kv_heads, cfg.head_dim) for _ in range(cfg.num_layers)]
            meta = build_attention_metadata([n], [n], [list(range(4))], 16, cfg.sliding_window, cpu)
            with torch.inference_mode():
                outs.append(model.compute_logits(model(ids, torch.arange(n), caches, meta)))
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)


@needs_kernels
def test_auto_on_a_cpu_without_native_bf16_keeps_the_checkpoint_compact(tmp_path):
    from conftest import build_hf_model, save_checkpoint
    from tailserve import LLM, SamplingParams
    from tailserve.platform_info import resolve_auto_dtype

    path = save_checkpoint(build_hf_model("llama"), tmp_path / "bf16", dtype=torch.bfloat16)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9] * 3, [11, 12, 13]]
    want = [o.token_ids for o in LLM(str(path), dtype="float32", kv_cache_memory_bytes=2 << 20)
            .generate(prompts, params)]
    auto = LLM(str(path), kv_cache_memory_bytes=2 << 20)
    worker = auto.engine.core.worker
    # With the kernels, auto computes in float32 over the compact weights on every CPU (on one
    # with native bf16 too: the kernels decode faster); only the native one multiplies prefill
    # chunks above 16 rows in bf16, so only elsewhere are the outputs the float32 model's exactly.
    assert worker.linear_method.name == "cpu-compact-weights"
    assert "weights kept in bfloat16" in worker.dtype_reason
    if resolve_auto_dtype(torch.bfloat16, torch.device("cpu"))[0] == torch.float32:
        assert not worker.linear_method.native_large_batches
        assert [o.token_ids for o in auto.generate(prompts, params)] == want
    else:
        assert worker.linear_method.native_large_batches
    off = LLM(str(path), kv_cache_memory_bytes=2 << 20, cpu_kernels=False)
    assert off.engine.core.worker.linear_method.name != "cpu-compact-weights"


@needs_kernels
def test_int8_with_float32_activations_uses_the_compiled_kernel_for_small_batches():
    torch.manual_seed(3)
    w, b = torch.randn(36, 64), torch.randn(36)
    layer = Linear(36, 64, True)
    layer.weight = torch.nn.Parameter(w.clone(), requires_grad=False)
    layer.bias = torch.nn.Parameter(b.clone(), requires_grad=False)
    layer.set_method(Int8WeightOnlyLinearMethod(KERNELS))
    assert layer.scales_f32 is not None
    q, scales = Int8WeightOnlyLinearMethod.quantize(w)
    for rows in (1, 16):  # the kernel, float32 throughout: tight
        x = torch.randn(rows, 64)
        torch.testing.assert_close(layer.forward(x), F.linear(x, q.float() * scales[:, None], b), rtol=1e-5,
                                   atol=1e-4)
    x = torch.randn(17, 64)  # beyond SMALL_BATCH: PyTorch's kernel, bf16 inside
    torch.testing.assert_close(layer.forward(x), F.linear(x, q.float() * scales[:, None], b), rtol=2e-2, atol=5e-2)


@needs_kernels
@pytest.mark.parametrize("m, k", [(1, 512), (3, 13), (16, 520)])
def test_the_fused_norm_and_activation_are_pytorchs_arithmetic(m, k):
    g = torch.Generator().manual_seed(m + k)
    x, res, w = torch.randn(m, k, generator=g), torch.randn(m, k, generator=g), torch.randn(k, generator=g)
    y, stream = KERNELS.add_rms_norm(x, None, w, 1e-6)
    assert stream is x
    torch.testing.assert_close(y, F.rms_norm(x, (k,), w, 1e-6), rtol=1e-5, atol=1e-5)
    want_stream = res + x
    y, stream = KERNELS.add_rms_norm(x, res, w, 1e-6)
    assert stream is res  # the residual stream is updated in place
    torch.testing.assert_close(stream, want_stream, rtol=0, atol=0)
    torch.testing.assert_close(y, F.rms_norm(want_stream, (k,), w, 1e-6), rtol=1e-5, atol=1e-5)
    gu = torch.randn(m, 2 * k, generator=g) * 6  # the exp's range well covered
    torch.testing.assert_close(KERNELS.silu_mul(gu), F.silu(gu[:, :k]) * gu[:, k:], rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("seed, kv_dtype", [(s, torch.float32) for s in range(8)]
                         + [(s, dt) for s in (0, 1, 4, 7) for dt in (torch.bfloat16, torch.float16)])
def test_the_decode_attention_kernel_matches_the_reference(seed, kv_dtype):
    """Random scattered block tables, contexts, GQA ratios, head sizes and windows: the same
    output as the reference backend, and the same K/V written into the same slots. A 16-bit
    cache (--kv-cache-dtype) holds the K/V rounded as torch's .to() rounds them, bit for bit,
    and both attend over the values as stored."""
    import random

    from tailserve.attention.cpu_decode import CpuDecodeBackend, CpuDecodeMetadata
    from tailserve.attention.reference import build_attention_metadata, paged_attention

    rng = random.Random(seed)
    torch.manual_seed(seed)
    b = rng.randint(1, 6)
    h, kvh, d, bs = rng.choice([(8, 2, 64, 16), (4, 4, 16, 4), (6, 2, 32, 8), (2, 1, 128, 16)])
    window = rng.choice([None, 5, 40])
    ctxs = [rng.randint(1, 70) for _ in range(b)]
    # Decodes in even seeds; odd seeds add verification-sized chunks (up to 9 new tokens).
    qlens = [1 if seed % 2 == 0 else rng.randint(1, min(c, 9)) for c in ctxs]
    t = sum(qlens)
    num_blocks = sum(-(-c // bs) for c in ctxs) + 2
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-c // bs))] for c in ctxs]
    cache = torch.randn(2, num_blocks, bs, kvh, d).to(kv_dtype)
    q, k, v = torch.randn(t, h, d), torch.randn(t, kvh, d), torch.randn(t, kvh, d)
    backend = CpuDecodeBackend(bs, 8, 64, 256, window, torch.device("cpu"), kernels=KERNELS)
    meta = backend.build(qlens, ctxs, tables)
    assert isinstance(meta, CpuDecodeMetadata)
    ours, theirs = cache.clone(), cache.clone()
    got = meta.attend(q, k, v, ours, d ** -0.5)
    ref_meta = build_attention_metadata(qlens, ctxs, tables, bs, window, torch.device("cpu"))
    want = paged_attention(q, k, v, theirs, ref_meta, d ** -0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(ours, theirs)
    if kv_dtype != torch.float32:  # what was written is the new K/V rounded to nearest-even
        slots = meta.slot_mapping
        assert torch.equal(ours[0].view(-1, kvh, d)[slots], k.to(kv_dtype))
        assert torch.equal(ours[1].view(-1, kvh, d)[slots], v.to(kv_dtype))
        # ... and the result is attention over those rounded values (float64 oracle).
        wide = paged_attention(q.double(), k.to(kv_dtype).double(), v.to(kv_dtype).double(),
                               cache.double(), ref_meta, d ** -0.5)
        torch.testing.assert_close(got.double(), wide, rtol=1e-5, atol=1e-5)
    # From the fused projection's rows, rotated inside: RotaryEmbedding.apply's result.
    from tailserve.model.config import RopeConfig
    from tailserve.model.rope import RotaryEmbedding

    rotary = RotaryEmbedding(RopeConfig(theta=10000.0), d, 128, torch.float32)
    positions = torch.tensor([p for c, ql in zip(ctxs, qlens) for p in range(c - ql, c)])
    cos, sin = rotary.lookup(positions)
    qkv = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=1)
    fused = cache.clone()
    got = meta.attend_rope(qkv, rotary, cos, sin, h, kvh, fused, d ** -0.5)
    rot_ref = cache.clone()
    want = meta.attend(rotary.apply(q, cos, sin), rotary.apply(k, cos, sin), v, rot_ref, d ** -0.5)
    # Bitwise: the kernel rounds each product as PyTorch does (no FMA contraction), so a step
    # through it and a prefill through the reference write the same K (prefix-cache hits
    # then give the same logprobs as the first request).
    assert torch.equal(fused, rot_ref) and torch.equal(got, want)
    # A step with a longer chunk (a prefill) goes to the reference's metadata.
    long = CpuDecodeBackend.MAX_QUERY_LEN + 1
    assert not isinstance(backend.build([long], [long], [list(range(-(-long // bs)))]), CpuDecodeMetadata)


@needs_kernels
def test_a_single_sequences_step_metadata_is_the_batch_builders():
    """A batch-1 decode or verification takes its own few-call builder: its slots, tables,
    lengths and longest context are exactly what the batch builder makes for the same step."""
    import random

    from tailserve.attention.cpu_decode import CpuDecodeBackend

    rng = random.Random(0)
    for bs, window in ((16, None), (4, 7), (8, None)):
        backend = CpuDecodeBackend(bs, 8, 64, 512, window, torch.device("cpu"), kernels=KERNELS)
        for _ in range(40):
            c = rng.randint(1, 300)
            q = rng.randint(1, min(c, CpuDecodeBackend.MAX_QUERY_LEN))
            table = rng.sample(range(1000), -(-c // bs) + rng.randint(0, 3))  # lookahead blocks past c too
            one = backend._kernel_metadata([q], [c], [table])
            batch = backend._batch_metadata([q], [c], [table])
            for name in ("slot_mapping", "block_tables", "seq_lens"):
                got, want = getattr(one, name), getattr(batch, name)
                assert got.dtype == want.dtype and torch.equal(got, want), (name, c, q)
            assert one.block_tables.is_contiguous() and (one.max_ctx, one.sliding_window) == (batch.max_ctx, window)


def _scattered_step(ctxs: list[int], qlens: list[int], h: int, kvh: int, d: int, bs: int, seed: int):
    """A step's inputs over a bf16 cache: each sequence's blocks scattered at random, random
    cache contents, and q, k, v for its new rows. Returns (tables, cache, q, k, v)."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-c // bs) for c in ctxs) + 2
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[free.pop() for _ in range(-(-c // bs))] for c in ctxs]
    cache = torch.randn(2, num_blocks, bs, kvh, d, generator=g).to(torch.bfloat16)
    q, k, v = (torch.randn(sum(qlens), n, d, generator=g) for n in (h, kvh, kvh))
    return tables, cache, q, k, v


@needs_kernels
@pytest.mark.parametrize("h, kvh, d, bs, window", [(6, 2, 64, 16, None), (6, 2, 64, 16, 45), (4, 2, 80, 16, None),
                                                   (2, 2, 48, 8, 13), (4, 1, 128, 16, None), (4, 2, 72, 16, None)])
def test_a_bf16_cache_read_in_pairs_gives_attention_over_its_values(h, kvh, d, bs, window):
    """A bf16 cache with D a multiple of 16 is read as even/odd pairs (scores eight positions at
    a time, the block's last few one by one); D = 72 takes the widening path. Contexts long
    enough for many groups of eight, windows that start mid-group, verification rows: the
    result is attention over the stored values (float64 oracle)."""
    from tailserve.attention.cpu_decode import CpuDecodeBackend
    from tailserve.attention.reference import build_attention_metadata, paged_attention

    ctxs, qlens = [300, 17, 129, 8, 64], [1, 1, 5, 1, 3]
    tables, cache, q, k, v = _scattered_step(ctxs, qlens, h, kvh, d, bs, d + (window or 0))
    meta = CpuDecodeBackend(bs, 8, 64, 512, window, torch.device("cpu"), kernels=KERNELS).build(qlens, ctxs, tables)
    got = meta.attend(q, k, v, cache.clone(), d ** -0.5)
    ref_meta = build_attention_metadata(qlens, ctxs, tables, bs, window, torch.device("cpu"))
    want = paged_attention(q.double(), k.to(torch.bfloat16).double(), v.to(torch.bfloat16).double(),
                           cache.double(), ref_meta, d ** -0.5)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("seed", range(6))
def test_a_step_of_prompt_chunks_beside_decodes_splits_its_rows_and_matches_the_reference(seed):
    """Long prompt chunks beside decodes and short chunks, in any row order: the short rows
    through the kernel, the chunks through the reference, and the step attends and writes
    what the reference alone does over the whole batch."""
    import random

    from tailserve.attention.cpu_decode import CpuDecodeBackend, CpuMixedMetadata
    from tailserve.attention.reference import build_attention_metadata, paged_attention
    from tailserve.model.config import RopeConfig
    from tailserve.model.rope import RotaryEmbedding

    rng = random.Random(seed)
    torch.manual_seed(seed)
    h, kvh, d, bs = rng.choice([(8, 2, 64, 16), (6, 2, 32, 8), (4, 4, 16, 4)])
    window = None if seed < 4 else 20
    n = rng.randint(3, 7)
    longest = CpuDecodeBackend.MAX_QUERY_LEN + 1
    # At least one long chunk (a whole prompt or one after cached context) and one short row.
    qlens = [rng.choice([1, 1, rng.randint(2, 9), rng.randint(longest, 60)]) for _ in range(n)]
    i, j = rng.sample(range(n), 2)
    qlens[i], qlens[j] = rng.randint(longest, 60), rng.choice([1, rng.randint(2, 9)])
    ctxs = [q + rng.choice([0, rng.randint(1, 50)]) for q in qlens]
    t = sum(qlens)
    num_blocks = sum(-(-c // bs) for c in ctxs) + 2
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-c // bs))] for c in ctxs]
    cache = torch.randn(2, num_blocks, bs, kvh, d).to(torch.bfloat16)
    q, k, v = torch.randn(t, h, d), torch.randn(t, kvh, d), torch.randn(t, kvh, d)
    backend = CpuDecodeBackend(bs, 8, 64, 256, window, torch.device("cpu"), kernels=KERNELS)
    meta = backend.build(qlens, ctxs, tables)
    assert isinstance(meta, CpuMixedMetadata)
    ref_meta = build_attention_metadata(qlens, ctxs, tables, bs, window, torch.device("cpu"))
    assert torch.equal(meta.slot_mapping, ref_meta.slot_mapping)
    ours, theirs = cache.clone(), cache.clone()
    got = meta.attend(q, k, v, ours, d ** -0.5)
    want = paged_attention(q, k, v, theirs, ref_meta, d ** -0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(ours, theirs)
    # From the fused projection's rows: the same as rotating first, and the same K written.
    rotary = RotaryEmbedding(RopeConfig(theta=10000.0), d, 128, torch.float32)
    cos, sin = rotary.lookup(torch.tensor([p for c, ql in zip(ctxs, qlens) for p in range(c - ql, c)]))
    qkv = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=1)
    fused, rotated = cache.clone(), cache.clone()
    got = meta.attend_rope(qkv, rotary, cos, sin, h, kvh, fused, d ** -0.5)
    want = paged_attention(rotary.apply(q, cos, sin), rotary.apply(k, cos, sin), v, rotated, ref_meta, d ** -0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(fused, rotated)

@needs_kernels
def test_a_float32_cpu_engine_runs_the_kernels_and_generates_what_pytorch_does(tiny_checkpoint):
    from tailserve import LLM, SamplingParams
    from tailserve.attention.cpu_decode import CpuDecodeBackend
    from tailserve.model.llama import KernelLayerOps

    path, _ = tiny_checkpoint("mistral")  # a sliding window too
    prompts = [[5, 6, 7, 8, 9] * 7, [11, 12, 13], [40, 41, 42, 43, 44, 45, 46]]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    kw = dict(dtype="float32", kv_cache_memory_bytes=2 << 20, block_size=4)
    fast = LLM(str(path), **kw)
    worker = fast.engine.core.worker
    assert isinstance(worker.attn_backend, CpuDecodeBackend) and isinstance(worker.layer_ops, KernelLayerOps)
    plain = LLM(str(path), cpu_kernels=False, **kw)
    assert not isinstance(plain.engine.core.worker.attn_backend, CpuDecodeBackend)
    assert [o.token_ids for o in fast.generate(prompts, params)] == \
        [o.token_ids for o in plain.generate(prompts, params)]


@needs_kernels
def test_native_scope_multiplies_large_batches_in_bf16_and_nothing_else():
    from tailserve.model.linear import CpuCompactWeightsLinearMethod

    w = torch.randn(48, 64).bfloat16().float()
    layer = Linear(48, 64, True)
    layer.weight = torch.nn.Parameter(w.clone(), requires_grad=False)
    layer.bias = torch.nn.Parameter(torch.randn(48), requires_grad=False)
    layer.set_method(CpuCompactWeightsLinearMethod(torch.bfloat16, KERNELS, native_large_batches=True))
    small, large = torch.randn(16, 64), torch.randn(17, 64)
    exact = F.linear(large, w, layer.bias)
    torch.testing.assert_close(layer.forward(large), exact, rtol=1e-5, atol=1e-5)  # outside a prompt step
    with layer.method.native_scope(True):
        torch.testing.assert_close(layer.forward(small), F.linear(small, w, layer.bias), rtol=1e-5, atol=1e-5)
        got = layer.forward(large)
        with pytest.raises(RuntimeError, match="does not nest"), layer.method.native_scope(True):
            pass
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, F.linear(large.bfloat16(), w.bfloat16()).float() + layer.bias, rtol=0, atol=0)
    assert not layer.method._native_now  # the scope always clears itself


@needs_kernels
def test_native_prompt_products_see_row_counts_from_a_few_buckets(monkeypatch):
    """oneDNN sets up a primitive per row count: a prompt step's native products pad their rows
    with zeros to a multiple of 16 (64 past 256 rows), so prompts of any length reuse a few
    shapes, and the real rows are the unpadded product's."""
    from tailserve.model.linear import CpuCompactWeightsLinearMethod, native_rows

    w = torch.randn(48, 64).bfloat16().float()
    layer = Linear(48, 64, False)
    layer.weight = torch.nn.Parameter(w.clone(), requires_grad=False)
    layer.set_method(CpuCompactWeightsLinearMethod(torch.bfloat16, KERNELS, native_large_batches=True))
    seen, linear = [], F.linear
    monkeypatch.setattr(F, "linear", lambda x, *a, **k: seen.append(x.shape[0]) or linear(x, *a, **k))
    for m in (17, 40, 48, 250, 257, 300):
        x = torch.randn(m, 64)
        with layer.method.native_scope(True):
            got = layer.forward(x)
        assert got.shape == (m, 48)
        torch.testing.assert_close(got, linear(x.bfloat16(), w.bfloat16()).float(), rtol=1e-6, atol=1e-6)
    assert seen == [32, 48, 48, 256, 320, 320] == [native_rows(m) for m in (17, 40, 48, 250, 257, 300)]


@needs_kernels
def test_decode_batches_up_to_64_rows_give_each_row_its_16_row_product():
    from tailserve.model.linear import CpuCompactWeightsLinearMethod

    w = torch.randn(40, 64).bfloat16().float()
    layer = Linear(40, 64, False)
    layer.weight = torch.nn.Parameter(w.clone(), requires_grad=False)
    layer.set_method(CpuCompactWeightsLinearMethod(torch.bfloat16, KERNELS))
    x = torch.randn(64, 64)
    alone = layer.forward(x[37:38])
    assert torch.equal(layer.forward(x[:40])[37:38], alone)  # chunked through the kernel: bit for bit
    assert torch.equal(layer.forward(x)[37:38], alone)
    wide = torch.randn(65, 64)
    torch.testing.assert_close(layer.forward(wide), F.linear(wide, w), rtol=1e-5, atol=1e-5)  # widened


@needs_kernels
def test_panel_packed_weights_multiply_every_batch_through_the_kernel():
    """With panels the layer keeps no row-major or float32 weight, and a prompt of any length
    goes through the same kernel as a decode row: its rows equal those rows alone, bit for bit."""
    from tailserve.model.linear import CpuCompactWeightsLinearMethod

    w = torch.randn(40, 64).bfloat16().float()
    b = torch.randn(40)
    layer = Linear(40, 64, True)
    layer.weight = torch.nn.Parameter(w.clone(), requires_grad=False)
    layer.bias = torch.nn.Parameter(b.clone(), requires_grad=False)
    layer.set_method(CpuCompactWeightsLinearMethod(torch.bfloat16, KERNELS, panel_packed=True))
    assert isinstance(layer.qweight, cpu_kernels.PanelPackedWeight) and layer.weight.device.type == "meta"
    x = torch.randn(200, 64)
    full = layer.forward(x)
    torch.testing.assert_close(full, F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    for i in (0, 63, 199):
        assert torch.equal(layer.forward(x[i : i + 1])[0], full[i])
    with pytest.raises(ValueError, match="panel-packed"):
        CpuCompactWeightsLinearMethod(torch.bfloat16, KERNELS, keep_float32=True, panel_packed=True)


@needs_kernels
def test_panels_beside_rows_multiply_prompt_steps_natively_and_every_other_batch_in_panels():
    """With native products as well, the layer keeps the row-major bf16 weight for them: a
    prompt step's batch above 16 rows is the native bf16 product, bit for bit, and every other
    batch (decode, verification, a small prompt) goes through the panels, each row as alone."""
    from tailserve.model.linear import CpuCompactWeightsLinearMethod

    w = torch.randn(40, 64).bfloat16().float()
    layer = Linear(40, 64, False)
    layer.weight = torch.nn.Parameter(w.clone(), requires_grad=False)
    layer.set_method(CpuCompactWeightsLinearMethod(torch.bfloat16, KERNELS, native_large_batches=True,
                                                   panel_packed=True))
    assert isinstance(layer.qweight, cpu_kernels.PanelPackedWeight) and torch.equal(layer.rweight.float(), w)
    x = torch.randn(40, 64)
    decode = layer.forward(x)
    assert torch.equal(decode[7], layer.forward(x[7:8])[0])  # panels, batch-invariant
    torch.testing.assert_close(decode, F.linear(x, w), rtol=1e-5, atol=1e-4)
    with layer.method.native_scope(True):
        prompt = layer.forward(x)
        small = layer.forward(x[:16])
    assert torch.equal(prompt, F.linear(x.bfloat16(), w.bfloat16()).float())
    assert torch.equal(small[7], decode[7])


@needs_kernels
def test_weights_that_are_not_exactly_bf16_keep_float32():
    """A checkpoint whose config says bf16 may store float32 values: compacting those would
    round them, so such a layer keeps a float32 method."""
    from tailserve.model.linear import CpuCompactWeightsLinearMethod

    exact = torch.randn(16, 64).bfloat16().float()
    for w, want in ((exact, "cpu-compact-weights"), (exact + 1e-3, "onednn-packed")):
        layer = Linear(16, 64, False)
        layer.weight = torch.nn.Parameter(w.clone(), requires_grad=False)
        layer.set_method(CpuCompactWeightsLinearMethod(torch.bfloat16, KERNELS))
        assert layer.method.name in (want, "plain")
        x = torch.randn(2, 64)
        torch.testing.assert_close(layer.forward(x), F.linear(x, w), rtol=1e-5, atol=1e-5)
        if want == "cpu-compact-weights":
            assert layer.method.name == want


@needs_kernels
@pytest.mark.parametrize("kind, quantization, kv", [("llama", None, "auto"), ("mistral", None, "auto"),
                                                    ("llama", "int8", "auto"), ("llama_tied", None, "auto"),
                                                    ("llama", None, "bfloat16"), ("mistral", None, "float16")])
def test_the_fused_decode_layer_is_the_per_operation_path(tmp_path, kind, quantization, kv):
    """A bf16 checkpoint run in float32 over compact (or int8) weights: decode steps go
    through one compiled call per layer; its logits equal the per-operation path's (same
    kernels, returning to Python between them), decode and verification-sized steps, ragged
    contexts, a sliding window; greedy output is the same."""
    from conftest import build_hf_model, save_checkpoint
    from tailserve import LLM, SamplingParams
    from tailserve.attention.cpu_decode import CpuDecodeMetadata

    path = save_checkpoint(build_hf_model(kind), tmp_path / kind, dtype=torch.bfloat16)
    kw = dict(dtype="float32", kv_cache_memory_bytes=2 << 20, block_size=4, quantization=quantization,
              kv_cache_dtype=kv)
    fused = LLM(str(path), **kw)
    worker = fused.engine.core.worker
    model = worker.model
    assert worker.num_fused_layers == len(model.layers) > 0
    assert worker.kv_caches[0].dtype == (torch.float32 if kv == "auto" else getattr(torch, kv))
    g = torch.Generator().manual_seed(7)
    cfg = worker.arch
    caches = [torch.randn(2, 12, 4, cfg.num_kv_heads, cfg.head_dim, generator=g).to(worker.kv_caches[0].dtype)
              for _ in range(cfg.num_layers)]
    for qlens, ctxs in (([1, 1, 1], [9, 17, 3]), ([4, 2], [11, 6]), ([1], [30])):
        # Scattered block tables over the 12 blocks of the caches.
        tables = [[(i * 3 + j) % 12 for j in range(-(-c // 4))] for i, c in enumerate(ctxs)]
        meta = worker.attn_backend.build(qlens, ctxs, tables)
        assert isinstance(meta, CpuDecodeMetadata)
        ids = torch.randint(0, cfg.vocab_size, (sum(qlens),), generator=g)
        pos = torch.tensor([p for q, c in zip(qlens, ctxs) for p in range(c - q, c)])
        outs, kv = [], []
        for use_fused in (True, False):
            saved = [layer.fused for layer in model.layers]
            if not use_fused:
                for layer in model.layers:
                    layer.fused = None
            c = [t.clone() for t in caches]
            meta._step = None
            with torch.inference_mode():
                outs.append(model.compute_logits(model(ids, pos, c, meta)))
            kv.append(c)
            for layer, f in zip(model.layers, saved):
                layer.fused = f
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
        for a, b in zip(*kv):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    plain = LLM(str(path), cpu_kernels=False, **{**kw, "quantization": None}) if quantization is None else None
    if plain is not None:
        p = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        prompts = [[5, 6, 7, 8, 9] * 3, [11, 12, 13]]
        assert [o.token_ids for o in fused.generate(prompts, p)] == [o.token_ids for o in plain.generate(prompts, p)]


@needs_kernels
def test_a_decode_of_more_sequences_than_the_fused_rows_runs_in_groups_and_matches_each_alone(tmp_path):
    from conftest import build_hf_model, save_checkpoint
    from tailserve import LLM, SamplingParams

    path = save_checkpoint(build_hf_model("llama"), tmp_path / "bf16", dtype=torch.bfloat16)
    llm = LLM(str(path), kv_cache_memory_bytes=8 << 20)
    worker = llm.engine.core.worker
    runner = worker.runner
    assert runner.fused_rows == 16
    # Decode rows are the subject. Prompt rows multiply natively where the CPU has bf16 (60 rows
    # of prompts together, 3 alone: kernel), so a prompt's K/V depends on the prompts beside
    # it there, as on a GPU: keep the prefill in float32 for this comparison.
    worker.linear_method.native_large_batches = False
    runner.native_prefill = None
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[3 + i, 7, 11 + 2 * i] for i in range(20)]  # 20 decodes a step: two groups
    calls = []
    grouped = runner._forward_in_groups
    runner._forward_in_groups = lambda *a: calls.append(len(a[2])) or grouped(*a)
    together = [o.token_ids for o in llm.generate(prompts, params)]
    assert calls and all(n == 20 for n in calls)
    runner._forward_in_groups = grouped
    assert together == [llm.generate([p], params)[0].token_ids for p in prompts]


def _builtin_llm(native: bool, **kw):
    """The built-in target with native prefill products forced on or off (a CPU without native
    bf16 computes them too, slowly), whatever the plan chose here."""
    from tailserve import LLM

    llm = LLM(dtype="auto", enable_metrics=False, **kw)
    worker = llm.engine.core.worker
    worker.linear_method.native_large_batches = native
    worker.runner.native_prefill = worker.linear_method.native_scope if native else None
    return llm


def _run_with_a_prompt_beside(prompt_b: list[int] | None) -> tuple[list, list]:
    """Native prefill on: A decodes; B's prompt, if given, arrives after A's first step, so A's
    second token comes from a step that also prefills B. Returns (A's logprobs, B's)."""
    from tailserve import SamplingParams

    llm = _builtin_llm(True, enable_prefix_caching=False, kv_cache_memory_bytes=8 << 20)
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True)
    a = eng.add_request([5, 6, 7, 8, 9, 10], params)
    eng.step()
    b = eng.add_request(prompt_b, SamplingParams(temperature=0, max_tokens=1, logprobs=3)) if prompt_b else None
    final = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                final[o.request_id] = o.outputs[0].logprobs
    llm.shutdown()
    return final[a], final.get(b)


@needs_kernels
def test_a_step_that_prefills_beside_decodes_gives_each_what_a_pure_step_would():
    # The mixed step runs two forwards: B's prompt rows with native products (as a prompt-only
    # step), A's decode row in float32 through the fused layer (as a decode-only step), so
    # neither depends on the other being there, to the last bit.
    prompt_b = [(7 * i) % 300 + 3 for i in range(40)]
    alone_a, _ = _run_with_a_prompt_beside(None)
    with_b, b_mixed = _run_with_a_prompt_beside(prompt_b)
    assert with_b == alone_a
    from tailserve import SamplingParams

    llm = _builtin_llm(True, enable_prefix_caching=False, kv_cache_memory_bytes=8 << 20)
    b_alone = llm.generate([prompt_b], SamplingParams(temperature=0, max_tokens=1, logprobs=3))[0].outputs[0].logprobs
    assert b_mixed == b_alone


@needs_kernels
def test_forward_groups_gives_each_group_its_own_forward_bit_for_bit(tmp_path):
    # Layer by layer across the groups (each layer's weights read once for all of them), and
    # still each group's hidden states are exactly those of its own forward.
    from conftest import build_hf_model, save_checkpoint
    from tailserve import LLM

    path = save_checkpoint(build_hf_model("llama"), tmp_path / "bf16", dtype=torch.bfloat16)
    runner = LLM(str(path), kv_cache_memory_bytes=8 << 20).engine.core.worker.runner
    assert runner.fused_rows == 16
    be, model = runner.attn_backend, runner.model

    def group(ids, ctxs, first_block):
        tables = [[first_block + 2 * i, first_block + 2 * i + 1] for i in range(len(ids))]
        meta = be.build([1] * len(ids), ctxs, tables)
        return torch.tensor(ids), torch.tensor([c - 1 for c in ctxs]), meta

    with torch.inference_mode():
        torch.manual_seed(0)
        for cache in runner.kv_caches:
            cache.normal_()  # some context to attend to
        groups = [group([5, 17, 40], [5, 9, 2], 0), group([8, 33], [12, 3], 6)]
        alone = [model(ids, pos, runner.kv_caches, meta) for ids, pos, meta in groups]
        together = model.forward_groups(groups, runner.kv_caches)
    assert all(torch.equal(a, b) for a, b in zip(alone, together))


@needs_kernels
def test_short_prompt_chunks_after_prefix_hits_go_native_in_one_forward_not_fused_groups():
    # 15 requests whose first 112 tokens are cached prefill 16 tokens each: with native prefill
    # products that is one forward of 240 rows (it ran as 15 fused groups, 2x the time);
    # without them, the float32 groups through the fused layer as before.
    import random

    from tailserve import SamplingParams

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 4000) for _ in range(128)] for _ in range(15)]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for native, grouped_calls in ((True, 0), (False, 1)):
        llm = _builtin_llm(native, kv_cache_memory_bytes=16 << 20)
        llm.generate(prompts, params)  # cache the prompts
        runner, calls = llm.engine.core.worker.runner, []
        grouped = runner._forward_in_groups
        runner._forward_in_groups = lambda *a, c=calls, g=grouped: c.append(len(a[2])) or g(*a)
        for p in prompts:
            llm.engine.add_request(p[:112] + [7] * 16, params)
        llm.engine.step()
        assert llm.engine.step_log[-1].num_prefill_tokens == 240
        assert len(calls) == grouped_calls, native
        llm.shutdown()


@needs_kernels
@pytest.mark.parametrize("h, kvh, d, window", [(6, 2, 64, None), (8, 2, 128, None), (4, 2, 80, None),
                                               (4, 1, 64, 40), (6, 2, 64, 500)])
def test_rows_of_one_sequence_attend_together_bitwise_as_each_alone(h, kvh, d, window):
    """A verification's rows (one sequence, one block table, consecutive positions) read each
    cache block once for all of them from a bf16 cache: every row's output is bitwise what the
    row gets attended alone, at contexts whose last block some rows read only part of, beside
    another sequence's rows in the same step, and alone in a step (one KV head: its rows split
    in two groups, one a thread); a window that starts the rows at different positions goes
    row by row, also bitwise."""
    from tailserve.attention.cpu_decode import CpuDecodeBackend

    bs = 16
    backend = CpuDecodeBackend(bs, 8, 64, 512, window, torch.device("cpu"), kernels=KERNELS)
    for ctxs, qlens in (([300, 129, 40], [5, 9, 16]), ([300], [9])):
        tables, cache, q, k, v = _scattered_step(ctxs, qlens, h, kvh, d, bs, d + (window or 0))
        written = cache.clone()
        together = backend.build(qlens, ctxs, tables).attend(q, k, v, written, d ** -0.5)
        alone = []
        row = 0
        for c, n, table in zip(ctxs, qlens, tables):
            for pos in range(c - n, c):
                one = backend.build([1], [pos + 1], [table])  # the row as a plain decode at its position
                alone.append(one.attend(q[row : row + 1], k[row : row + 1], v[row : row + 1], written, d ** -0.5))
                row += 1
        assert torch.equal(together, torch.cat(alone))


def _logged_rounds(engines):
    """Per engine, each proposal's drafts (wraps the proposers' ``propose``) and, for the
    first engine, the drafts each compiled round call returned."""
    proposers = [e.engine.core.worker.proposer for e in engines]
    rounds: list[list[list[int]]] = [[] for _ in engines]
    for n, prop in enumerate(proposers):
        propose = prop.propose

        def logged(inputs, n=n, propose=propose):
            out = propose(inputs)
            rounds[n].append([list(d) for d in out.draft_ids.values()])
            return out
        prop.propose = logged
    fused = proposers[0].model.fused_decode
    draft_rounds = fused.draft_rounds
    calls: list[int] = []  # per compiled call, the drafts it made

    def counted(*args, **kwargs):
        got = draft_rounds(*args, **kwargs)
        calls.append(sum(map(len, got[0])) if got else 0)
        return got
    fused.draft_rounds = counted
    return proposers, rounds, calls


@needs_kernels
@pytest.mark.parametrize("batch", [1, 3])
def test_a_greedy_round_in_one_compiled_call_drafts_what_the_steps_do(batch):
    """Greedy sequences' rounds (catch-up and chain) run in one compiled call
    (FusedDecodeModel.draft_rounds), alone or three at a time: per round the same drafts as
    the step-by-step round, stopping at the same margin, the same outputs, and the draft's
    K/V cache bitwise the same at the end."""
    from tailserve import LLM, SamplingParams

    engines = [LLM(speculative_model="builtin", num_speculative_tokens=6, speculative_draft_stop_margin=0.3,
                   kv_cache_memory_bytes=64 << 20, max_num_seqs=batch) for _ in range(2)]
    proposers, rounds, calls = _logged_rounds(engines)
    assert proposers[0]._compiled_chain
    proposers[1]._compiled_chain = False  # the step-by-step round
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    prompts = ["def parse(path):\n    with open(path) as f:", "import os\n\nclass Cache:\n    def __init__(",
               "for i in range(10):\n    if i % 2:"]
    for group in ([prompts[:2], prompts[2:]] if batch == 1 else [prompts]):
        for chunk in ([[p] for p in group] if batch == 1 else [group]):
            outs = [[o.outputs[0].token_ids for o in e.generate(chunk, params)] for e in engines]
            assert outs[0] == outs[1]
    assert rounds[0] == rounds[1] and sum(calls) > 20
    assert any(0 < len(d) < 6 for r in rounds[0] for d in r)  # the margin stopped some chains
    if batch > 1:
        assert any(len(r) == batch for r in rounds[0])  # rounds of several sequences at once
    for a, b in zip(proposers[0].kv_caches, proposers[1].kv_caches):
        assert torch.equal(a, b)


@needs_kernels
@pytest.mark.parametrize("filters", [{}, dict(top_k=40, min_p=0.1), dict(top_p=0.8)])
def test_a_round_in_one_compiled_call_draws_each_draft_from_the_q_it_returns(filters):
    """Three sequences' round in one compiled call through the proposer (an unseeded sampled,
    a seeded sampled and a greedy one; catch-ups of two tokens and one, the shorter padded):
    each sampled q row is the step's own logits through filtered_probs' rule (temperature;
    top-k, top-p, min-p where set: the same tokens survive), within float rounding of
    filtered_probs on the same logits; each draft is the inverse CDF of its returned q row at
    the uniform drawn for it, or that row's race with the position's key, or the greedy
    argmax; a chain stops exactly where a margin falls below the stop margin; and each
    sequence's K/V are bitwise those of its steps run one by one, alone."""
    import numpy as np

    from tailserve import LLM, SamplingParams
    from tailserve.sample.sampler import SamplingTensors, filtered_probs, seeded_key
    from tailserve.speculative.proposer import ProposalInput

    llm = LLM(speculative_model="builtin", num_speculative_tokens=6, speculative_draft_stop_margin=0.05,
              kv_cache_memory_bytes=64 << 20)
    prop = llm.engine.core.worker.proposer
    _, _, calls = _logged_rounds([llm])
    fused, rotary, margin = prop.model.fused_decode, prop.model.rotary, 0.05
    params = [SamplingParams(temperature=0.8, max_tokens=8, **filters)] * 2 + [SamplingParams(temperature=0)]
    seeds = [None, 1234, None]
    texts = ["def parse(path):\n    with open(path) as f:\n        return", "import os\nimport sys\n\n",
             "class Cache:\n    def __init__(self, size):\n        self."]
    prompts = [llm.tokenizer.encode(t) for t in texts]
    blocks = [list(range(1 + 8 * r, 9 + 8 * r)) for r in range(3)]  # disjoint: each row its own blocks
    unseen = [2, 1, 2]
    for r in range(3):  # the prompts' K/V, by the proposer's own catch-up (k = 0: no drafts)
        n = len(prompts[r])
        prop.propose([ProposalInput(f"r{r}", prompts[r], 0, n - unseen[r], blocks[r], 0, params[r], seeds[r])])
    before = [c.clone() for c in prop.kv_caches]
    prop.generator = torch.Generator().manual_seed(7)
    uniforms = torch.rand((3, 6), generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    got = prop.propose([ProposalInput(f"r{r}", prompts[r], len(prompts[r]) - unseen[r], len(prompts[r]), blocks[r], 6,
                                      params[r], seeds[r]) for r in range(3)])
    assert len(calls) == 1  # the whole round in one call
    after = [c.clone() for c in prop.kv_caches]
    for c, b in zip(prop.kv_caches, before):
        c.copy_(b)
    stops, filtered = 0, 0
    for r in range(3):
        drafts, n = got.draft_ids[f"r{r}"], len(prompts[r])
        assert 1 <= len(drafts) <= 6
        q = got.draft_probs.get(f"r{r}")
        assert (q is None) == (r == 2) and (q is None or q.shape == (len(drafts), fused.vocab_size))
        st = SamplingTensors.from_params([params[r]], fused.vocab_size, torch.device("cpu"), KERNELS)
        seq = list(prompts[r])
        for j, tok in enumerate(drafts):
            feed = seq[n - unseen[r]:] if j == 0 else seq[-1:]
            rows = slice(len(seq) - len(feed), len(seq))
            rope = (rotary.cos[rows, None].contiguous(), rotary.sin[rows, None].contiguous())
            _, logits = fused.run(np.asarray(feed, dtype=np.int64), rope, prop.kv_caches,
                                  prop.attn_backend.build([len(feed)], [len(seq)], [blocks[r]]), len(feed), head=True)
            if q is None:
                top, gap = KERNELS.top2_margin(logits)
                assert tok == top[0]
                unsure = gap[0] < margin
            else:
                ref = filtered_probs(logits, st)[0]
                assert torch.equal(q[j] > 0, ref > 0)
                filtered += int((ref == 0).sum())
                torch.testing.assert_close(q[j], ref, rtol=1e-5, atol=1e-8)
                row = q[j : j + 1].contiguous()
                if seeds[r] is not None:
                    assert tok == int(KERNELS.seeded_race(row, [seeded_key(seeds[r], n + j)])[0])
                else:
                    assert tok == int(KERNELS.inverse_cdf(row, uniforms[r, j : j + 1])[0])
                top2 = q[j].topk(2).values
                unsure = float(top2[0] - top2[1]) < margin
            if j < len(drafts) - 1:
                assert not unsure  # an unsure draft ends the chain
            elif len(drafts) < 6:
                assert unsure  # it ended early: on an unsure draft
                stops += 1
            seq.append(tok)
        for a, b in zip(after, prop.kv_caches):
            assert torch.equal(a[:, blocks[r]], b[:, blocks[r]])
    assert stops  # the margin stopped a chain
    assert bool(filtered) == bool(filters)


@needs_kernels
def test_a_seeded_request_drafted_by_the_compiled_round_gives_speculation_offs_tokens():
    """A seeded request at temperature 0.8, drafted at batch 1 by the compiled round (its q
    not PyTorch's bits), emits exactly what it emits with speculation off: its tokens are its
    races under the target's p, whatever was drafted; and drafts were accepted."""
    from tailserve import LLM, SamplingParams

    params = [SamplingParams(temperature=0.8, seed=11 + i, max_tokens=48, ignore_eos=True) for i in range(2)]
    prompts = ["def parse(path):\n    with open(path) as f:", "import os\n\nclass Cache:\n    def __init__("]
    off = LLM(kv_cache_memory_bytes=64 << 20)
    spec = LLM(speculative_model="builtin", num_speculative_tokens=4, speculative_draft_stop_margin=0.1,
               kv_cache_memory_bytes=64 << 20)
    _, _, calls = _logged_rounds([spec])
    for prompt, p in zip(prompts, params):
        assert spec.generate([prompt], p)[0].outputs[0].token_ids == off.generate([prompt], p)[0].outputs[0].token_ids
    assert len(calls) > 10 and spec.engine.spec_stats.num_accepted_tokens > 0
