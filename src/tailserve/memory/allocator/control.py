"""Applying a ``PYTORCH_CUDA_ALLOC_CONF`` and reporting what is in force.

The caching allocator reads its configuration once, when CUDA initialises; a setting made
later is silently ignored by PyTorch. So the engine validates the value it is given
(``parse_alloc_conf``), writes it to the environment before anything touches CUDA, and
refuses (ConfigError) when CUDA is already initialised with a different value, rather than
pretend. A value already in the environment and a different one in the engine's
configuration is a conflict too: one of them would be silently dropped.

``garbage_collection_threshold`` only acts when a per-process memory fraction is set
(``torch.cuda.set_per_process_memory_fraction``, which ``--cuda-memory-fraction`` sets):
without one PyTorch ignores it, and ``apply_alloc_conf`` warns once.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from tailserve.errors import ConfigError
from tailserve.memory.allocator.conf import AllocatorConf, parse_alloc_conf

log = logging.getLogger("tailserve.memory")
ENV = "PYTORCH_CUDA_ALLOC_CONF"


@dataclass(frozen=True)
class AllocatorSettings:
    """What is in force: the configuration text (empty: PyTorch's defaults), where it came
    from, the memory fraction, and the warnings given."""

    text: str
    source: str  # "engine config", "environment", or "default"
    conf: AllocatorConf
    memory_fraction: float | None
    warnings: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, object]:
        return {"conf": self.text or "default", "source": self.source, "memory_fraction": self.memory_fraction,
                "warnings": list(self.warnings)}


def _cuda_initialized() -> bool:
    return bool(torch.cuda.is_available() and torch.cuda.is_initialized())


def apply_alloc_conf(requested: str | None, memory_fraction: float | None = None,
                     cuda_initialized: bool | None = None, strict_env: bool = True) -> AllocatorSettings:
    """Validate and apply ``requested`` (None: keep the environment's, if any); returns what
    is in force. ``cuda_initialized`` overrides the check (tests). ``strict_env`` False (a
    CPU-only engine): a bad value in the environment is a warning, not an error, since no
    allocator will read it."""
    initialized = _cuda_initialized() if cuda_initialized is None else cuda_initialized
    env = os.environ.get(ENV) or os.environ.get("PYTORCH_ALLOC_CONF")
    if requested is not None:
        conf = parse_alloc_conf(requested)
        if env is not None and env != requested:
            raise ConfigError(f"{ENV} is {env!r} in the environment and {requested!r} in the engine's "
                              "configuration; set only one")
        if initialized and env != requested:
            raise ConfigError(f"cannot apply {ENV}={requested!r}: CUDA is already initialised in this process, "
                              "and the caching allocator reads its settings only once, at initialisation")
        os.environ[ENV] = requested
        text, source = requested, "engine config"
    elif env is not None:
        text, source = env, "environment"
        try:
            conf = parse_alloc_conf(env)
        except ConfigError as e:
            if strict_env:
                raise
            log.warning("ignoring the environment's allocator settings on the CPU: %s", e)
            conf = AllocatorConf()
    else:
        conf, text, source = AllocatorConf(), "", "default"
    warnings = []
    if conf.garbage_collection_threshold > 0 and memory_fraction is None:
        msg = ("garbage_collection_threshold has no effect without a per-process memory fraction; "
               "set --cuda-memory-fraction (torch.cuda.set_per_process_memory_fraction)")
        log.warning(msg)
        warnings.append(msg)
    return AllocatorSettings(text, source, conf, memory_fraction, tuple(warnings))
