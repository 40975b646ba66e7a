"""Evaluate the built-in model pair on held-out standard-library files.

Reports, on the held-out files listed in ``held_out_files.txt`` (never seen in training):
the target's and the draft's next-token cross-entropy and perplexity, the greedy agreement
rate between draft and target (fraction of positions where their argmax tokens match: it
predicts speculative-decoding acceptance), and the target's greedy completions of a few
held-out function headers. Runs through tailserve's own model code.

    python scripts/eval_default_models.py [--windows 48] [--completions 3] [--markdown FILE]
"""

from __future__ import annotations

import argparse
import math
import pathlib
import re
import sysconfig

import torch
import torch.nn.functional as F

from tailserve import LLM, SamplingParams
from tailserve.assets import DEFAULT_DRAFT_DIR, DEFAULT_TARGET_DIR
from tailserve.attention.reference import build_attention_metadata
from tailserve.model.linear import build_linear_method, onednn_available
from tailserve.model.loader import load_model
from tailserve.model.tokenizer import Tokenizer

WINDOW = 256


def held_out_texts() -> list[tuple[str, str]]:
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    names = (DEFAULT_TARGET_DIR / "held_out_files.txt").read_text().split()
    out = []
    for name in names:
        path = root / name
        if path.is_file():  # another Python version may lack a file
            out.append((name, path.read_bytes().decode("utf-8", errors="replace")))
    return out


@torch.inference_mode()
def window_logits(model, cfg, ids: list[int]) -> torch.Tensor:
    n = len(ids)
    bs = 16
    nb = -(-n // bs)
    caches = [torch.zeros(2, nb, bs, cfg.num_kv_heads, cfg.head_dim, dtype=model.embed_tokens.dtype)
              for _ in range(cfg.num_layers)]
    meta = build_attention_metadata([n], [n], [list(range(nb))], bs, cfg.sliding_window, torch.device("cpu"))
    return model.compute_logits(model(torch.tensor(ids), torch.arange(n), caches, meta))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=48, help="held-out windows of 256 tokens to score")
    ap.add_argument("--completions", type=int, default=3)
    ap.add_argument("--markdown", help="also write the report to this file")
    ap.add_argument("--draft", default=str(DEFAULT_DRAFT_DIR), help="draft checkpoint to score")
    args = ap.parse_args()

    tok = Tokenizer(DEFAULT_TARGET_DIR)
    method = build_linear_method("onednn-packed" if onednn_available() else "plain")
    target, tcfg = load_model(DEFAULT_TARGET_DIR, torch.float32, linear_method=method)
    draft, dcfg = load_model(pathlib.Path(args.draft), torch.float32, linear_method=method)
    texts = held_out_texts()
    ids: list[int] = []
    for _, text in texts:
        ids += [*tok.encode(text), tok.eos_token_id or 1]
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, len(ids) - WINDOW - 1, (args.windows,), generator=g).tolist()
    t_loss = d_loss = agree = count = 0.0
    for s in starts:
        window = ids[s : s + WINDOW + 1]
        inp, tgt = window[:-1], torch.tensor(window[1:])
        tl, dl = window_logits(target, tcfg, inp), window_logits(draft, dcfg, inp)
        t_loss += F.cross_entropy(tl, tgt, reduction="sum").item()
        d_loss += F.cross_entropy(dl, tgt, reduction="sum").item()
        agree += (tl.argmax(-1) == dl.argmax(-1)).sum().item()
        count += len(tgt)
    t_ce, d_ce = t_loss / count, d_loss / count
    lines = [
        f"held-out files: {len(texts)}; scored {int(count)} tokens in {args.windows} windows of {WINDOW}",
        f"target: cross-entropy {t_ce:.3f} nats/token, perplexity {math.exp(t_ce):.2f}",
        f"draft:  cross-entropy {d_ce:.3f} nats/token, perplexity {math.exp(d_ce):.2f}",
        f"greedy agreement draft vs target: {agree / count:.3f}",
    ]

    headers = []
    for _, text in texts:
        # Top-level function headers with a one-line docstring, so the body is what follows.
        # The prompt stops before the newline: BPE merged "\n" with the next line's indent in
        # training, so a prompt ending in a bare "\n" would sit on an unnatural token boundary.
        for m in re.finditer(r"^def [a-z_][a-z0-9_]*\([^)\n]*\):\n    \"\"\"[^\n]*\"\"\"$", text, re.M):
            headers.append(m.group(0))
    llm = LLM(dtype="float32", kv_cache_memory_bytes=64 << 20)
    # Agreement where decoding needs it: on the target's own greedy continuations of held-out
    # function headers (what a draft sees during speculative decoding).
    pol = headers[:: max(1, len(headers) // 16)][:16]
    agree_gen = count_gen = 0
    for h, out in zip(pol, llm.generate(pol, SamplingParams(temperature=0, max_tokens=128, ignore_eos=True))):
        seq = [*tok.encode(h), *out.token_ids]
        n_prompt = len(seq) - len(out.token_ids)
        tl, dl = window_logits(target, tcfg, seq[:-1]), window_logits(draft, dcfg, seq[:-1])
        agree_gen += (tl.argmax(-1) == dl.argmax(-1))[n_prompt - 1 :].sum().item()
        count_gen += len(out.token_ids)
    lines.append(f"greedy agreement on the target's own continuations ({len(pol)} held-out headers x 128 tokens): "
                 f"{agree_gen / count_gen:.3f}")
    step = max(1, len(headers) // max(args.completions, 1))
    comps = []
    for h in headers[::step][: args.completions]:
        out = llm.generate([h], SamplingParams(temperature=0, max_tokens=80, stop=["\n\n\n", "\ndef ", "\nclass "]))[0]
        comps.append(h + out.text)
    report = "\n".join(lines)
    print(report)
    for c in comps:
        print("-" * 60 + "\n" + c)
    if args.markdown:
        md = ["```", report, "```", ""]
        for c in comps:
            md += ["```python", c.rstrip(), "```", ""]
        pathlib.Path(args.markdown).write_text("\n".join(md))


if __name__ == "__main__":
    main()
