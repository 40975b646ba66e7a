"""Read a Hugging Face ``config.json`` into the few numbers the Llama-family decoder needs.

Supported: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM. The
differences between them are flags here (q/k/v bias, q/k RMSNorm, sliding window), not
separate model classes.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass
from typing import Any

import torch

from tailserve.errors import CheckpointFormatError, CheckpointNotFoundError, UnsupportedArchitectureError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "half": torch.float16,
           "float": torch.float32}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"unsupported dtype {name!r}; use one of float32, bfloat16, float16") from None


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None
    dtype: torch.dtype
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def num_parameters(self) -> int:
        """Weights of the checkpoint (norms and biases left out: they are negligible)."""
        per_layer = (self.hidden_size * (self.q_size + 2 * self.kv_size) + self.q_size * self.hidden_size
                     + 3 * self.hidden_size * self.intermediate_size)
        heads = 1 if self.tie_word_embeddings else 2
        return self.num_layers * per_layer + heads * self.vocab_size * self.hidden_size


def read_json(path: pathlib.Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointNotFoundError(f"{path}: file not found")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointFormatError(f"{path}: invalid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointFormatError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _get(cfg: dict[str, Any], key: str, path: pathlib.Path, kind: type, default: Any = ...) -> Any:
    if key not in cfg or cfg[key] is None:
        if default is ...:
            raise CheckpointFormatError(f"{path}: missing required key {key!r}")
        return default
    value = cfg[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if (isinstance(value, bool) and kind is not bool) or not isinstance(value, kind):
        raise CheckpointFormatError(f"{path}: key {key!r} should be {kind.__name__}, got {value!r}")
    return value


def _parse_rope(cfg: dict[str, Any], path: pathlib.Path) -> RopeConfig:
    # transformers < 5 writes rope_theta + rope_scaling; >= 5 writes rope_parameters.
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(scaling, dict):
        raise CheckpointFormatError(f"{path}: rope_parameters / rope_scaling must be objects")
    merged = {**params, **scaling}
    theta = merged.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedArchitectureError(
            f"{path}: rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(merged.get("original_max_position_embeddings", 8192)),
    )


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def load_arch_config(model_dir: pathlib.Path) -> ModelArchConfig:
    path = model_dir / "config.json"
    cfg = read_json(path)
    archs = cfg.get("architectures") or []
    if not isinstance(archs, list) or not archs:
        raise UnsupportedArchitectureError(f"{path}: no 'architectures' entry; cannot tell which model this is")
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"{path}: architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise UnsupportedArchitectureError(f"{path}: hidden_act {act!r} is not supported (only silu)")

    hidden = _get(cfg, "hidden_size", path, int)
    heads = _get(cfg, "num_attention_heads", path, int)
    kv_heads = _get(cfg, "num_key_value_heads", path, int, heads)
    if hidden <= 0 or heads <= 0 or kv_heads <= 0 or heads % kv_heads:
        raise CheckpointFormatError(
            f"{path}: num_attention_heads ({heads}) must be a positive multiple of num_key_value_heads ({kv_heads})")
    head_dim = _get(cfg, "head_dim", path, int, hidden // heads)

    sliding_window = cfg.get("sliding_window")
    if (arch == "Qwen2ForCausalLM" or arch == "Qwen3ForCausalLM") and not cfg.get("use_sliding_window", False):
        sliding_window = None
    if sliding_window is not None and not isinstance(sliding_window, int):
        raise CheckpointFormatError(f"{path}: sliding_window should be an integer or null")

    dtype_name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    gen_cfg_path = model_dir / "generation_config.json"
    gen_cfg = read_json(gen_cfg_path) if gen_cfg_path.exists() else {}
    eos = _eos_ids(gen_cfg.get("eos_token_id", cfg.get("eos_token_id")))
    bos = gen_cfg.get("bos_token_id", cfg.get("bos_token_id"))

    return ModelArchConfig(
        architecture=arch,
        vocab_size=_get(cfg, "vocab_size", path, int),
        hidden_size=hidden,
        intermediate_size=_get(cfg, "intermediate_size", path, int),
        num_layers=_get(cfg, "num_hidden_layers", path, int),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_get(cfg, "rms_norm_eps", path, float, 1e-6),
        max_position_embeddings=_get(cfg, "max_position_embeddings", path, int, 2048),
        rope=_parse_rope(cfg, path),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
        o_bias=arch != "Qwen2ForCausalLM" and bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=arch == "Qwen3ForCausalLM",
        sliding_window=sliding_window,
        dtype=parse_dtype(dtype_name) if isinstance(dtype_name, str) else torch.float32,
        bos_token_id=bos if isinstance(bos, int) else None,
        eos_token_ids=eos,
    )
