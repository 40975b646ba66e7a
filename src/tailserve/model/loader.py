"""Load a Hugging Face-format checkpoint folder (safetensors only) into ``LlamaFamilyModel``.

The model is built on the meta device (no random init), each parameter then gets its
storage and is filled by its own ``weight_loader`` from a safetensors *slice*, so a
tensor-parallel rank reads only its part of each tensor and no full state dict is ever
held. Fused parameters (``qkv_proj``, ``gate_up_proj``) are loaded part by part through a
small name map. Pickled checkpoints (``*.bin``) are refused: unpickling runs code.
"""

from __future__ import annotations

import json
import pathlib
from contextlib import ExitStack

import torch
from safetensors import safe_open
from torch import nn

from tailserve.errors import CheckpointFormatError, CheckpointNotFoundError
from tailserve.model.config import ModelArchConfig, load_arch_config
from tailserve.model.linear import SINGLE, LinearMethod, TensorParallel, default_weight_loader
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
    """Key -> safetensors slice across the (possibly sharded) files: a weight loader reads
    only the part it indexes."""

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

    def get_slice(self, key: str) -> tuple[str, object]:
        """(file name, slice) for ``key``."""
        if key not in self._where:
            names = ", ".join(str(f.name) for f in self.files)
            raise CheckpointFormatError(f"tensor {key!r} missing from checkpoint ({names})")
        f, handle = self._where[key]
        return f.name, handle.get_slice(key)  # type: ignore[attr-defined]


# Our fused parameters and the checkpoint tensors (with shard ids) they are loaded from.
PACKED_MODULES: dict[str, tuple[tuple[str, object], ...]] = {
    "qkv_proj": (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")),
    "gate_up_proj": (("gate_proj", 0), ("up_proj", 1)),
}


def checkpoint_keys(param_name: str) -> tuple[tuple[str, object], ...]:
    """The Hugging Face keys (and shard ids) that one of our parameters is loaded from."""
    if param_name == "embed_tokens":
        return (("model.embed_tokens.weight", None),)
    prefix = "" if param_name.startswith("lm_head.") else "model."
    for fused, parts in PACKED_MODULES.items():
        if f".{fused}." in param_name:
            return tuple((prefix + param_name.replace(fused, part), shard) for part, shard in parts)
    return ((prefix + param_name, None),)


def _materialize(model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Give every meta parameter real (uninitialised) storage, keeping its weight loader."""
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if not param.is_meta:
                continue
            new = nn.Parameter(torch.empty(param.shape, dtype=dtype, device=device), requires_grad=False)
            loader = getattr(param, "weight_loader", None)
            if loader is not None:
                new.weight_loader = loader  # type: ignore[attr-defined]
            setattr(module, name, new)


def load_weights(model: LlamaFamilyModel, src: _TensorSource) -> None:
    """Fill every parameter through its own weight loader."""
    for name, param in model.named_parameters():
        loader = getattr(param, "weight_loader", default_weight_loader)
        for key, shard in checkpoint_keys(name):
            file_name, sl = src.get_slice(key)
            try:
                loader(param, sl, shard, name=key)
            except CheckpointFormatError as e:
                raise CheckpointFormatError(f"{file_name}: {e}") from None


def load_model(model_dir: str | pathlib.Path, dtype: torch.dtype | None = None,
               device: str | torch.device = "cpu", max_positions: int | None = None,
               linear_method: LinearMethod | None = None,
               tp: TensorParallel = SINGLE) -> tuple[LlamaFamilyModel, ModelArchConfig]:
    """Load a checkpoint folder. ``linear_method`` (see ``tailserve.model.linear``) is
    applied once loading is done; None leaves plain ``F.linear`` for the caller to change
    later (``model.set_linear_method``), as the worker does for a draft model whose NumPy
    step copies the plain weights first."""
    model_dir = pathlib.Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointNotFoundError(f"{model_dir}: model folder not found")
    cfg = load_arch_config(model_dir)
    dtype = dtype or cfg.dtype
    device = torch.device(device)
    files = checkpoint_files(model_dir)
    rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, max_positions or cfg.max_position_embeddings, dtype)
    with torch.device("meta"):
        model = LlamaFamilyModel(cfg, rotary, tp)
    if cfg.tie_word_embeddings:
        del model.lm_head.weight  # it shares the embedding's storage once that is loaded
    _materialize(model, dtype, device)
    with ExitStack() as stack:
        load_weights(model, _TensorSource(files, stack))
    if cfg.tie_word_embeddings:
        model.lm_head.tie(model.embed_tokens)
    model.rotary.to(device)
    leftover = [n for n, p in model.named_parameters() if p.is_meta]
    if leftover:  # a bug in the loaders, not a user error
        raise RuntimeError(f"parameters left unloaded: {leftover}")
    if linear_method is not None:
        model.set_linear_method(linear_method)
    model.eval()
    return model, cfg
