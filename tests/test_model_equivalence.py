"""Our logits equal transformers' on tiny random checkpoints of every supported architecture."""

from __future__ import annotations

import pytest
import torch

from conftest import ARCHS, build_hf_model, save_checkpoint
from tailserve.attention.reference import build_attention_metadata
from tailserve.model.loader import load_model

TOL = 1e-4


def _caches(cfg, num_blocks, block_size, dtype=torch.float32):
    return [torch.zeros(2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, dtype=dtype)
            for _ in range(cfg.num_layers)]


def _prefill(model, cfg, ids, block_size, table):
    caches = _caches(cfg, max(table) + 1, block_size, model.embed_tokens.dtype)
    n = len(ids)
    meta = build_attention_metadata([n], [n], [table], block_size, cfg.sliding_window, torch.device("cpu"))
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(n), caches, meta))


@pytest.mark.parametrize("kind", sorted(ARCHS))
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_prefill_and_decode_logits_match_transformers(tiny_checkpoint, kind, block_size):
    path, hf = tiny_checkpoint(kind)
    model, cfg = load_model(path, torch.float32)
    torch.manual_seed(1)
    ids = torch.randint(2, cfg.vocab_size, (45,)).tolist()
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    # A scrambled block table: blocks need not be contiguous or ordered.
    nb = -(-len(ids) // block_size)
    table = list(torch.randperm(nb + 3)[:nb].tolist())
    out = _prefill(model, cfg, ids, block_size, table)
    assert (out - ref).abs().max().item() <= TOL

    caches = _caches(cfg, nb + 3, block_size)
    steps = []
    with torch.inference_mode():
        for t, tok in enumerate(ids):
            meta = build_attention_metadata([1], [t + 1], [table], block_size, cfg.sliding_window,
                                            torch.device("cpu"))
            steps.append(model.compute_logits(model(torch.tensor([tok]), torch.tensor([t]), caches, meta)))
    assert (torch.cat(steps) - ref).abs().max().item() <= TOL


def test_mixed_batch_of_prefill_chunks_and_decodes_matches(tiny_checkpoint):
    """Three sequences in one flat batch: a decode, a middle prefill chunk, a fresh prefill."""
    path, hf = tiny_checkpoint("qwen2")
    model, cfg = load_model(path, torch.float32)
    bs = 4
    torch.manual_seed(2)
    seqs = [torch.randint(2, cfg.vocab_size, (n,)).tolist() for n in (13, 22, 9)]
    refs = [hf(torch.tensor([s])).logits[0] for s in seqs]
    tables = [[0, 1, 2, 3], [4, 5, 6, 7, 8, 9], [10, 11, 12]]
    caches = _caches(cfg, 13, bs)
    dev = torch.device("cpu")
    with torch.inference_mode():
        # Step 1: seq0 prefills 12 tokens, seq1 prefills its first 10.
        meta = build_attention_metadata([12, 10], [12, 10], tables[:2], bs, None, dev)
        ids = seqs[0][:12] + seqs[1][:10]
        model(torch.tensor(ids), torch.tensor(list(range(12)) + list(range(10))), caches, meta)
        # Step 2: seq0 decodes token 12, seq1 prefills 10..21, seq2 prefills all 9.
        meta = build_attention_metadata([1, 12, 9], [13, 22, 9], tables, bs, None, dev)
        ids = seqs[0][12:13] + seqs[1][10:22] + seqs[2]
        pos = [12, *list(range(10, 22)), *list(range(9))]
        logits = model.compute_logits(model(torch.tensor(ids), torch.tensor(pos), caches, meta))
    assert (logits[0] - refs[0][12]).abs().max() <= TOL
    assert (logits[1:13] - refs[1][10:22]).abs().max() <= TOL
    assert (logits[13:] - refs[2]).abs().max() <= TOL


def test_sliding_window_matches_transformers(tmp_path):
    hf = build_hf_model("mistral", sliding_window=8)
    hf.config._attn_implementation = "eager"
    path = save_checkpoint(hf, tmp_path / "mistral_sw")
    model, cfg = load_model(path, torch.float32)
    assert cfg.sliding_window == 8
    ids = torch.randint(2, cfg.vocab_size, (30,)).tolist()
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    out = _prefill(model, cfg, ids, 4, list(range(8)))
    assert (out - ref).abs().max().item() <= TOL


def test_sharded_checkpoint_loads(tmp_path):
    hf = build_hf_model("llama")
    path = save_checkpoint(hf, tmp_path / "sharded", max_shard_size="100KB")
    assert (path / "model.safetensors.index.json").exists()
    model, cfg = load_model(path, torch.float32)
    ids = list(range(2, 30))
    ref = hf(torch.tensor([ids])).logits[0]
    assert (_prefill(model, cfg, ids, 16, [0, 1]) - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_checkpoints_load_and_track_float32(tmp_path, dtype):
    hf = build_hf_model("llama")
    path = save_checkpoint(hf, tmp_path / str(dtype), dtype=dtype)
    model, cfg = load_model(path)
    assert cfg.dtype == dtype and model.embed_tokens.dtype == dtype
    ids = list(range(2, 40))
    ref = hf.to(dtype)(torch.tensor([ids])).logits[0].float()
    out = _prefill(model, cfg, ids, 16, [0, 1, 2])
    # Same half-precision arithmetic, different kernels: compare loosely, and the argmax.
    assert (out - ref).abs().max().item() < 0.15 * ref.abs().max().item()
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


@pytest.mark.parametrize("kind", ["llama", "qwen2", "llama_tied"])
def test_onednn_packed_weights_match_transformers(tiny_checkpoint, kind):
    from tailserve.model.linear import Linear, OneDNNPackedLinearMethod, onednn_available

    if not onednn_available():
        pytest.skip("this torch build has no oneDNN")
    path, hf = tiny_checkpoint(kind)
    model, cfg = load_model(path, torch.float32, linear_method=OneDNNPackedLinearMethod())
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed is not None and m.method.name == "onednn-packed" for m in linears)
    ids = list(range(2, 50))
    ref = hf(torch.tensor([ids])).logits[0]
    assert (_prefill(model, cfg, ids, 16, [3, 1, 0, 2]) - ref).abs().max().item() <= TOL
