"""The exceptions tailserve raises for problems a user can cause.

Every one names what was wrong (the file, the key, the parameter) so that the CLI can print
it on one line and the server can turn it into an OpenAI-style error body.
"""

from __future__ import annotations


class TailserveError(Exception):
    """Base class of every error tailserve raises on purpose."""


class InvalidRequestError(TailserveError, ValueError):
    """A request (prompt or sampling parameters) that cannot be served as given.

    ``param`` names the offending field, as OpenAI's error body does; ``code`` is the body's
    machine-readable code where OpenAI defines one (``context_length_exceeded``).
    """

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class ConfigError(TailserveError, ValueError):
    """An engine configuration value that is out of range or inconsistent."""


class CheckpointError(TailserveError):
    """A model checkpoint that cannot be loaded."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint folder, or a file it must contain, does not exist."""


class CheckpointFormatError(CheckpointError, ValueError):
    """A checkpoint file exists but its content is wrong: bad JSON, a missing or mis-shaped tensor."""


class UnsupportedArchitectureError(CheckpointError, ValueError):
    """config.json names an architecture (or a feature of one) that tailserve does not implement."""


class EngineDeadError(TailserveError, RuntimeError):
    """The engine cannot go on (a tensor-parallel worker process died or failed); every
    request in flight fails, and the engine must be restarted."""
