"""The memorization study at CPU scale: the standard loss against the goldfish loss.

The same small GPT (same initial weights, same data order) is trained twice for E epochs on a small
set of training sequences, once with the standard loss and once with the goldfish loss (k = 4,
h = 13). Every few epochs, each run is prompted with every training sequence's first P tokens and
decodes S tokens greedily (backend.studies.memorization: exact match and ROUGE-L), and its loss on held-out
text is measured (all tokens, no mask). The training sequences are
- canaries: random bytes (nothing to learn but the sequence itself), and
- text: pseudo-English sentences of a seeded lexicon of syllable words with Zipf frequencies (a
  language with structure to learn, so the held-out loss says what the model learned);
the held-out sequences are more text of the same language, never trained on.

Training is the backend's: the 4D GPT on `grid` (1x1x1x1 by default), backend.training.optim.train_step,
AdamW with the backend's warm-up and cosine schedule. Memorization is measured on the full weights
gathered from the shards (backend.models.generate), on rank 0.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from topologies.common import TwinError
from twin.program.model import ModelSpec


@dataclass
class StudyConfig:
    """What the study trains and measures. Lengths are in tokens (bytes)."""

    epochs: int = 100
    eval_every: int = 5            # epochs between measurements (and after the last one)
    canaries: int = 32             # random-byte training sequences
    texts: int = 32                # pseudo-text training sequences
    held_out: int = 32             # pseudo-text sequences never trained on
    seq_len: int = 64              # tokens per sequence
    prefix: int = 32               # prompt: the first P tokens
    suffix: int = 32               # decoded and scored: the next S tokens
    goldfish_k: int = 4
    goldfish_h: int = 13
    layers: int = 2
    hidden: int = 128
    heads: int = 4
    batch: int = 16                # sequences per step
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 20               # steps
    weight_decay: float = 0.0
    seed: int = 0
    grid: str = "1x1x1x1"
    out: str = "runs/memorization"
    threads: int = 0               # torch threads per rank (0: torch's default)
    losses: list[str] = field(default_factory=lambda: ["standard", "goldfish"])

    def spec(self) -> ModelSpec:
        return ModelSpec(name="study-gpt", layers=self.layers, hidden=self.hidden, heads=self.heads,
                         vocab=256, seq_len=self.seq_len, global_batch=self.batch)

    @classmethod
    def from_dict(cls, d: dict) -> "StudyConfig":
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


def check(cfg: StudyConfig) -> None:
    """Raise TwinError with one clear line when the study cannot run as configured."""
    from backend.training.goldfish import check as check_goldfish
    from backend.studies.memorization import check_lengths
    from twin.program.grid import Grid

    if cfg.threads < 0:
        raise TwinError(f"--threads must be >= 0 (0: torch's default), got {cfg.threads}")
    if cfg.epochs < 1 or cfg.eval_every < 1:
        raise TwinError(f"--epochs and --eval-every must be >= 1, got {cfg.epochs} and {cfg.eval_every}")
    if cfg.canaries < 0 or cfg.texts < 0 or cfg.canaries + cfg.texts < 1 or cfg.held_out < 1:
        raise TwinError("the study needs at least one training sequence (--canaries, --texts) and --held-out >= 1")
    check_goldfish(cfg.goldfish_k, cfg.goldfish_h)
    check_lengths(cfg.seq_len, cfg.prefix, cfg.suffix)
    spec, grid = cfg.spec(), Grid.parse(cfg.grid)
    n = cfg.canaries + cfg.texts
    if n % cfg.batch or cfg.held_out % cfg.batch:
        raise TwinError(f"--batch {cfg.batch} must divide the training sequences ({n}) and --held-out "
                        f"({cfg.held_out})")
    grid.validate(spec, batch=cfg.batch)


# -- data -----------------------------------------------------------------------------------------
_CONSONANTS, _VOWELS = "bcdfghjklmnprstvwz", "aeiou"


def lexicon(size: int = 400, seed: int = 0) -> list[str]:
    """`size` distinct pseudo-words of one to three syllables (consonant-vowel[-consonant])."""
    rng = np.random.default_rng([seed, 0x1E71C0])
    words: list[str] = []
    seen = set()
    while len(words) < size:
        syllables = rng.integers(1, 4)
        w = "".join(_CONSONANTS[rng.integers(len(_CONSONANTS))] + _VOWELS[rng.integers(len(_VOWELS))]
                    + (_CONSONANTS[rng.integers(len(_CONSONANTS))] if rng.random() < 0.3 else "")
                    for _ in range(syllables))
        if w not in seen:
            seen.add(w)
            words.append(w)
    return words


def pseudo_text(n_chars: int, stream: int, seed: int = 0) -> str:
    """Sentences of 4-12 lexicon words drawn with Zipf frequencies (p ~ 1/rank^1.1), capitalized,
    with commas and full stops; `stream` picks an independent text of the same language."""
    words = lexicon(seed=seed)
    p = 1.0 / np.arange(1, len(words) + 1) ** 1.1
    p /= p.sum()
    rng = np.random.default_rng([seed, stream, 0x7E47])
    out, size = [], 0
    while size < n_chars:
        n = int(rng.integers(4, 13))
        ws = [words[i] for i in rng.choice(len(words), size=n, p=p)]
        ws = [w + ("," if rng.random() < 0.1 and j < n - 1 else "") for j, w in enumerate(ws)]
        sentence = " ".join(ws).capitalize() + ". "
        out.append(sentence)
        size += len(sentence)
    return "".join(out)[:n_chars]


def sequences(cfg: StudyConfig) -> dict[str, np.ndarray]:
    """The study's token sequences [N, seq_len]: 'canary', 'text' (training) and 'held_out'."""
    L = cfg.seq_len
    rng = np.random.default_rng([cfg.seed, 0xCA7A])
    canary = rng.integers(0, 256, size=(cfg.canaries, L))
    text = np.frombuffer(pseudo_text(cfg.texts * L, 1, cfg.seed).encode(), np.uint8)[:cfg.texts * L]
    held = np.frombuffer(pseudo_text(cfg.held_out * L, 2, cfg.seed).encode(), np.uint8)[:cfg.held_out * L]
    return {"canary": canary.astype(np.int64), "text": text.reshape(cfg.texts, L).astype(np.int64),
            "held_out": held.reshape(cfg.held_out, L).astype(np.int64)}


