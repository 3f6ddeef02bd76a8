"""Fine-tuning: prompt/response data whose loss counts only the response, its held-out loss, and the
model and defaults of `backend finetune`.

Data: a JSONL file, one example per line, `{"prompt": "...", "response": "..."}`. An example becomes
one sequence of the model's length: the prompt's tokens then the response's (then the end-of-text
token when the tokenizer has one), cut at seq_len + 1 tokens and padded after. The target of every
position whose next token is still the prompt's, and of every padding position, is IGNORE: the loss
is the mean cross-entropy over the response tokens of the global batch alone (the model divides by
the number of counted targets of the global batch, summed over z and data, so the gradients are
those of that mean on any grid). A plain text file still works: it is read as training windows as
`backend run` reads it (every target counts).

Tokenizer: the model directory's `tokenizer.json` (Hugging Face `tokenizers`, offline) when it has
one and the package is installed, else the project's byte-level tokenizer (UTF-8 bytes, ids 0..255;
any model with a vocabulary of at least 256 takes them, but a pretrained model only understands its
own tokenizer's ids).

Batches are a pure function of (seed, step): the examples are shuffled once per epoch by a generator
seeded by (seed, epoch); step t takes the next global batch of B examples (an epoch's last, short
batch is filled from the next epoch). Shard z + G_z*d of a rank takes whole sequences
[shard*b, (shard+1)*b), b = B / (G_z*G_data), as backend.training.data splits windows.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from backend.training.data import Batch, DataError, StepLoader
from topologies.common import TwinError

if TYPE_CHECKING:
    import torch

    from backend.runtime.dist import ParallelContext
    from twin.program.model import ModelSpec

IGNORE = -100  # the loss's ignore index (backend.runtime.layers.IGNORE)
REFERENCE_LR, REFERENCE_HIDDEN = 2e-5, 4096  # a common full fine-tuning rate of 7-8B models (h = 4096)


# -- defaults ---------------------------------------------------------------------------------------
def default_lr(hidden: int) -> float:
    """Peak fine-tuning learning rate for a model of width `hidden`: 2e-5 at h = 4096 (the rate
    commonly used to fine-tune 7-8B Llama models), scaled by sqrt(4096 / h).

    Why the scaling: Adam moves each weight by about lr per step whatever its gradient's size, while
    a weight matrix's entries are of size ~1/sqrt(h); lr * sqrt(h) constant keeps the relative change
    of the weights per step the same across widths. That gives 1.4e-5 for 70B (h = 8192), 1e-5 for
    405B (h = 16384), and 1.6e-4 for a tiny CPU model of h = 64, which then learns in tens of steps
    instead of thousands.
    """
    return REFERENCE_LR * math.sqrt(REFERENCE_HIDDEN / hidden)


def default_warmup(steps: int) -> int:
    """Linear warm-up steps: 3 % of the run (at least 1), the usual share for fine-tuning."""
    return max(1, round(0.03 * steps))


def finetune_model(init_from: str | None, ckpt_dir: str | None, seq_len: int | None, batch: int):
    """The model of a fine-tune, its Hugging Face config and the directory it started from (its
    tokenizer's): from --init-from, else from the checkpoint it resumes (raises TwinError when there
    is neither)."""
    from twin.program.model import ModelSpec

    if seq_len is not None and seq_len < 1:
        raise TwinError(f"--seq-len must be >= 1, got {seq_len}")
    if init_from:
        from backend.hf.load import HFCheckpoint
        ckpt = HFCheckpoint(init_from)
        return ckpt.spec(seq_len, batch), ckpt.config.raw, init_from
    from backend.runtime import checkpoint
    path = checkpoint.latest(ckpt_dir) if ckpt_dir else None
    if path is None:
        raise TwinError("give --init-from HF_DIR (a Hugging Face Llama directory), or a --ckpt-dir holding a "
                        "checkpoint of a fine-tune to resume")
    meta = checkpoint.read_meta(path)
    saved = meta.get("config", {}) if isinstance(meta.get("config"), dict) else {}
    spec = ModelSpec(**meta["model"])
    if seq_len is not None and seq_len != spec.seq_len:
        raise TwinError(f"the checkpoint in {ckpt_dir} was trained with --seq-len {spec.seq_len}, not {seq_len}")
    source = saved.get("init_from")
    return spec, saved.get("hf_config"), source if isinstance(source, str) and Path(source).is_dir() else None


# -- tokenizers ------------------------------------------------------------------------------------
class ByteTokenizer:
    """UTF-8 bytes as token ids (0..255); no end-of-text token."""

    name, eos = "bytes", None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


class HFTokenizer:
    """A Hugging Face `tokenizer.json` (fast tokenizer, read offline); eos: its end-of-text id if known."""

    def __init__(self, path: Path, eos: int | None):
        from tokenizers import Tokenizer
        try:
            self.tok = Tokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 - any parse failure of the file is bad input
            raise DataError(f"tokenizer {path} cannot be read ({type(e).__name__}): remove it to use bytes") from None
        self.name, self.eos = f"{path}", eos

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids


def tokenizer_for(model_dir: str | None, eos: int | None = None):
    """The tokenizer of a fine-tune: the model directory's tokenizer.json when present and the
    `tokenizers` package is installed, else bytes."""
    if model_dir and (Path(model_dir) / "tokenizer.json").is_file():
        try:
            import tokenizers  # noqa: F401
        except ImportError:
            return ByteTokenizer()
        return HFTokenizer(Path(model_dir) / "tokenizer.json", eos)
    return ByteTokenizer()


# -- prompt/response examples ----------------------------------------------------------------------
def is_examples(path: str) -> bool:
    """Is `path` prompt/response data (a .jsonl file)?"""
    return str(path).endswith(".jsonl")


def read_examples(path: str | Path) -> list[tuple[str, str]]:
    """(prompt, response) of every line of a JSONL file (blank lines skipped). Raises DataError with
    the line number when a line is not a JSON object with string "prompt" and "response"."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file {path} does not exist (give a .jsonl of {{\"prompt\": ..., \"response\": ...}} lines)")
    out = []
    with open(path, encoding="utf-8", errors="strict") as f:
        try:
            lines = f.read().splitlines()
        except UnicodeDecodeError:
            raise DataError(f"data file {path} is not UTF-8 text") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{n}: not JSON ({e.msg}): each line must be {{\"prompt\": ..., \"response\": ...}}") from None
        if not (isinstance(rec, dict) and isinstance(rec.get("prompt"), str) and isinstance(rec.get("response"), str)):
            raise DataError(f"{path}:{n}: each line must be an object with string \"prompt\" and \"response\"")
        if not rec["response"]:
            raise DataError(f"{path}:{n}: the response is empty (nothing to learn)")
        out.append((rec["prompt"], rec["response"]))
    if not out:
        raise DataError(f"data file {path} holds no examples")
    return out


@dataclass
class Examples:
    """Encoded examples: inputs and targets [N, seq_len] int64 (targets IGNORE outside responses)."""

    inputs: np.ndarray
    targets: np.ndarray
    truncated: int  # examples whose prompt + response did not fit in seq_len + 1 tokens

    def __len__(self) -> int:
        return len(self.inputs)

    @property
    def counted(self) -> int:
        """Targets that count in the loss (response tokens)."""
        return int((self.targets >= 0).sum())


def encode_examples(pairs: list[tuple[str, str]], tokenizer, seq_len: int, vocab: int) -> Examples:
    """One sequence per example: prompt + response (+ eos), cut at seq_len + 1 tokens, padded with 0
    (whose targets are IGNORE). The target of position i is token i + 1; it counts when that token
    belongs to the response. Raises DataError when a token id is outside the vocabulary or an
    example keeps no response token."""
    n = len(pairs)
    inputs = np.zeros((n, seq_len), dtype=np.int64)
    targets = np.full((n, seq_len), IGNORE, dtype=np.int64)
    truncated = 0
    for i, (prompt, response) in enumerate(pairs):
        p, r = tokenizer.encode(prompt), tokenizer.encode(response)
        if tokenizer.eos is not None:
            r = r + [tokenizer.eos]
        ids = (p + r)[:seq_len + 1]
        truncated += len(p) + len(r) > seq_len + 1
        if ids and max(ids) >= vocab:
            raise DataError(f"example {i + 1}: token id {max(ids)} is >= the model's vocabulary {vocab} "
                            f"(tokenizer: {tokenizer.name})")
        if len(ids) <= max(len(p), 1):
            raise DataError(f"example {i + 1}: its prompt fills the {seq_len} tokens of a sequence, no response "
                            "token is left: shorten the prompt or raise --seq-len")
        m = len(ids) - 1
        inputs[i, :m] = ids[:-1]
        targets[i, :m] = ids[1:]
        targets[i, :max(len(p), 1) - 1] = IGNORE  # predicting the prompt's own tokens does not count
    return Examples(inputs, targets, truncated)


class ExampleLoader(StepLoader):
    """Deterministic, resumable batches of examples for one rank (ShardedLoader's interface).

    global_batch: examples per step over all ranks; shard, shards: this rank's shard z + G_z*d of G_z*G_data.
    """

    def __init__(self, examples: Examples, global_batch: int, shard: int, shards: int, micro_batches: int = 1,
                 seed: int = 0):
        if global_batch % shards or (global_batch // shards) % micro_batches:
            raise DataError(f"global batch {global_batch} does not split into {shards} shards "
                            f"of {micro_batches} micro-batches")
        self.examples, self.global_batch, self.seq_len = examples, global_batch, examples.inputs.shape[1]
        self.shard, self.shards, self.micro_batches, self.seed = shard, shards, micro_batches, seed
        self.step = 0

    def indices(self, step: int) -> np.ndarray:
        """Example indices of the global batch of `step` (0-based), the same on every rank."""
        n, b = len(self.examples), self.global_batch
        first = step * b
        out = []
        for epoch in range(first // n, (first + b - 1) // n + 1):
            perm = np.random.default_rng([self.seed, epoch, 0xF17E]).permutation(n)
            lo, hi = max(first, epoch * n) - epoch * n, min(first + b, (epoch + 1) * n) - epoch * n
            out.append(perm[lo:hi])
        return np.concatenate(out)

    def batches(self, step: int, device: torch.device | str = "cpu") -> list[Batch]:
        import torch

        b = self.global_batch // self.shards
        mine = self.indices(step)[self.shard * b:(self.shard + 1) * b]
        return self.split(torch.from_numpy(self.examples.inputs[mine]).to(device),
                          torch.from_numpy(self.examples.targets[mine]).to(device))

    @property
    def source_name(self) -> str:
        return f"{len(self.examples)} examples"


def load_examples(path: str, spec: ModelSpec, model_dir: str | None, eos: int | None = None) -> Examples:
    return encode_examples(read_examples(path), tokenizer_for(model_dir, eos), spec.seq_len, spec.vocab)


# -- held-out loss ---------------------------------------------------------------------------------
class HeldOutExamples:
    """Every held-out example, in global batches of the training batch's size (the last one padded
    with rows that count nothing); `loss(model)`: the mean loss over all their response tokens."""

    def __init__(self, examples: Examples, global_batch: int, ctx: ParallelContext):
        import torch

        n, s = len(examples), examples.inputs.shape[1]
        rows = -(-n // global_batch) * global_batch
        inputs = np.zeros((rows, s), np.int64)
        targets = np.full((rows, s), IGNORE, np.int64)
        inputs[:n], targets[:n] = examples.inputs, examples.targets
        b = global_batch // ctx.batch_shards
        self.batches = []
        for start in range(0, rows, global_batch):
            lo = start + ctx.batch_shard * b
            self.batches.append((torch.from_numpy(inputs[lo:lo + b]).to(ctx.device),
                                 torch.from_numpy(targets[lo:lo + b]).to(ctx.device),
                                 int((targets[start:start + global_batch] >= 0).sum())))

    @staticmethod
    def due(step: int, every: int, last: int) -> bool:
        return step == last or (every > 0 and step % every == 0)

    def loss(self, model) -> float:
        """Mean cross-entropy over all held-out response tokens (a collective: every rank calls it)."""
        import torch

        from backend.runtime.recorder import NULL_RECORDER

        saved, model.recorder = model.recorder, NULL_RECORDER
        total = counted = 0
        try:
            with torch.no_grad():
                for tokens, targets, n in self.batches:
                    if n:  # a batch's loss is its mean over its counted tokens: weight it by their number
                        total += float(model(tokens, targets, total_tokens=n)) * n
                        counted += n
        finally:
            model.recorder = saved
        return total / max(counted, 1)


def split_held_out(examples: Examples, fraction: float = 0.05) -> tuple[Examples, Examples]:
    """Training and held-out examples: the last `fraction` (at least one, none when a single example)."""
    n = len(examples)
    k = 0 if n < 2 else max(1, round(n * fraction))
    cut = n - k

    def part(sl):
        return Examples(examples.inputs[sl], examples.targets[sl], 0)

    return part(slice(0, cut)), part(slice(cut, n))


def check_examples(path: str, spec: ModelSpec, model_dir: str | None, eos: int | None = None) -> Examples:
    """Read and encode a JSONL file in the launching process (one clear line when it is bad)."""
    if not is_examples(path):
        raise TwinError(f"{path}: prompt/response data must be a .jsonl file")
    return load_examples(path, spec, model_dir, eos)


# -- a run's data ------------------------------------------------------------------------------------
def open_text(path: str, spec: ModelSpec, model_dir: str | None, seed: int = 0, eos: int | None = None):
    """A run's token source (backend.training.data.open_source); a text file is read with the model
    directory's tokenizer when it has one (else as bytes, as `backend run` reads it)."""
    from backend.training.data import TokenSource, open_source

    tok = tokenizer_for(model_dir, eos)
    if isinstance(tok, ByteTokenizer) or path.startswith("synthetic") or path.endswith(".bin") or not Path(path).is_file():
        return open_source(path, spec.vocab, seed)
    try:
        ids = np.asarray(tok.encode(Path(path).read_text(encoding="utf-8")), dtype=np.int64)
    except UnicodeDecodeError:
        raise DataError(f"data file {path} is not UTF-8 text (the tokenizer {tok.name} reads text)") from None
    if len(ids) and int(ids.max()) >= spec.vocab:
        raise DataError(f"data file {path}: token id {int(ids.max())} is >= the model's vocabulary {spec.vocab}")
    return TokenSource(ids, f"{path} (tokenizer {tok.name})")


def make_data(cfg, spec: ModelSpec, global_batch: int, ctx: ParallelContext):
    """The training loader and the held-out evaluator (or None) of a run (backend.training.train.TrainConfig):
    prompt/response examples when the data is a .jsonl file, windows of a token source otherwise.
    Without --eval-data, a run on examples holds out `cfg.eval_holdout` of them."""
    from backend.training.data import ShardedLoader
    from backend.training.evaluate import HeldOut

    eos = (cfg.hf_config or {}).get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos if isinstance(eos, int) else None
    held = None
    if is_examples(cfg.data):
        examples = load_examples(cfg.data, spec, cfg.init_from, eos)
        if cfg.eval_data is None and cfg.eval_holdout > 0:
            examples, kept = split_held_out(examples, cfg.eval_holdout)
            held = HeldOutExamples(kept, global_batch, ctx) if len(kept) else None
        loader = ExampleLoader(examples, global_batch, ctx.batch_shard, ctx.batch_shards, cfg.micro_batches, cfg.seed)
    else:
        source = open_text(cfg.data, spec, cfg.init_from, cfg.seed, eos)
        loader = ShardedLoader(source, global_batch, spec.seq_len, ctx.batch_shard, ctx.batch_shards,
                               cfg.micro_batches, cfg.seed, cfg.goldfish_k, cfg.goldfish_h)
    if cfg.eval_data:
        if is_examples(cfg.eval_data):
            held = HeldOutExamples(load_examples(cfg.eval_data, spec, cfg.init_from, eos), global_batch, ctx)
        else:
            held = HeldOut(cfg.eval_data, spec, global_batch, ctx, cfg.eval_batches, cfg.seed)
    return loader, held


def check_data(cfg, spec: ModelSpec) -> None:
    """The run's data and held-out data, checked in the launching process (one line when bad)."""
    eos = (cfg.hf_config or {}).get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos if isinstance(eos, int) else None
    for path, flag in ((cfg.data, "--data"), (cfg.eval_data, "--eval-data")):
        if path is None:
            continue
        if is_examples(path):
            if cfg.goldfish_k:
                raise TwinError("the goldfish loss works on text data, not on prompt/response examples")
            examples = load_examples(path, spec, cfg.init_from, eos)
            if flag == "--data" and cfg.eval_data is None and cfg.eval_holdout > 0 and len(examples) < 2:
                raise TwinError(f"{path} holds one example: give more, or --eval-data, to have a held-out loss")
        else:
            source = open_text(path, spec, cfg.init_from, cfg.seed, eos)
            if len(source) < spec.seq_len + 2:
                raise TwinError(f"{flag} {source.name} has {len(source)} tokens, fewer than one sequence "
                                f"of {spec.seq_len}+1 tokens of {spec.name}")
