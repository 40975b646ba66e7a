"""Train tailserve's built-in default model pair from the Python standard library's source.

The recipe is reproducible (fixed seeds, fixed step counts) and runs on 2 CPU cores in
well under 90 minutes:

1. Corpus: every ``.py`` file of ``sysconfig.get_paths()["stdlib"]`` except test suites and
   site-packages, split *by file* into train and held-out sets (about 5% held out, chosen
   by a hash of the relative path so the split does not depend on the file order).
2. Tokenizer: byte-level BPE (``tokenizers``), 4096 entries, ``<s>``/``</s>``/``<pad>``.
   Byte-level means every UTF-8 string round-trips exactly.
3. Target: a Llama decoder (RMSNorm, RoPE, GQA, SwiGLU), ~11M parameters, trained with
   next-token cross-entropy.
4. Draft: a one-layer Llama with the same tokenizer, trained by distillation: it minimises
   KL(target || draft) on the target's next-token distributions, so that its guesses agree
   with the target's as often as possible (which is what speculative acceptance rewards).
5. On-policy distillation of the draft: the target (run by tailserve itself) continues
   prompts taken from the *training* files, greedily and by sampling; the draft goes on
   minimising KL(target || draft) on a half-and-half mix of those sequences and corpus
   windows. Decoding puts the draft on the target's own text, which is not quite like
   human-written code (more repetition, the target's habits); this stage teaches it that
   text (the idea of DistillSpec, Zhou et al. 2023).

Both are saved in ordinary Hugging Face format (config.json, model.safetensors in bfloat16,
tokenizer.json, tokenizer_config.json, generation_config.json) under
``src/tailserve/assets/``. This script needs ``transformers`` (a test/dev dependency);
the engine itself never does.

Usage: ``python scripts/train_default_models.py [--out DIR] [--target-steps N] ...``;
``--resume-onpolicy`` runs stage 5 alone on the checkpoints already in ``--out``. The
shipped draft came from stage 5 run as three resumed rounds, ``--resume-onpolicy
--onpolicy-rounds 1`` with ``--seed 0``, ``1`` and ``2`` (the same seeds as one three-round
run; between them the draft was saved in bfloat16 and reloaded).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import pathlib
import sysconfig
import time

import torch
import torch.nn.functional as F

SPECIAL_TOKENS = ["<s>", "</s>", "<pad>"]
BOS, EOS, PAD = 0, 1, 2
VOCAB_SIZE = 4096
SEQ_LEN = 256

TARGET_SHAPE = dict(
    hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
    num_attention_heads=6, num_key_value_heads=2,
)
DRAFT_SHAPE = dict(
    hidden_size=256, intermediate_size=640, num_hidden_layers=1,
    num_attention_heads=4, num_key_value_heads=1,
)

_EXCLUDED_PARTS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}


def stdlib_files() -> tuple[pathlib.Path, list[str]]:
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    rels = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(p in _EXCLUDED_PARTS or p.startswith("test_") for p in rel.parts):
            continue
        rels.append(rel.as_posix())
    return root, rels


def is_held_out(rel: str) -> bool:
    return int(hashlib.sha256(rel.encode()).hexdigest(), 16) % 20 == 0


def read_text(path: pathlib.Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")


def train_tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    # Encoding a single text prepends <s>, like Llama tokenizers do.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS)]
    )
    return tok


def encode_corpus(tok, texts: list[str]) -> torch.Tensor:
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)  # starts with <s>
        ids.append(EOS)
    return torch.tensor(ids, dtype=torch.long)


def batches(data: torch.Tensor, batch: int, gen: torch.Generator):
    while True:
        starts = torch.randint(0, data.numel() - SEQ_LEN - 1, (batch,), generator=gen)
        idx = starts[:, None] + torch.arange(SEQ_LEN + 1)[None, :]
        yield data[idx]


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def make_model(shape: dict, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB_SIZE, max_position_embeddings=2048, rope_theta=10000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=BOS, eos_token_id=EOS,
        pad_token_id=PAD, **shape,
    )
    return LlamaForCausalLM(cfg)


@torch.no_grad()
def evaluate(model, data: torch.Tensor, n_windows: int = 64) -> float:
    model.eval()
    gen = torch.Generator().manual_seed(1234)
    it = batches(data, 16, gen)
    losses = []
    for _ in range(max(1, n_windows // 16)):
        x = next(it)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=x[:, :-1]).logits
        losses.append(F.cross_entropy(logits.float().reshape(-1, VOCAB_SIZE), x[:, 1:].reshape(-1)).item())
    model.train()
    return sum(losses) / len(losses)


def train(model, data, held, steps, lr, batch, log, name, teacher=None, seed=0, it=None):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(seed)
    it = it if it is not None else batches(data, batch, gen)
    t0 = time.time()
    model.train()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, lr, warmup=min(100, steps // 10 + 1))
        x = next(it)
        inp, tgt = x[:, :-1], x[:, 1:]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=inp).logits.float()
            if teacher is None:
                loss = F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), tgt.reshape(-1))
            else:
                with torch.no_grad():
                    t_logits = teacher(input_ids=inp).logits.float()
                # forward KL(target || draft): the draft learns to put its mass where the
                # target does, so their argmaxes agree as often as possible.
                loss = F.kl_div(
                    F.log_softmax(logits, -1).reshape(-1, VOCAB_SIZE),
                    F.log_softmax(t_logits, -1).reshape(-1, VOCAB_SIZE),
                    log_target=True, reduction="batchmean",
                )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == steps - 1:
            log(f"{name} step {step}/{steps} loss {loss.item():.4f} ({time.time() - t0:.0f}s)")
    held_loss = evaluate(model, held)
    log(f"{name} held-out cross-entropy {held_loss:.4f} (perplexity {math.exp(held_loss):.2f})")
    return held_loss


def target_generations(target_dir: pathlib.Path, data: torch.Tensor, n: int, prompt_len: int,
                       seed: int, log) -> torch.Tensor:
    """(n, SEQ_LEN + 1) sequences: a corpus prompt of prompt_len tokens continued by the
    target (tailserve's engine, bf16): two thirds greedy, one third sampled (T=1, top-p 0.95)."""
    from tailserve import LLM, SamplingParams

    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, data.numel() - prompt_len, (n,), generator=gen)
    prompts = [data[s : s + prompt_len].tolist() for s in starts.tolist()]
    llm = LLM(model=str(target_dir), dtype="bfloat16", max_num_seqs=64, seed=seed)
    new = SEQ_LEN + 1 - prompt_len
    greedy = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=new, temperature=1.0, top_p=0.95, ignore_eos=True)
    t0 = time.time()
    outs = llm.generate(prompts, [greedy if i % 3 else sampled for i in range(n)])
    log(f"on-policy data: {n} target continuations of {new} tokens in {time.time() - t0:.0f}s")
    return torch.tensor([p + list(o.token_ids) for p, o in zip(prompts, outs)], dtype=torch.long)


