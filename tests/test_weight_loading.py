"""Per-parameter weight loaders: each rank's slice of every projection, read from the
safetensors file, and the parallel layouts' arithmetic against the full layer."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from conftest import build_hf_model, save_checkpoint
from tailserve.memory.kv_cache import kv_bytes_per_block
from tailserve.model.linear import TensorParallel, kv_heads_per_rank
from tailserve.model.loader import checkpoint_keys, load_model


def test_name_map_covers_fused_parameters():
    assert checkpoint_keys("layers.3.self_attn.qkv_proj.weight") == (
        ("model.layers.3.self_attn.q_proj.weight", "q"), ("model.layers.3.self_attn.k_proj.weight", "k"),
        ("model.layers.3.self_attn.v_proj.weight", "v"))
    assert checkpoint_keys("layers.0.mlp.gate_up_proj.bias")[1] == ("model.layers.0.mlp.up_proj.bias", 1)
    assert checkpoint_keys("embed_tokens") == (("model.embed_tokens.weight", None),)
    assert checkpoint_keys("lm_head.weight") == (("lm_head.weight", None),)


@pytest.fixture(scope="module")
def gqa_checkpoint(tmp_path_factory):
    # 4 query heads, 2 KV heads, biases on q/k/v (Qwen2-style): over 4 ranks the KV heads
    # are replicated, over 2 they split.
    hf = build_hf_model("qwen2")
    return save_checkpoint(hf, tmp_path_factory.mktemp("gqa")), hf


@pytest.mark.parametrize("size", [2, 4])
def test_each_rank_loads_its_slices_and_the_ranks_add_up_to_the_full_layer(gqa_checkpoint, size):
    path, hf = gqa_checkpoint
    cfg_h, cfg_kvh = hf.config.num_attention_heads, hf.config.num_key_value_heads
    full, cfg = load_model(path, torch.float32)
    ranks = [load_model(path, torch.float32, tp=TensorParallel(size, r))[0] for r in range(size)]
    d = cfg.head_dim
    hq, hkv = cfg_h // size, kv_heads_per_rank(cfg_kvh, TensorParallel(size))
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        q_full = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
        k_full = f.get_tensor("model.layers.0.self_attn.k_proj.weight")
    for r, m in enumerate(ranks):
        attn = m.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (hq, hkv)
        w = attn.qkv_proj.weight
        assert w.shape[0] == (hq + 2 * hkv) * d
        torch.testing.assert_close(w[: hq * d], q_full[r * hq * d : (r + 1) * hq * d])
        kv_head = r * hkv if cfg_kvh >= size else r * cfg_kvh // size
        torch.testing.assert_close(w[hq * d : (hq + hkv) * d], k_full[kv_head * d : (kv_head + hkv) * d])
    # Row-parallel o_proj and down_proj: the ranks' partial products sum to the full layer.
    x_attn = torch.randn(3, cfg.q_size)
    x_mlp = torch.randn(3, cfg.intermediate_size)
    for get, x in ((lambda m: m.layers[0].self_attn.o_proj, x_attn), (lambda m: m.layers[0].mlp.down_proj, x_mlp)):
        n = x.shape[1] // size
        # Each rank's partial product (its forward without the all-reduce), summed here.
        parts = sum(get(m).method.apply(get(m), x[:, r * n : (r + 1) * n]) for r, m in enumerate(ranks))
        torch.testing.assert_close(parts, get(full).forward(x), rtol=1e-5, atol=1e-5)
    # Column-parallel gate/up: each rank's output is its slice of the full one.
    x = torch.randn(2, cfg.hidden_size)
    i = cfg.intermediate_size
    out_full = full.layers[0].mlp.gate_up_proj.forward(x)
    for r, m in enumerate(ranks):
        out = m.layers[0].mlp.gate_up_proj.forward(x)
        n = i // size
        torch.testing.assert_close(out[:, :n], out_full[:, r * n : (r + 1) * n])
        torch.testing.assert_close(out[:, n:], out_full[:, i + r * n : i + (r + 1) * n])


def test_kv_cache_is_sized_per_rank(gqa_checkpoint):
    _, cfg = load_model(gqa_checkpoint[0], torch.float32)
    one = kv_bytes_per_block(cfg, 16, torch.float32)
    assert kv_bytes_per_block(cfg, 16, torch.float32, TensorParallel(2, 0)) * 2 == one
    # Fewer KV heads than ranks: each rank keeps one (replicated).
    assert kv_bytes_per_block(cfg, 16, torch.float32, TensorParallel(4, 1)) * cfg.num_kv_heads == one
    with pytest.raises(ValueError, match="do not split"):
        kv_heads_per_rank(3, TensorParallel(2, 0))


def test_a_rank_reads_only_its_part_of_the_file(tmp_path, monkeypatch):
    """Weight loaders index safetensors slices: no full tensor is read for a sliced projection."""
    import tailserve.model.loader as loader_mod

    path = save_checkpoint(build_hf_model("llama"), tmp_path / "ck")
    read: list[tuple] = []
    real_source = loader_mod._TensorSource

    class Recording(real_source):
        def get_slice(self, key):
            name, sl = super().get_slice(key)

            class Spy:
                def get_shape(self):
                    return sl.get_shape()

                def __getitem__(self, index):
                    t = sl[index]
                    read.append((key, tuple(t.shape), tuple(sl.get_shape())))
                    return t

            return name, Spy()

    monkeypatch.setattr(loader_mod, "_TensorSource", Recording)
    load_model(path, torch.float32, tp=TensorParallel(2, 1))
    sliced = [r for r in read if "q_proj" in r[0] or "down_proj" in r[0]]
    assert sliced and all(shape[0] * shape[1] * 2 == full[0] * full[1] for _, shape, full in sliced)
