"""tailserve: an LLM inference engine and performance toolkit.

Measurement (request timelines, latency quantiles, tail attribution), lossless speculative
decoding, and memory governance (paged KV cache, prefix caching, allocator monitoring).
"""

from tailserve.config import EngineConfig
from tailserve.engine.llm import LLM
from tailserve.engine.llm_engine import LLMEngine
from tailserve.errors import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    ConfigError,
    InvalidRequestError,
    TailserveError,
    UnsupportedArchitectureError,
)
from tailserve.outputs import CompletionOutput, RequestOutput
from tailserve.sampling_params import SamplingParams

__version__ = "0.1.0"

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
    "TailserveError",
    "UnsupportedArchitectureError",
    "__version__",
]