def mixed_batches(data: torch.Tensor, onpolicy: torch.Tensor, batch: int, gen: torch.Generator):
    """Half corpus windows, half target-generated sequences."""
    corpus = batches(data, batch - batch // 2, gen)
    while True:
        rows = torch.randint(0, onpolicy.shape[0], (batch // 2,), generator=gen)
        yield torch.cat([next(corpus), onpolicy[rows]])


def save(model, tok, out: pathlib.Path, held_files: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.config.torch_dtype = "bfloat16"
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
        "model_max_length": 2048, "clean_up_tokenization_spaces": False,
    }, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({
        "bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD,
    }, indent=2) + "\n")
    (out / "held_out_files.txt").write_text("\n".join(held_files) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parents[1] / "src/tailserve/assets"))
    ap.add_argument("--target-steps", type=int, default=1600)
    ap.add_argument("--draft-steps", type=int, default=1000)
    ap.add_argument("--onpolicy-rounds", type=int, default=3)
    ap.add_argument("--onpolicy-steps", type=int, default=1500, help="per round")
    ap.add_argument("--onpolicy-sequences", type=int, default=1536)
    ap.add_argument("--resume-onpolicy", action="store_true",
                    help="run only stage 5, on the tokenizer and models already in --out")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_lines: list[str] = []
    if args.resume_onpolicy and (out / "training_log.txt").is_file():
        log_lines = [*(out / "training_log.txt").read_text().splitlines(), "--- stage 5 alone (--resume-onpolicy)"]
    t_start = time.time()

    def log(msg: str) -> None:
        line = f"[{time.time() - t_start:7.1f}s] {msg}"
        print(line, flush=True)
        log_lines.append(line)
        (out / "training_log.txt").write_text("\n".join(log_lines) + "\n")

    root, rels = stdlib_files()
    train_files = [r for r in rels if not is_held_out(r)]
    held_files = [r for r in rels if is_held_out(r)]
    log(f"python stdlib at {root}: {len(train_files)} train files, {len(held_files)} held-out files")
    train_texts = [read_text(root / r) for r in train_files]
    held_texts = [read_text(root / r) for r in held_files]

    if args.resume_onpolicy:
        from tokenizers import Tokenizer
        from transformers import LlamaForCausalLM

        tok = Tokenizer.from_file(str(out / "default-target" / "tokenizer.json"))
    else:
        tok = train_tokenizer(train_texts)
    train_ids = encode_corpus(tok, train_texts)
    held_ids = encode_corpus(tok, held_texts)
    log(f"tokenizer: {tok.get_vocab_size()} entries; "
        f"train {train_ids.numel()} tokens, held-out {held_ids.numel()} tokens")

    if args.resume_onpolicy:
        target = LlamaForCausalLM.from_pretrained(out / "default-target", dtype=torch.float32)
        draft = LlamaForCausalLM.from_pretrained(out / "default-draft", dtype=torch.float32)
    else:
        target = make_model(TARGET_SHAPE, args.seed)
        log(f"target: {sum(p.numel() for p in target.parameters()) / 1e6:.2f}M parameters")
        train(target, train_ids, held_ids, args.target_steps, 2e-3, args.batch, log, "target", seed=args.seed)
        save(target, tok, out / "default-target", held_files)
    teacher = target.to(torch.bfloat16).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    if not args.resume_onpolicy:
        draft = make_model(DRAFT_SHAPE, args.seed + 1)
        log(f"draft: {sum(p.numel() for p in draft.parameters()) / 1e6:.2f}M parameters")
        train(draft, train_ids, held_ids, args.draft_steps, 3e-3, args.batch, log, "draft",
              teacher=teacher, seed=args.seed + 1)
        save(draft, tok, out / "default-draft", held_files)

    for r in range(args.onpolicy_rounds):
        # Each round: fresh target continuations (new prompts), then a short cosine schedule.
        onpolicy = target_generations(out / "default-target", train_ids, args.onpolicy_sequences, 48,
                                      args.seed + 2 + r, log)
        gen = torch.Generator().manual_seed(args.seed + 3 + r)
        train(draft, train_ids, held_ids, args.onpolicy_steps, 1e-3, args.batch, log, f"draft on-policy {r + 1}",
              teacher=teacher, it=mixed_batches(train_ids, onpolicy, args.batch, gen))
        save(draft, tok, out / "default-draft", held_files)
    log(f"done in {(time.time() - t_start) / 60:.1f} minutes")


if __name__ == "__main__":
    main()
