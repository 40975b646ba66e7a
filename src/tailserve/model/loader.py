"""Load a Hugging Face-format checkpoint folder (safetensors only) into ``LlamaFamilyModel``.

The model is built on the meta device and each parameter is assigned the tensor read from
the memory-mapped safetensors file, so the weights are never held twice (no random init,
no full state dict). Pickled checkpoints (``*.bin``) are refused: unpickling runs code.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterator
from contextlib import ExitStack

import torch
from safetensors import safe_open
from torch import nn

from tailserve.errors import CheckpointFormatError, CheckpointNotFoundError
from tailserve.model.config import ModelArchConfig, load_arch_config
from tailserve.model.llama import LlamaFamilyModel
from tailserve.model.rope import RotaryEmbedding


def checkpoint_files(model_dir: pathlib.Path) -> list[pathlib.Path]:
    index = model_dir / "model.safetensors.index.json"
    single = model_dir / "model.safetensors"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise CheckpointFormatError(f"{index}: invalid safetensors index ({e})") from None
        files = sorted({model_dir / name for name in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise CheckpointNotFoundError(f"{f}: shard listed in {index.name} not found")
        return files
    if single.is_file():
        return [single]
    if any(model_dir.glob("*.bin")) or any(model_dir.glob("*.pt")):
        raise CheckpointFormatError(
            f"{model_dir}: only pickled weights (*.bin/*.pt) found; tailserve loads safetensors only "
            "(convert with transformers: model.save_pretrained(dir, safe_serialization=True))")
    raise CheckpointNotFoundError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")


class _TensorSource:
    """Key -> tensor lookup across the (possibly sharded) safetensors files."""

    def __init__(self, files: list[pathlib.Path], stack: ExitStack) -> None:
        self._where: dict[str, tuple[pathlib.Path, object]] = {}
        for f in files:
            try:
                handle = stack.enter_context(safe_open(str(f), framework="pt", device="cpu"))
            except Exception as e:  # safetensors raises its own error types for corrupt headers
                raise CheckpointFormatError(f"{f}: not a valid safetensors file ({e})") from None
            for key in handle.keys():  # noqa: SIM118 - safe_open is not iterable
                self._where[key] = (f, handle)
        self.files = files

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def get(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if key not in self._where:
            names = ", ".join(str(f.name) for f in self.files)
            raise CheckpointFormatError(f"tensor {key!r} missing from checkpoint ({names})")
        f, handle = self._where[key]
        tensor = handle.get_tensor(key)  # type: ignore[attr-defined]
        if tuple(tensor.shape) != tuple(shape):
            raise CheckpointFormatError(
                f"{f.name}: tensor {key!r} has shape {tuple(tensor.shape)}, expected {tuple(shape)}")
        return tensor.to(dtype)


def _assign(module: nn.Module, name: str, tensor: torch.Tensor, device: torch.device) -> None:
    setattr(module, name, nn.Parameter(tensor.to(device).contiguous(), requires_grad=False))


def load_model(model_dir: str | pathlib.Path, dtype: torch.dtype | None = None,
               device: str | torch.device = "cpu", max_positions: int | None = None,
               pack_cpu_weights: bool = False) -> tuple[LlamaFamilyModel, ModelArchConfig]:
    """Load a checkpoint folder. ``pack_cpu_weights`` reorders the projections for oneDNN
    (see ``tailserve.model.linear``); the engine does so on the CPU by default."""
    model_dir = pathlib.Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointNotFoundError(f"{model_dir}: model folder not found")
    cfg = load_arch_config(model_dir)
    dtype = dtype or cfg.dtype
    device = torch.device(device)
    files = checkpoint_files(model_dir)
    rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, max_positions or cfg.max_position_embeddings, dtype)
    with torch.device("meta"):
        model = LlamaFamilyModel(cfg, rotary)

    with ExitStack() as stack:
        src = _TensorSource(files, stack)
        for module, attr, key, shape in _weight_plan(model, cfg):
            if isinstance(key, tuple):
                tensor = torch.cat([src.get(k, s, dtype) for k, s in key], dim=0)
            else:
                tensor = src.get(key, shape, dtype)
            _assign(module, attr, tensor, device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens
    model.rotary.to(device)
    leftover = [n for n, p in model.named_parameters() if p.is_meta]
    if leftover:  # a bug in the weight plan, not a user error
        raise RuntimeError(f"parameters left unloaded: {leftover}")
    if pack_cpu_weights and device.type == "cpu":
        model.pack_for_cpu()
    model.eval()
    return model, cfg


def _weight_plan(model: LlamaFamilyModel, cfg: ModelArchConfig) -> Iterator[tuple[nn.Module, str, object, tuple]]:
    """(module, attribute, HF key or ((key, shape), ...) to concatenate, shape) for every weight."""
    hid, inter, q, kv, d = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size, cfg.head_dim
    yield model, "embed_tokens", "model.embed_tokens.weight", (cfg.vocab_size, hid)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        yield layer.input_layernorm, "weight", p + "input_layernorm.weight", (hid,)
        yield layer.post_attention_layernorm, "weight", p + "post_attention_layernorm.weight", (hid,)
        yield attn.qkv_proj, "weight", tuple((p + f"self_attn.{n}_proj.weight", (s, hid))
                                      for n, s in (("q", q), ("k", kv), ("v", kv))), None
        if cfg.qkv_bias:
            yield attn.qkv_proj, "bias", tuple((p + f"self_attn.{n}_proj.bias", (s,))
                                          for n, s in (("q", q), ("k", kv), ("v", kv))), None
        yield attn.o_proj, "weight", p + "self_attn.o_proj.weight", (hid, q)
        if cfg.o_bias:
            yield attn.o_proj, "bias", p + "self_attn.o_proj.bias", (hid,)
        if cfg.qk_norm:
            yield attn.q_norm, "weight", p + "self_attn.q_norm.weight", (d,)
            yield attn.k_norm, "weight", p + "self_attn.k_norm.weight", (d,)
        yield mlp.gate_up_proj, "weight", ((p + "mlp.gate_proj.weight", (inter, hid)),
                                    (p + "mlp.up_proj.weight", (inter, hid))), None
        if cfg.mlp_bias:
            yield mlp.gate_up_proj, "bias", ((p + "mlp.gate_proj.bias", (inter,)),
                                             (p + "mlp.up_proj.bias", (inter,))), None
            yield mlp.down_proj, "bias", p + "mlp.down_proj.bias", (hid,)
        yield mlp.down_proj, "weight", p + "mlp.down_proj.weight", (hid, inter)
    yield model.norm, "weight", "model.norm.weight", (hid,)
    if not cfg.tie_word_embeddings:
        yield model.lm_head, "weight", "lm_head.weight", (cfg.vocab_size, hid)
