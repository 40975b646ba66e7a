"""Penalties and logit bias, applied to a batch of logits before sampling (batched: one
scatter builds the token counts for every row; no Python loop over the vocabulary).

Definitions, as OpenAI and vLLM use them, for a row whose generated tokens so far have
counts c[t] and whose prompt + generated tokens are the set S:

    logits[t] -= frequency_penalty * c[t] + presence_penalty * (c[t] > 0)
    logits[t] = logits[t] / r if logits[t] > 0 else logits[t] * r      for t in S (r = repetition_penalty)
    logits[t] += logit_bias[t]

(repetition first, as in vLLM's order: repetition, then frequency/presence, then bias.)
The model's raw logits are left alone: logprobs are reported from them, as vLLM does by
default. Requests that use these get no drafts under speculative decoding (their k+1
verification rows would each need a different history).
"""

from __future__ import annotations

import torch

from tailserve.sampling_params import SamplingParams


def apply_logits_processors(logits: torch.Tensor, rows: list[int], params: list[SamplingParams],
                            prompt_ids: list[list[int]], output_ids: list[list[int]]) -> torch.Tensor:
    """A processed copy of ``logits`` (N, V); ``rows[i]`` is request i's row. Returns the
    input itself when no request uses any processor."""
    use = [i for i, p in enumerate(params) if p.has_logits_processors]
    if not use:
        return logits
    out = logits.float().clone()
    v = out.shape[-1]
    dev = out.device
    sel = torch.tensor([rows[i] for i in use], device=dev)
    x = out[sel]  # (R, V)
    r = len(use)

    def counts(lists: list[list[int]]) -> torch.Tensor:
        c = torch.zeros(r, v, device=dev)
        row_idx = [j for j, ids in enumerate(lists) for _ in ids]
        if row_idx:
            tok = torch.tensor([t for ids in lists for t in ids], device=dev).clamp_(0, v - 1)
            c.index_put_((torch.tensor(row_idx, device=dev), tok), torch.ones(len(row_idx), device=dev),
                         accumulate=True)
        return c

    out_counts = counts([output_ids[i] for i in use])
    rep = torch.tensor([params[i].repetition_penalty for i in use], device=dev)[:, None]
    if (rep != 1.0).any():
        seen = (counts([prompt_ids[i] for i in use]) + out_counts) > 0
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    freq = torch.tensor([params[i].frequency_penalty for i in use], device=dev)[:, None]
    pres = torch.tensor([params[i].presence_penalty for i in use], device=dev)[:, None]
    x = x - freq * out_counts - pres * (out_counts > 0).float()
    bias_rows = [j for j, i in enumerate(use) for _ in params[i].logit_bias]
    if bias_rows:
        ids = torch.tensor([t for i in use for t, _ in params[i].logit_bias], device=dev).clamp_(0, v - 1)
        vals = torch.tensor([b for i in use for _, b in params[i].logit_bias], device=dev)
        x = x.index_put((torch.tensor(bias_rows, device=dev), ids), vals, accumulate=True)
    out[sel] = x
    return out
