"""Where the load generator's prompts come from.

Every dataset yields ``BenchRequest``s: the prompt (text, or chat messages), its length in
tokens of the benchmark's tokenizer, the number of tokens to ask for, and optionally an
arrival time (trace replay) or a place in a conversation (multi-turn). Names and flags
follow ``vllm bench serve`` where the concept is the same.

- ``random``: prompts of exactly ``--random-input-len`` tokens (± ``--random-range-ratio``),
  built from random token ids and re-tokenised until the count is exact.
- ``sharegpt``: a local ShareGPT-format JSON file (``conversations`` of ``human``/``gpt``
  turns); the output length is the reference answer's token count.
- ``custom``: a local JSONL file, one ``{"prompt": ..., "output_tokens": N}`` per line.
- ``prefix_repetition``: N shared prefixes × M suffixes (prefix caching's best case).
- ``multi_turn``: conversations whose history grows; each turn is sent when the previous
  answer is in, with that answer appended to the history.
- ``trace``: replay of a JSONL/CSV trace of arrival time, input and output lengths; Mooncake's
  ``hash_ids`` (one id per ``--trace-hash-block-size`` tokens of prompt) become shared text
  blocks, so the trace's prefix sharing is reproduced.
- ``agentic``: tool-using sessions (``bench/agentic.py``): a shared system prompt and tool
  catalogue, each turn sent after the previous answer with a synthetic tool result appended.
- ``python``: openings of functions from the Python standard library's own source, the
  text the built-in model was trained on, so its completions read as Python.
"""

from __future__ import annotations

import csv
import json
import pathlib
import random
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass, field

from tailserve.bench.agentic import AgenticConfig, catalogue, sessions, system_prompt
from tailserve.bench.cli_args import DATASET_NAMES
from tailserve.errors import ConfigError
from tailserve.model.tokenizer import Tokenizer


@dataclass(frozen=True)
class BenchRequest:
    prompt: str  # for chat: the last user message (the history is in ``messages``)
    prompt_len: int  # tokens of the benchmark's tokenizer (the whole rendered prompt for multi-turn)
    output_len: int
    messages: tuple[dict[str, str], ...] | None = None  # chat form, when the dataset has one
    arrival_s: float | None = None  # trace replay: seconds after the start of the run
    conversation: int | None = None  # multi-turn: which conversation
    turn: int = 0  # multi-turn: which turn (0 = the first)
    follow_ups: tuple[str, ...] = field(default_factory=tuple)  # multi-turn: the later user turns
    # agentic: the tool catalogue sent with every turn, the synthetic tool result appended before
    # each later turn (and the tool it stands for), the pause before each later turn.
    tools: tuple[dict, ...] | None = None
    tool_results: tuple[str, ...] = ()
    tool_names: tuple[str, ...] = ()
    think_time_s: float = 0.0

    @property
    def num_turns(self) -> int:
        return 1 + len(self.follow_ups) + len(self.tool_results)


