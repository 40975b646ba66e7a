"""tailserve: an LLM inference engine and performance toolkit.

Measurement (request timelines, latency quantiles, tail attribution), lossless speculative
decoding, and memory governance (paged KV cache, prefix caching, allocator monitoring).

The engine's names are imported on first use (PEP 562), so ``tailserve --help`` and the
load generator do not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tailserve.errors import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    ConfigError,
    InvalidRequestError,
    TailserveError,
    UnsupportedArchitectureError,
)

__version__ = "0.1.0"

_LAZY = {
    "EngineConfig": "tailserve.config",
    "LLM": "tailserve.engine.llm",
    "LLMEngine": "tailserve.engine.llm_engine",
    "CompletionOutput": "tailserve.outputs",
    "RequestOutput": "tailserve.outputs",
    "SamplingParams": "tailserve.sampling_params",
    "StructuredOutputsParams": "tailserve.sampling_params",
}

if TYPE_CHECKING:
    from tailserve.config import EngineConfig
    from tailserve.engine.llm import LLM
    from tailserve.engine.llm_engine import LLMEngine
    from tailserve.outputs import CompletionOutput, RequestOutput
    from tailserve.sampling_params import SamplingParams, StructuredOutputsParams


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tailserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "LLM",
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointNotFoundError",
    "CompletionOutput",
    "ConfigError",
    "EngineConfig",
    "InvalidRequestError",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "TailserveError",
    "UnsupportedArchitectureError",
    "__version__",
]
