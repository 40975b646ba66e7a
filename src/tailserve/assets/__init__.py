"""The built-in default model pair (see README.md in this folder)."""

from __future__ import annotations

import pathlib

ASSETS_DIR = pathlib.Path(__file__).resolve().parent
DEFAULT_TARGET_DIR = ASSETS_DIR / "default-target"
DEFAULT_DRAFT_DIR = ASSETS_DIR / "default-draft"


def resolve_model_path(model: str | None, draft: bool = False) -> str:
    """None or 'builtin' -> the built-in checkpoint folder; anything else is returned as is."""
    if model is None or model == "builtin":
        return str(DEFAULT_DRAFT_DIR if draft else DEFAULT_TARGET_DIR)
    return model