@dataclass(frozen=True)
class DatasetConfig:
    name: str = "python"
    num_prompts: int = 100
    seed: int = 0
    path: str | None = None  # sharegpt, custom, trace
    input_len: int = 128  # random, trace filler, python (upper bound)
    output_len: int = 64
    range_ratio: float = 0.0  # random: lengths uniform in [len*(1-r), len*(1+r)]
    prefix_len: int = 0  # random: a shared prefix of this many tokens before every prompt
    sharegpt_output_len: int | None = None
    num_prefixes: int = 4  # prefix_repetition
    suffix_len: int = 32  # prefix_repetition
    num_turns: int = 3  # multi_turn
    trace_speedup: float = 1.0  # trace: 2.0 replays twice as fast
    trace_hash_block_size: int = 512  # trace: prompt tokens per hash id (Mooncake's)
    trace_timestamp_unit: str = "auto"  # trace: "s", "ms", or auto (ms for Mooncake's rows with hash_ids)
    agentic: AgenticConfig = field(default_factory=AgenticConfig)

    def __post_init__(self) -> None:
        if self.name not in DATASET_NAMES:
            raise ConfigError(f"unknown dataset '{self.name}'; choose one of {', '.join(DATASET_NAMES)}")
        if self.num_prompts < 1:
            raise ConfigError("--num-prompts must be at least 1")
        if self.input_len < 1 or self.output_len < 1:
            raise ConfigError("input and output lengths must be at least 1 token")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ConfigError("--random-range-ratio must be in [0, 1)")
        if self.name in ("sharegpt", "custom", "trace") and not self.path:
            raise ConfigError(f"--dataset-name {self.name} needs --dataset-path (a local file)")
        if self.path and not pathlib.Path(self.path).is_file():
            raise ConfigError(f"--dataset-path {self.path}: no such file")
        if self.num_prefixes < 1 or self.num_turns < 1 or self.trace_speedup <= 0 or self.trace_hash_block_size < 1:
            raise ConfigError("--prefix-repetition-num-prefixes, --multi-turn-num-turns and --trace-hash-block-size "
                              "must be >= 1, --trace-speedup > 0")
        if self.trace_timestamp_unit not in ("auto", "s", "ms"):
            raise ConfigError("--trace-timestamp-unit must be auto, s or ms")
        a = self.agentic
        if a.num_turns < 1 or a.num_tools < 1 or a.tool_result_len < 1 or a.system_len < 1 or a.think_time_s < 0:
            raise ConfigError("--agentic-num-turns, --agentic-num-tools, --agentic-tool-result-len and "
                              "--agentic-system-prompt-len must be >= 1, --agentic-think-time >= 0")


def load_dataset(cfg: DatasetConfig, tokenizer: Tokenizer | None) -> list[BenchRequest]:
    needs_tokenizer = cfg.name in ("random", "prefix_repetition", "trace", "multi_turn", "python", "agentic") or (
        cfg.name == "sharegpt" and cfg.sharegpt_output_len is None)
    if tokenizer is None and needs_tokenizer:
        raise ConfigError(f"--dataset-name {cfg.name} needs a tokenizer: pass --tokenizer (a local folder with "
                          "tokenizer.json)")
    rng = random.Random(cfg.seed)
    loaders = {"random": _random, "sharegpt": _sharegpt, "custom": _custom, "prefix_repetition": _prefix_repetition,
               "multi_turn": _multi_turn, "trace": _trace, "python": _python, "agentic": _agentic}
    return loaders[cfg.name](cfg, tokenizer, rng)  # type: ignore[arg-type]


# -- exact-length text ---------------------------------------------------------------------

def text_of_length(tokenizer: Tokenizer, n: int, rng: random.Random, avoid: Sequence[int] = (),
                   special_tokens: bool = False) -> tuple[str, int]:
    """Text that the tokenizer encodes (without special tokens, or with them when
    ``special_tokens``, as a server counts a prompt) to exactly ``n`` tokens.

    Random ids decode to text that re-tokenises differently (merges across the seams), so
    the text is re-encoded, cut or padded with more random ids, and decoded again until the
    count holds. Returns the text and the count reached (``n`` unless 20 rounds did not
    converge, which has not been seen with byte-level BPE).
    """
    special = set(avoid)
    for tid in (tokenizer.bos_token_id, tokenizer.eos_token_id):
        if tid is not None:
            special.add(tid)
    vocab = [i for i in range(min(tokenizer.vocab_size, 1 << 20)) if i not in special]
    extra = len(tokenizer.encode("")) if special_tokens else 0  # what the tokenizer adds (a BOS)
    m = max(0, n - extra)  # ids of text

    def count(t: str) -> int:
        return len(tokenizer.encode(t, add_special_tokens=special_tokens))

    ids = [rng.choice(vocab) for _ in range(m)]
    text = tokenizer.decode(ids)
    got = count(text)
    for _ in range(20):
        if got == n:
            break
        enc = tokenizer.encode(text, add_special_tokens=False)
        m = max(0, m + n - got)  # the text's ids that should bring the count to n
        ids = enc[:m] if len(enc) > m else enc + [rng.choice(vocab) for _ in range(m - len(enc))]
        text = tokenizer.decode(ids)
        got = count(text)
    return text, got


def _count(tokenizer: Tokenizer | None, text: str) -> int:
    return len(tokenizer.encode(text)) if tokenizer is not None else 0


