"""The built-in default model pair (see README.md in this folder), and where a ``--model``
value points: a local folder, a Hugging Face model id found in the local cache, or the
built-in pair."""

from __future__ import annotations

import os
import pathlib
import re

from tailserve.errors import CheckpointNotFoundError

ASSETS_DIR = pathlib.Path(__file__).resolve().parent
DEFAULT_TARGET_DIR = ASSETS_DIR / "default-target"
DEFAULT_DRAFT_DIR = ASSETS_DIR / "default-draft"
_HF_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def hf_cache_dir() -> pathlib.Path:
    """The hub cache, as huggingface_hub finds it: HF_HUB_CACHE, else HF_HOME/hub, else
    ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return pathlib.Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return pathlib.Path(home).expanduser() / "hub"


def find_in_hf_cache(model_id: str, revision: str = "main") -> pathlib.Path | None:
    """The cached snapshot folder of ``org/name`` (its ``refs/<revision>`` commit, or the only
    snapshot when the ref is missing), without any network."""
    repo = hf_cache_dir() / ("models--" + model_id.replace("/", "--"))
    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        return None
    ref = repo / "refs" / revision
    if ref.is_file():
        snap = snapshots / ref.read_text().strip()
        if snap.is_dir():
            return snap
    found = [p for p in snapshots.iterdir() if p.is_dir()]
    return found[0] if len(found) == 1 else None


def resolve_model_path(model: str | None, draft: bool = False) -> str:
    """None or 'builtin' -> the built-in checkpoint folder; a folder -> itself; a Hugging
    Face id (``org/name``) that is not a folder -> its snapshot in the local cache. Anything
    else is a clear error naming what was looked for."""
    if model is None or model == "builtin":
        return str(DEFAULT_DRAFT_DIR if draft else DEFAULT_TARGET_DIR)
    path = pathlib.Path(model).expanduser()
    if path.is_dir():
        return str(path)
    if path.exists():
        raise CheckpointNotFoundError(f"{model}: not a folder (a checkpoint is a folder with config.json and "
                                      "*.safetensors)")
    if _HF_ID.fullmatch(model) and not model.startswith((".", "~")):
        snap = find_in_hf_cache(model)
        if snap is not None:
            return str(snap)
        raise CheckpointNotFoundError(
            f"{model}: not found: no such folder, and not in the local Hugging Face cache ({hf_cache_dir()}); "
            f"tailserve does not download models: fetch it where there is network (huggingface-cli download "
            f"{model}) and copy the cache or the folder here")
    raise CheckpointNotFoundError(f"{model}: not found (no such folder)")