# -- one training run -----------------------------------------------------------------------------
def train_and_measure(cfg: StudyConfig, loss: str, data: dict[str, np.ndarray], ctx, log=print) -> list[dict]:
    """Train one model with `loss` ('standard' or 'goldfish'); measure after every eval_every epochs.

    Returns one record per measurement (rank 0; other ranks get their copy of the same epochs)."""
    import torch

    from backend.training.evaluate import held_out_loss
    from backend.models.generate import Weights
    from backend.training.goldfish import mask_targets
    from backend.studies.memorization import measure
    from backend.models.gpt import GPT
    from backend.models.reference import gather_full
    from backend.training.optim import local_batch, make_optimizer, train_step
    from backend.training.train import TrainConfig, lr_at
    from twin.program.program import Options

    spec = cfg.spec()
    train = np.concatenate([data["canary"], data["text"]])
    kinds = np.array(["canary"] * len(data["canary"]) + ["text"] * len(data["text"]))
    inputs, targets = train[:, :-1], train[:, 1:]
    if loss == "goldfish":
        targets = mask_targets(inputs, targets, cfg.goldfish_k, cfg.goldfish_h)
    steps_per_epoch = len(train) // cfg.batch
    schedule = TrainConfig(steps=cfg.epochs * steps_per_epoch, lr=cfg.lr, min_lr=cfg.min_lr, warmup=cfg.warmup)
    torch.manual_seed(cfg.seed)
    model = GPT(spec, ctx, Options(recompute=False), seed=cfg.seed)  # small: keep the activations
    opt = make_optimizer(model, lr=cfg.lr, weight_decay=cfg.weight_decay)
    held = torch.from_numpy(data["held_out"])
    held_batches = [(local_batch(held[i:i + cfg.batch, :-1], model), local_batch(held[i:i + cfg.batch, 1:], model))
                    for i in range(0, len(held), cfg.batch)]
    records, step, t0 = [], 0, time.perf_counter()
    for epoch in range(1, cfg.epochs + 1):
        order = np.random.default_rng([cfg.seed, epoch]).permutation(len(train))  # the same for both losses
        total = 0.0
        for i in range(steps_per_epoch):
            idx = order[i * cfg.batch:(i + 1) * cfg.batch]
            step += 1
            for g in opt.param_groups:
                g["lr"] = lr_at(step, schedule)
            x = local_batch(torch.from_numpy(inputs[idx]), model)
            y = local_batch(torch.from_numpy(targets[idx]), model)
            total += train_step(model, opt, [(x, y)], max_norm=1.0)
        if epoch % cfg.eval_every and epoch != cfg.epochs:
            continue
        val = held_out_loss(model, held_batches)
        full = gather_full(model)  # a collective: every rank
        rec = {"loss": loss, "epoch": epoch, "step": step, "train_loss": total / steps_per_epoch,
               "held_out_loss": val, "seconds": time.perf_counter() - t0}
        if ctx.rank == 0:
            weights = Weights(spec, full, cfg.grid, step)
            rep = measure(weights, train, cfg.prefix, cfg.suffix)
            rec.update(exact_match=rep.exact_match, rouge_l=rep.rouge_l)
            for kind in ("canary", "text"):
                sel = [s for s, k in zip(rep.sequences, kinds) if k == kind]
                if sel:
                    rec[f"{kind}_exact_match"] = sum(s.exact for s in sel) / len(sel)
                    rec[f"{kind}_rouge_l"] = sum(s.rouge_l for s in sel) / len(sel)
            log(f"{loss:>8} epoch {epoch:>4}: train loss {rec['train_loss']:.3f}, held-out loss {val:.3f}, "
                f"exact match {100 * rep.exact_match:5.1f}% (canaries {100 * rec.get('canary_exact_match', 0):5.1f}%, "
                f"text {100 * rec.get('text_exact_match', 0):5.1f}%), ROUGE-L {rep.rouge_l:.3f} "
                f"[{rec['seconds']:.0f} s]")
        records.append(rec)
    return records


