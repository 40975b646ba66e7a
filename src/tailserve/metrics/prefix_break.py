"""Where a request's prompt left the prefix cache, and which part of the prompt that was.

The scheduler reports, at a request's first admission, the first prompt token that no cached
block continues with (``break_token``: within the block after the longest cached match, the
first position where this prompt differs from every cached block that follows the same
prefix). For chat requests the server knows the rendered prompt's segments (the tool
definitions, and each message as sent), so the break is named by the segment that holds it:
"70% of recomputed prompt tokens follow a tool-list edit" is then a dashboard query.

A full hit (every full block the cache could have given was cached) has no break: what is
recomputed is the last partial block, which no cache can hold.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

# The Prometheus label values of ``tailserve:prefix_cache_recomputed_tokens_total``.
SEGMENT_KINDS = ("tools", "system", "user", "assistant", "tool", "other")


@dataclass(frozen=True)
class PromptSegment:
    """A part of a rendered prompt, from token ``start`` up to the next segment's start."""

    start: int
    label: str  # "tools" or "messages[i]" (the i-th message as sent, 0-based)
    kind: str  # one of SEGMENT_KINDS

    def __post_init__(self) -> None:
        if self.kind not in SEGMENT_KINDS:
            raise ValueError(f"segment kind must be one of {SEGMENT_KINDS}, got {self.kind!r}")


@dataclass(frozen=True)
class PrefixBreak:
    """One request's prefix-cache outcome, as ``timing.prefix_cache`` carries it."""

    cached_tokens: int
    break_at_token: int | None  # None: a full hit
    break_segment: str | None  # None: a full hit, or a prompt without segments (completions)
    kind: str  # the break segment's kind ("other" without one): the counter's label
    recomputed_tokens: int  # prompt tokens computed rather than taken from the cache

    def to_wire(self) -> dict[str, int | str | None]:
        return {"cached_tokens": self.cached_tokens, "break_at_token": self.break_at_token,
                "break_segment": self.break_segment}


def locate_break(num_prompt_tokens: int, cached_tokens: int, break_token: int,
                 segments: Sequence[PromptSegment] = ()) -> PrefixBreak:
    """The segment holding ``break_token`` (``>= num_prompt_tokens``: a full hit). Segments
    are sorted by start; a token before the first segment's start belongs to none ("other")."""
    recomputed = max(num_prompt_tokens - cached_tokens, 0)
    if break_token >= num_prompt_tokens:
        return PrefixBreak(cached_tokens, None, None, "other", recomputed)
    i = bisect.bisect_right([s.start for s in segments], break_token) - 1
    if i < 0:
        return PrefixBreak(cached_tokens, break_token, None, "other", recomputed)
    return PrefixBreak(cached_tokens, break_token, segments[i].label, segments[i].kind, recomputed)


def role_kind(role: object) -> str:
    """A message's segment kind from its role (``developer`` counts as system, as OpenAI
    treats it; anything unknown as other)."""
    if role == "developer":
        return "system"
    return role if isinstance(role, str) and role in SEGMENT_KINDS[1:5] else "other"