def _random(cfg: DatasetConfig, tok: Tokenizer, rng: random.Random) -> list[BenchRequest]:
    prefix = text_of_length(tok, cfg.prefix_len, rng)[0] if cfg.prefix_len else ""
    # As vLLM's random dataset: the input length counts the special tokens (a BOS) the server's
    # tokenizer adds, so a 128-token input is 128 tokens to the server. (One more made a
    # prefix-cached repeat of the load compute 1 token per prompt instead of vLLM's last block,
    # and its TTFT half of vllm bench serve's.)
    n_special = len(tok.encode(""))
    out = []
    for _ in range(cfg.num_prompts):
        lo, hi = int(cfg.input_len * (1 - cfg.range_ratio)), int(cfg.input_len * (1 + cfg.range_ratio))
        n_in = max(1, rng.randint(lo, hi))
        olo, ohi = int(cfg.output_len * (1 - cfg.range_ratio)), int(cfg.output_len * (1 + cfg.range_ratio))
        if prefix:  # the prefix's tokens come on top, as in vLLM (seams may shift the count by one)
            text, _ = text_of_length(tok, max(1, n_in - n_special), rng)
        else:
            text, _ = text_of_length(tok, n_in, rng, special_tokens=True)
        prompt = prefix + text
        out.append(BenchRequest(prompt, _count(tok, prompt), max(1, rng.randint(olo, ohi))))
    return out


def _prefix_repetition(cfg: DatasetConfig, tok: Tokenizer, rng: random.Random) -> list[BenchRequest]:
    prefixes = [text_of_length(tok, cfg.input_len, rng)[0] for _ in range(cfg.num_prefixes)]
    out = []
    for i in range(cfg.num_prompts):
        prompt = prefixes[i % cfg.num_prefixes] + text_of_length(tok, cfg.suffix_len, rng)[0]
        out.append(BenchRequest(prompt, _count(tok, prompt), cfg.output_len))
    rng.shuffle(out)
    return out


def _sharegpt(cfg: DatasetConfig, tok: Tokenizer | None, rng: random.Random) -> list[BenchRequest]:
    try:
        data = json.loads(pathlib.Path(cfg.path).read_text(encoding="utf-8"))  # type: ignore[arg-type]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"--dataset-path {cfg.path}: not a ShareGPT JSON file ({e})") from None
    if not isinstance(data, list):
        raise ConfigError(f"--dataset-path {cfg.path}: expected a JSON list of conversations")
    pairs = []
    for entry in data:
        conv = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(conv, list) or len(conv) < 2:
            continue
        first, second = conv[0], conv[1]
        if not (isinstance(first, dict) and isinstance(second, dict)):
            continue
        if not (isinstance(first.get("value"), str) and isinstance(second.get("value"), str)):
            continue
        pairs.append((first["value"], second["value"]))
    rng.shuffle(pairs)
    out = []
    for prompt, answer in pairs:
        n_in = _count(tok, prompt)
        n_out = cfg.sharegpt_output_len or _count(tok, answer)
        # As vLLM's sampler: skip degenerate pairs and those too long for a 2k context.
        if tok is not None and (n_in < 4 or n_out < 4 or n_in > 1024 or n_in + n_out > 2048):
            continue
        out.append(BenchRequest(prompt, n_in, n_out))
        if len(out) == cfg.num_prompts:
            break
    if not out:
        raise ConfigError(f"--dataset-path {cfg.path}: no usable conversations (each needs a human turn "
                          "followed by a gpt turn)")
    return _cycle(out, cfg.num_prompts)


def _custom(cfg: DatasetConfig, tok: Tokenizer | None, rng: random.Random) -> list[BenchRequest]:
    out = []
    with open(cfg.path, encoding="utf-8") as f:  # type: ignore[arg-type]
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{cfg.path}:{lineno}: not JSON ({e.msg})") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise ConfigError(f"{cfg.path}:{lineno}: each line needs a string 'prompt'")
            n_out = row.get("output_tokens", cfg.output_len)
            if not isinstance(n_out, int) or n_out < 1:
                raise ConfigError(f"{cfg.path}:{lineno}: 'output_tokens' must be a positive integer")
            out.append(BenchRequest(row["prompt"], _count(tok, row["prompt"]), n_out))
    if not out:
        raise ConfigError(f"{cfg.path}: no prompts")
    return _cycle(out, cfg.num_prompts)