def load_average() -> float | None:
    """The 1-minute load average of this machine (None where the OS has none)."""
    try:
        import os
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def run(cfg: StudyConfig) -> dict:
    """The study on this rank (torch.distributed initialized here); rank 0 writes the results."""
    import os

    import torch

    from backend.runtime.dist import ParallelContext, destroy
    from twin.program.grid import Grid

    check(cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    ctx = ParallelContext.from_env(Grid.parse(cfg.grid), backend="gloo")
    try:
        rank0 = ctx.rank == 0
        data = sequences(cfg)
        out = Path(cfg.out)
        if rank0:
            out.mkdir(parents=True, exist_ok=True)
            spec = cfg.spec()
            print(f"memorization study: {spec.layers} layers, hidden {spec.hidden} "
                  f"({spec.parameters() / 1e6:.2f} M parameters), {cfg.canaries} canaries + {cfg.texts} texts "
                  f"of {cfg.seq_len} tokens, {cfg.epochs} epochs, prefix {cfg.prefix}, suffix {cfg.suffix}, "
                  f"goldfish k={cfg.goldfish_k} h={cfg.goldfish_h}, grid {cfg.grid}, "
                  f"{torch.get_num_threads()} threads, {os.cpu_count()} cores, load {load_average()}", flush=True)
        t0, load0 = time.perf_counter(), load_average()
        records = []
        for loss in cfg.losses:
            records += train_and_measure(cfg, loss, data, ctx, log=lambda m: print(m, flush=True))
        result = {"config": asdict(cfg), "records": records, "wall_s": time.perf_counter() - t0,
                  "load_average_start": load0, "load_average_end": load_average(), "cores": os.cpu_count(),
                  "torch_threads": torch.get_num_threads(),
                  "final": {r["loss"]: r for r in records if r["epoch"] == cfg.epochs}}
        if rank0:
            from topologies.common import finite_json, write_atomic
            write_atomic(out / "study.json", finite_json(result, indent=1))
            print(summary(result), flush=True)
            print(f"wrote {out / 'study.json'}", flush=True)
        return result
    finally:
        destroy()


def summary(result: dict) -> str:
    """The study's final figures, one line per loss."""
    lines = []
    for loss, r in result["final"].items():
        lines.append(f"{loss:>8} after {r['epoch']} epochs: exact match {100 * r['exact_match']:.1f}% "
                     f"(canaries {100 * r.get('canary_exact_match', math.nan):.1f}%, text "
                     f"{100 * r.get('text_exact_match', math.nan):.1f}%), ROUGE-L {r['rouge_l']:.3f}, "
                     f"held-out loss {r['held_out_loss']:.3f}")
    start, end = result["load_average_start"], result["load_average_end"]
    lines.append(f"wall time {result['wall_s']:.0f} s on {result['cores']} cores (1-minute load average "
                 f"{start if start is None else round(start, 1)} at the start, {end if end is None else round(end, 1)} at the end)")
    return "\n".join(lines)


def main(config: dict) -> None:
    """The `memorization-study` job of one rank (see backend.launch.launcher)."""
    run(StudyConfig.from_dict(config))


# -- the chart ------------------------------------------------------------------------------------
def chart(result: dict, path: str | Path, png: str | Path | None = None) -> list[Path]:
    """Write the study's plotly chart (exact match, ROUGE-L and held-out loss against epochs for both
    losses) as HTML, and as PNG with a headless Chromium when `png` is given. Returns the files."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    cfg = result["config"]
    fig = make_subplots(rows=1, cols=3, subplot_titles=(
        f"exact match of the {cfg['suffix']}-token suffix (%)", "ROUGE-L of the suffix",
        "held-out loss (nats/token)"))
    colors = {"standard": "#d62728", "goldfish": "#1f77b4"}
    for loss in cfg["losses"]:
        recs = [r for r in result["records"] if r["loss"] == loss]
        ep = [r["epoch"] for r in recs]
        name = loss if loss == "standard" else f"goldfish (k={cfg['goldfish_k']}, h={cfg['goldfish_h']})"
        c = colors.get(loss)
        for kind, label, dash in (("canary", "canaries", "dot"), ("text", "texts", "dash")):
            if f"{kind}_exact_match" in recs[0]:
                fig.add_trace(go.Scatter(x=ep, y=[100 * r[f"{kind}_exact_match"] for r in recs], mode="lines",
                                         line=dict(color=c, dash=dash, width=1), name=f"{name}: {label}",
                                         legendgroup=loss), row=1, col=1)
        fig.add_trace(go.Scatter(x=ep, y=[100 * r["exact_match"] for r in recs], mode="lines+markers",
                                 line=dict(color=c), name=f"{name}: all", legendgroup=loss), row=1, col=1)
        fig.add_trace(go.Scatter(x=ep, y=[r["rouge_l"] for r in recs], mode="lines+markers", line=dict(color=c),
                                 name=name, legendgroup=loss, showlegend=False), row=1, col=2)
        fig.add_trace(go.Scatter(x=ep, y=[r["held_out_loss"] for r in recs], mode="lines+markers",
                                 line=dict(color=c), name=name, legendgroup=loss, showlegend=False), row=1, col=3)
    for col in (1, 2, 3):
        fig.update_xaxes(title_text="epoch", row=1, col=col)
    fig.update_yaxes(range=[-2, 102], row=1, col=1)
    fig.update_yaxes(range=[0, 1.02], row=1, col=2)
    load = result.get("load_average_start")
    load = "n/a" if load is None else f"{load:.0f}"
    fig.update_layout(
        title=(f"Memorization: standard loss vs goldfish loss — {cfg['canaries']} random canaries + "
               f"{cfg['texts']} text sequences of {cfg['seq_len']} tokens, prefix {cfg['prefix']}, greedy; "
               f"{result['wall_s']:.0f} s on {result['cores']} shared cores (load average {load})"),
        width=1500, height=480, template="plotly_white", legend=dict(orientation="h", y=-0.2))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.write_html(path, include_plotlyjs="cdn")
    files = [path]
    if png:
        files.append(render_png(fig, Path(png)))
    return files


class NoBrowser(Exception):
    """No Chromium to render a PNG with (the HTML chart is written all the same)."""


def render_png(fig, png: Path) -> Path:
    """Screenshot a plotly figure with headless Chromium (playwright; CHROMIUM or /usr/bin/chromium,
    else playwright's own download). Raises NoBrowser, with what to install, where there is none."""
    import os
    import tempfile

    from playwright.sync_api import Error as PlaywrightError
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as tmp:
        page_file = Path(tmp) / "chart.html"
        fig.write_html(page_file, include_plotlyjs=True, full_html=True)  # offline: plotly.js inline
        exe = os.environ.get("CHROMIUM", "/usr/bin/chromium")
        with sync_playwright() as p:
            try:
                browser = p.chromium.launch(executable_path=exe if Path(exe).exists() else None)
            except PlaywrightError:
                raise NoBrowser(f"no Chromium at {exe} nor playwright's own: apt-get install chromium, or set "
                                f"CHROMIUM=/path/to/chrome") from None
            page = browser.new_page(viewport={"width": fig.layout.width, "height": fig.layout.height})
            page.goto(page_file.as_uri())
            page.wait_for_selector(".main-svg")
            png.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(png), full_page=True)
            browser.close()
    return png
