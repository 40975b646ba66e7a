"""The built-in default model pair: standard HF checkpoints, a lossless tokenizer, packaged."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import sysconfig

import pytest
import torch

from tailserve import LLM, SamplingParams
from tailserve.assets import DEFAULT_DRAFT_DIR, DEFAULT_TARGET_DIR
from tailserve.model.tokenizer import Tokenizer

REPO = pathlib.Path(__file__).resolve().parents[1]
PROMPTS = ["def fibonacci(n):", "import os\n\ndef list_files(path):\n", "class Stack:\n    def __init__(self):"]


def test_assets_are_small_enough_and_complete():
    total = 0
    for d in (DEFAULT_TARGET_DIR, DEFAULT_DRAFT_DIR):
        for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                     "generation_config.json"):
            assert (d / name).is_file(), d / name
        total += sum(f.stat().st_size for f in d.iterdir())
    assert total <= 40 * 1024 * 1024
    assert (DEFAULT_TARGET_DIR / "tokenizer.json").read_bytes() == (DEFAULT_DRAFT_DIR / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("folder", [DEFAULT_TARGET_DIR, DEFAULT_DRAFT_DIR], ids=["target", "draft"])
def test_transformers_loads_them_and_agrees_with_tailserve(folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(folder)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(str(folder), dtype="float32", kv_cache_memory_bytes=16 << 20)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        ids = hf_tok(prompt, return_tensors="pt")
        assert ids.input_ids[0].tolist() == out.prompt_token_ids
        with torch.inference_mode():
            ref = hf.generate(**ids, max_new_tokens=24, min_new_tokens=24, do_sample=False,
                              pad_token_id=hf_tok.pad_token_id)
        assert ref[0, ids.input_ids.shape[1]:].tolist() == out.token_ids
        assert hf_tok.decode(ref[0, ids.input_ids.shape[1]:], skip_special_tokens=True) == out.text


def _held_out_files(limit: int) -> list[pathlib.Path]:
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    names = (DEFAULT_TARGET_DIR / "held_out_files.txt").read_text().split()
    return [root / n for n in names if (root / n).is_file()][:limit]


def test_tokenizer_round_trip_on_held_out_files_and_non_ascii():
    tok = Tokenizer(DEFAULT_TARGET_DIR)
    files = _held_out_files(8)
    assert files, "no held-out files found in this Python's standard library"
    texts = [f.read_text(encoding="utf-8") for f in files]
    texts += ["naïve café — 東京 🚀 Ωμέγα\n\tmixed   spaces\r\n", "\x00\x7f control", "ℝ∑∫ √2 ≈ 1.414"]
    for text in texts:
        ids = tok.encode(text)
        assert ids[0] == tok.bos_token_id
        assert tok.decode(ids) == text


def test_cli_uses_the_builtin_model_by_default():
    p = subprocess.run([sys.executable, "-m", "tailserve", "generate", "--max-tokens", "16", "def fibonacci(n):"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("def fibonacci(n):") and len(p.stdout.strip()) > len("def fibonacci(n):")


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    """Run a command; on failure the assertion shows its stderr, not only the exit code."""
    out = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert out.returncode == 0, f"{cmd} exited {out.returncode}:\n{out.stderr[-4000:]}"
    return out


@pytest.mark.slow
def test_wheel_carries_the_assets_into_a_fresh_venv(tmp_path):
    """pip install of the project into a new virtual environment, outside the source tree."""
    wheel_dir = tmp_path / "wheel"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
          "-w", str(wheel_dir), str(REPO)], timeout=600)
    wheel = next(wheel_dir.glob("tailserve-*.whl"))
    venv = tmp_path / "venv"
    # No pip inside (ensurepip takes 7 s here): this environment's pip installs into it (--python).
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    # The running interpreter's packages (torch & co., from a venv or not) reach the new venv
    # through a .pth of plain paths, without a download. Plain paths: the outer environment's
    # own .pth files (an editable install of tailserve) are not processed, so tailserve
    # itself comes only from the wheel.
    outer = sorted({sysconfig.get_paths()[k] for k in ("purelib", "platlib")})
    inner = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                           capture_output=True, text=True, check=True).stdout.strip()
    pathlib.Path(inner, "_outer_site.pth").write_text("\n".join(outer) + "\n")
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", "--force-reinstall",
          str(wheel)], timeout=600)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = _run([str(py), "-c", "import tailserve, sys; print(tailserve.__file__)"], cwd=tmp_path, env=env)
    assert str(venv) in where.stdout
    out = subprocess.run([str(venv / "bin" / "tailserve"), "generate", "--max-tokens", "8", "import os"],
                         cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("import os")