def _trace(cfg: DatasetConfig, tok: Tokenizer, rng: random.Random) -> list[BenchRequest]:
    """Rows of (arrival time, input length, output length). JSONL or CSV; the time column is
    ``timestamp`` (seconds) or ``timestamp_ms``; lengths ``input_length``/``input_len`` and
    ``output_length``/``output_len`` (Mooncake's trace uses these names)."""
    path = pathlib.Path(cfg.path)  # type: ignore[arg-type]
    rows: list[dict] = []
    with open(path, encoding="utf-8", newline="") as f:
        if path.suffix.lower() == ".csv":
            rows = list(csv.DictReader(f))
        else:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise ConfigError(f"{path}:{lineno}: not JSON ({e.msg})") from None

    def get(row: dict, *names: str) -> float | None:
        for n in names:
            if n in row and row[n] not in (None, ""):
                try:
                    return float(row[n])
                except (TypeError, ValueError):
                    raise ConfigError(f"{path}: column '{n}' has a non-number: {row[n]!r}") from None
        return None

    parsed = []
    # Mooncake's traces (rows with hash_ids) give ``timestamp`` in milliseconds; others here
    # in seconds, unless --trace-timestamp-unit says.
    unit = cfg.trace_timestamp_unit
    if unit == "auto":
        unit = "ms" if any("hash_ids" in row for row in rows) else "s"
    for i, row in enumerate(rows, 1):
        ts = get(row, "timestamp", "arrival_s", "time")
        if ts is not None and unit == "ms" and "arrival_s" not in row:
            ts /= 1e3
        if ts is None and (ms := get(row, "timestamp_ms")) is not None:
            ts = ms / 1e3
        n_in, n_out = get(row, "input_length", "input_len"), get(row, "output_length", "output_len")
        if ts is None or n_in is None or n_out is None:
            raise ConfigError(f"{path}: row {i} needs a timestamp (s) or timestamp_ms, input_length and "
                              "output_length")
        hash_ids = row.get("hash_ids") or ()
        if isinstance(hash_ids, str):  # a CSV cell: "1 2 3" or "[1, 2, 3]"
            hash_ids = hash_ids.strip("[]").replace(",", " ").split()
        try:
            ids = tuple(int(h) for h in hash_ids)
        except (TypeError, ValueError):
            raise ConfigError(f"{path}: row {i}: hash_ids must be a list of integers") from None
        parsed.append((ts, int(n_in), int(n_out), ids))
    if not parsed:
        raise ConfigError(f"{path}: empty trace")
    parsed.sort(key=lambda row: row[0])
    t0 = parsed[0][0]
    blocks: dict[int, str] = {}
    bs = cfg.trace_hash_block_size

    def block(h: int) -> str:
        # The same text for the same hash id in every request: shared ids are a shared prefix.
        if h not in blocks:
            blocks[h] = text_of_length(tok, bs, random.Random(cfg.seed * 1_000_003 + h))[0]
        return blocks[h]

    out = []
    for ts, n_in, n_out, ids in parsed[: cfg.num_prompts]:
        n_in = max(1, n_in)
        shared = "".join(block(h) for h in ids[: -(-n_in // bs)])
        if ids:
            enc = tok.encode(shared, add_special_tokens=False)
            if len(enc) > n_in:  # the last block is partly used
                shared = tok.decode(enc[:n_in])
        rest = n_in - (len(tok.encode(shared, add_special_tokens=False)) if shared else 0)
        text = shared + (text_of_length(tok, rest, rng)[0] if rest > 0 else "")
        out.append(BenchRequest(text, _count(tok, text), max(1, n_out), arrival_s=(ts - t0) / cfg.trace_speedup))
    return out


def _agentic(cfg: DatasetConfig, tok: Tokenizer, rng: random.Random) -> list[BenchRequest]:
    """Sessions (``num_prompts`` is the number of sessions): the system prompt and catalogue
    that all of them share (seeded by the level's seed, so a sweep's next level does not find
    this one's prefix in the server's cache), then each session's task, tool results and
    think time."""
    a = cfg.agentic
    tools = catalogue(a.num_tools, cfg.seed)
    system = system_prompt(tok, a.system_len, cfg.seed)
    out = []
    for i, s in enumerate(sessions(tok, a, cfg.num_prompts, tools, rng)):
        messages = ({"role": "system", "content": system}, {"role": "user", "content": s.task})
        n = _count(tok, system + s.task + json.dumps(tools))
        out.append(BenchRequest(s.task, n, cfg.output_len, messages=messages, conversation=i, tools=tuple(tools),
                                tool_results=s.tool_results, tool_names=s.tool_names, think_time_s=a.think_time_s))
    return out


_FOLLOW_UPS = (
    "Now add type hints to it.", "Write a unit test for that.", "Make it handle an empty input.",
    "Add a docstring with an example.", "Rewrite it without recursion.", "Explain the edge cases.",
)


def _multi_turn(cfg: DatasetConfig, tok: Tokenizer, rng: random.Random) -> list[BenchRequest]:
    """Conversations (``num_prompts`` is the number of conversations): the first turn is a
    Python opening; later turns are short follow-ups sent after the previous answer, with
    the whole history (``messages``) growing turn by turn."""
    firsts = _python(cfg, tok, rng)
    out = []
    for c, first in enumerate(firsts):
        follow = tuple(rng.choice(_FOLLOW_UPS) for _ in range(cfg.num_turns - 1))
        out.append(BenchRequest(first.prompt, first.prompt_len, cfg.output_len,
                                messages=({"role": "user", "content": first.prompt},), conversation=c,
                                follow_ups=follow))
    return out


def python_source_files() -> list[pathlib.Path]:
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in stdlib.glob("*.py") if p.stat().st_size > 2000)


def _python(cfg: DatasetConfig, tok: Tokenizer, rng: random.Random) -> list[BenchRequest]:
    """Each prompt: up to a dozen lines before a ``def`` in a stdlib module (cut from the
    front to at most ``input_len`` tokens), the ``def`` line, and the body's indentation, so
    the model is asked to write the function's body."""
    files = python_source_files()
    if not files:
        raise ConfigError("the python dataset reads the standard library's source, which this Python lacks")
    openings: list[str] = []
    for path in rng.sample(files, min(len(files), 40)):
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError):
            continue
        for i, line in enumerate(lines):
            stripped = line.lstrip()
            if not stripped.startswith("def ") or not stripped.rstrip().endswith(":") or i < 3:
                continue
            indent = line[: len(line) - len(stripped)] + "    "
            context = lines[max(0, i - 12):i]
            openings.append(_heal("\n".join([*context, line]) + "\n" + indent, tok))
    if not openings:
        raise ConfigError("found no function definitions in the standard library's source")
    rng.shuffle(openings)
    out = []
    for text in openings:
        ids = tok.encode(text, add_special_tokens=False)
        if len(ids) > cfg.input_len:  # keep the end (the def line): cut whole lines from the front
            lines = text.splitlines(keepends=True)
            while len(lines) > 2 and len(tok.encode("".join(lines), add_special_tokens=False)) > cfg.input_len:
                lines.pop(0)
            text = "".join(lines)
        out.append(BenchRequest(text, _count(tok, text), cfg.output_len))
        if len(out) == cfg.num_prompts:
            break
    return _cycle(out, cfg.num_prompts)


def _heal(text: str, tok: Tokenizer) -> str:
    """Cut ``text`` back to a token boundary that the body's first word would leave.

    A prompt ending in whitespace the tokenizer would merge with the next word (byte-level
    BPE writes a body as ``'\\n       '`` + ``' return'``) asks the model for a token it never
    saw in that place, and it answers with odd indentation. So tokenise the text followed
    by a typical first word and keep only the tokens that end inside ``text``.
    """
    ids = tok.encode(text + "return", add_special_tokens=False)
    while ids and len(tok.decode(ids)) > len(text):
        ids.pop()
    healed = tok.decode(ids)
    return healed if healed and text.startswith(healed) else text


def _cycle(items: list[BenchRequest], n: int) -> list[BenchRequest]:
    return [items[i % len(items)] for i in range(n)]
