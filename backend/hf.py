"""Hugging Face Llama checkpoints in and out.

In: `HFCheckpoint(dir)` reads `config.json` (a Llama: `spec()` is its ModelSpec) and the safetensors
files (one `model.safetensors`, or shards listed by `model.safetensors.index.json`), and checks every
tensor the model needs is there with the shape the config implies, reading the files' headers only.
`load_into(model, dir)` then gives each rank its parameters' shards: the model's `hf_slices` says, for
each parameter, which Hugging Face tensor it comes from and how to cut this rank's flat shard out of
it with basic 2-D slicing; the slicing runs on `safe_open(...).get_slice(name)`, so a rank reads only
the blocks it keeps (never a whole tensor, unless it keeps the whole tensor). A checkpoint with a
tied head (`tie_word_embeddings`, no `lm_head.weight`) is untied on the way in: the head starts as a
copy of the embedding.

Out: `export(checkpoint, out)` writes `config.json` and the weights in safetensors (sharded with an
index when larger than `max_shard_bytes`) that `transformers.LlamaForCausalLM.from_pretrained`
loads: one tensor at a time is assembled from the rank files of a `backend run`/`finetune`
checkpoint (each rank's block is found by running its `hf_slices` readers on index views), and the
vocabulary padding rows are dropped.

Only this module reads or writes Hugging Face files; `safetensors` is imported here, when used.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from twin.common import TwinError

if TYPE_CHECKING:
    import torch

    from twin.model import ModelSpec

CONFIG, SINGLE, INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"
MAX_SHARD_BYTES = 5 * 1024 ** 3  # transformers' default largest shard (5 GB)
# files of a Hugging Face model directory that an export copies from the directory it was imported from
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "generation_config.json")


class HFError(TwinError):
    """A Hugging Face directory or checkpoint that cannot be imported or exported."""


def require_safetensors() -> None:
    """Say in one line how to install safetensors when it is missing."""
    try:
        import safetensors  # noqa: F401
    except ImportError:
        raise HFError("Hugging Face checkpoints need the safetensors package: pip install safetensors") from None


# -- config.json <-> ModelSpec ----------------------------------------------------------------------
@dataclass(frozen=True)
class LlamaConfig:
    """The fields of a Llama config.json this project uses (sizes are counts)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    max_positions: int
    rope_theta: float
    norm_eps: float
    tied: bool
    rope_scaling: dict | None  # the "llama3" frequency scaling of Llama 3.1+, or None
    bos: int | None
    eos: int | None
    raw: dict


def read_config(hf_dir: str | Path) -> LlamaConfig:
    """The Llama config of a Hugging Face model directory (raises HFError with one clear line)."""
    path = Path(hf_dir) / CONFIG
    if not Path(hf_dir).is_dir():
        raise HFError(f"{hf_dir} is not a folder: give a Hugging Face model directory (config.json and *.safetensors)")
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise HFError(f"{hf_dir} has no config.json: give a Hugging Face model directory") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HFError(f"{path} cannot be read as JSON ({e})") from None
    if not isinstance(raw, dict):
        raise HFError(f"{path} is not a JSON object")
    kind = raw.get("model_type")
    archs = raw.get("architectures") or []
    if kind != "llama" or (archs and "LlamaForCausalLM" not in archs):
        what = f"{kind!r}" + (f" ({', '.join(map(str, archs))})" if archs else "")
        raise HFError(f"{path} describes a {what} model, not a Llama (model_type \"llama\", LlamaForCausalLM): "
                      "only Llama checkpoints can be imported")

    def count(key: str, default=None) -> int:
        v = raw.get(key, default)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise HFError(f"{path}: {key} must be a positive integer, got {v!r}")
        return v

    heads = count("num_attention_heads")
    hidden = count("hidden_size")
    if raw.get("head_dim") not in (None, hidden // heads) or hidden % heads:
        raise HFError(f"{path}: head_dim {raw.get('head_dim')} is not hidden_size / num_attention_heads "
                      f"({hidden} / {heads}): such Llamas are not supported")
    for key, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if raw.get(key, want) != want:
            raise HFError(f"{path}: {key} is {raw[key]!r}; this project's Llama has {want!r}")
    rope = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind != "llama3":
            raise HFError(f"{path}: rope scaling {kind!r} is not supported (only Llama 3's \"llama3\")")
    theta = raw.get("rope_theta", rope.get("rope_theta", 10000.0))
    eps = raw.get("rms_norm_eps", 1e-6)
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in (theta, eps)):
        raise HFError(f"{path}: rope_theta and rms_norm_eps must be positive numbers, got {theta!r} and {eps!r}")

    def token(key):
        v = raw.get(key)
        v = v[0] if isinstance(v, list) and v else v
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    return LlamaConfig(layers=count("num_hidden_layers"), hidden=hidden, heads=heads,
                       kv_heads=count("num_key_value_heads", heads), ffn=count("intermediate_size"),
                       vocab=count("vocab_size"), max_positions=count("max_position_embeddings", 2048),
                       rope_theta=float(theta), norm_eps=float(eps), tied=bool(raw.get("tie_word_embeddings", False)),
                       rope_scaling=scaling, bos=token("bos_token_id"), eos=token("eos_token_id"), raw=raw)


def spec_from_config(cfg: LlamaConfig, name: str, seq_len: int | None = None, global_batch: int = 8) -> ModelSpec:
    """The ModelSpec of a Llama config. seq_len: training sequence length (default: the config's
    max_position_embeddings, at most 2048); global_batch: sequences per step."""
    from twin.model import ModelSpec

    if seq_len is not None and not 1 <= seq_len <= cfg.max_positions:
        raise HFError(f"--seq-len {seq_len} must be in 1..{cfg.max_positions} (the model's max_position_embeddings)")
    rope = {}
    if cfg.rope_scaling:
        s = cfg.rope_scaling
        rope = {"rope_scaling": float(s.get("factor", 8.0)), "rope_low_freq_factor": float(s.get("low_freq_factor", 1.0)),
                "rope_high_freq_factor": float(s.get("high_freq_factor", 4.0)),
                "rope_original_context": int(s.get("original_max_position_embeddings", 8192))}
    try:
        return ModelSpec(name=name, arch="llama", layers=cfg.layers, hidden=cfg.hidden, heads=cfg.heads,
                         kv_heads=cfg.kv_heads, ffn_size=cfg.ffn, vocab=cfg.vocab,
                         seq_len=seq_len or min(cfg.max_positions, 2048), global_batch=global_batch,
                         rope_theta=cfg.rope_theta, norm_eps=cfg.norm_eps, tied_embeddings=False, **rope)
    except TwinError as e:
        raise HFError(f"{name}: {e}") from None


def config_from_spec(spec: ModelSpec, base: dict | None = None, dtype: str = "float32") -> dict:
    """A Llama config.json for `spec`: `base` (the config it was imported from) with its sizes set
    from the spec, an untied head and the weights' dtype."""
    cfg = dict(base or {})
    for key in ("quantization_config", "auto_map", "_name_or_path"):
        cfg.pop(key, None)
    cfg.update({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": spec.hidden,
                "intermediate_size": spec.ffn, "num_hidden_layers": spec.layers,
                "num_attention_heads": spec.heads, "num_key_value_heads": spec.n_kv_heads,
                "head_dim": spec.head_dim, "vocab_size": spec.vocab, "rms_norm_eps": spec.norm_eps,
                "rope_theta": spec.rope_theta, "tie_word_embeddings": False, "hidden_act": "silu",
                "attention_bias": False, "mlp_bias": False, "torch_dtype": dtype, "dtype": dtype})
    cfg.setdefault("max_position_embeddings", spec.seq_len)
    scaling = None
    if spec.rope_scaling:
        scaling = {"rope_type": "llama3", "factor": spec.rope_scaling, "low_freq_factor": spec.rope_low_freq_factor,
                   "high_freq_factor": spec.rope_high_freq_factor,
                   "original_max_position_embeddings": spec.rope_original_context}
    cfg["rope_scaling"] = scaling
    cfg["rope_parameters"] = {**(scaling or {"rope_type": "default"}), "rope_theta": spec.rope_theta}
    return cfg


# -- reading safetensors ---------------------------------------------------------------------------
class HFCheckpoint:
    """A Hugging Face Llama directory: its config and where each tensor lives (headers only)."""

    def __init__(self, hf_dir: str | Path):
        self.dir = Path(hf_dir)
        self.config = read_config(self.dir)
        require_safetensors()
        self.files = self._tensor_files()
        self._open: dict[str, object] = {}

    def spec(self, seq_len: int | None = None, global_batch: int = 8) -> ModelSpec:
        return spec_from_config(self.config, f"hf:{self.dir.name}", seq_len, global_batch)

    def _tensor_files(self) -> dict[str, Path]:
        """Tensor name -> its file, from the index (sharded) or the single file."""
        index = self.dir / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                assert isinstance(weight_map, dict)
            except (OSError, ValueError, KeyError, TypeError, AssertionError):
                raise HFError(f"{index} cannot be read (expected JSON with a \"weight_map\" object)") from None
            files = {name: self.dir / str(file) for name, file in weight_map.items()}
            missing = sorted({str(f.name) for f in files.values() if not f.is_file()})
            if missing:
                raise HFError(f"{self.dir}: {missing[0]} named by {INDEX} is missing"
                              + (f" (and {len(missing) - 1} more files)" if len(missing) > 1 else ""))
            return files
        single = self.dir / SINGLE
        if not single.is_file():
            found = sorted(p.name for p in self.dir.glob("*.safetensors"))
            hint = f" (found {', '.join(found[:3])} but no index)" if found else \
                (" (found only PyTorch .bin weights: convert them to safetensors)" if list(self.dir.glob("*.bin")) else "")
            raise HFError(f"{self.dir} has neither {SINGLE} nor {INDEX}{hint}")
        return {name: single for name in self._header(single)}

    @staticmethod
    def _header(file: Path) -> dict:
        """The JSON header of a safetensors file (names, dtypes, shapes), without reading tensors."""
        try:
            with open(file, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                if not 0 < n < 100 * 1024 ** 2:
                    raise ValueError("bad header size")
                header = json.loads(f.read(n))
        except (OSError, ValueError, UnicodeDecodeError) as e:
            raise HFError(f"{file} is not a safetensors file ({e})") from None
        header.pop("__metadata__", None)
        return header

    def check(self, spec: ModelSpec) -> None:
        """Every tensor the model needs is present with the shape `spec` implies (raises HFError)."""
        from backend.llama import hf_shapes

        headers: dict[Path, dict] = {}
        for name, shape in hf_shapes(spec).items():
            source = self.source_name(name)
            if source not in self.files:
                raise HFError(f"{self.dir}: tensor {name} is missing from the safetensors files")
            file = self.files[source]
            if file not in headers:
                headers[file] = self._header(file)
            entry = headers[file].get(source)
            if entry is None:
                raise HFError(f"{file}: tensor {source} is missing (the index names this file)")
            if tuple(entry["shape"]) != shape:
                raise HFError(f"{file}: tensor {source} has shape {tuple(entry['shape'])}, config.json implies "
                              f"{shape}: the checkpoint does not match its config")
            if entry.get("dtype") not in ("F32", "F16", "BF16", "F64"):
                raise HFError(f"{file}: tensor {source} is {entry.get('dtype')}, not a float (quantized weights "
                              "are not supported)")

    def source_name(self, name: str) -> str:
        """The stored tensor that `name` reads (a tied head reads the embedding)."""
        if name == "lm_head.weight" and self.config.tied and name not in self.files:
            return "model.embed_tokens.weight"
        return name

    def slice(self, name: str):
        """A lazy view of tensor `name` (safetensors get_slice: basic slicing reads just that block)."""
        from safetensors import safe_open

        file = self.files[self.source_name(name)]
        if file not in self._open:
            self._open[file] = safe_open(str(file), framework="pt")
        return self._open[file].get_slice(self.source_name(name))

    def close(self) -> None:
        self._open.clear()


def load_into(model, hf_dir: str | Path, wrap: Callable | None = None) -> None:
    """Copy this rank's shards of every parameter of `model` (a 4D Llama) from an HF directory,
    reading only the blocks it keeps (backend.llama.hf_slices says which).

    wrap: tests only, wraps each lazy slice (to see what a rank reads).
    """
    import torch

    from backend.llama import hf_slices

    ckpt = HFCheckpoint(hf_dir)

    def get(name: str):
        return wrap(ckpt.slice(name)) if wrap else ckpt.slice(name)

    try:
        with torch.no_grad():
            for names, param, reader in hf_slices(model):
                block = reader(get)
                if block.numel() != param.numel():
                    raise HFError(f"{hf_dir}: {', '.join(names)} give {block.numel()} values for a shard of {param.numel()}")
                param.copy_(block.reshape(param.shape).to(param.device, param.dtype))
    finally:
        ckpt.close()


# -- writing ---------------------------------------------------------------------------------------
class IndexView:
    """A stand-in for a tensor of `shape` whose basic slices are the flat indices (plus `base`) of
    their elements: a reader run on it says where each value of a rank's shard sits in the full
    tensor, computing only the indices of the blocks it reads."""

    def __init__(self, shape: tuple[int, ...], base: int = 0):
        self.shape, self.base = tuple(shape), base

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, key):
        import torch

        key = key if isinstance(key, tuple) else (key,)
        key = key + (slice(None),) * (len(self.shape) - len(key))
        ranges = []
        for k, n in zip(key, self.shape):
            if not isinstance(k, slice) or k.step not in (None, 1):
                raise TypeError("IndexView takes basic slices only")
            ranges.append(torch.arange(*k.indices(n)[:2]))
        if len(ranges) == 1:
            return ranges[0] + self.base
        rows, cols = ranges
        return rows[:, None] * self.shape[1] + cols[None, :] + self.base


def _layouts(spec: ModelSpec, grid) -> list[list[tuple[tuple[str, ...], str, torch.Size, Callable]]]:
    """For every rank of `grid`: (HF names, parameter name in its state dict, shape, reader), in the
    same parameter order on every rank."""
    import torch

    from backend.dist import ParallelContext
    from backend.llama import Llama, hf_layout

    model = Llama(spec, ParallelContext(grid, 0, torch.device("cpu"), "gloo", {}))
    names = {id(p): n for n, p in model.named_parameters()}
    return [[(hf, names[id(p)], p.shape, reader) for hf, p, reader in hf_layout(model, grid.coords(r))]
            for r in range(grid.size)]


def _rank_states(ckpt: Path, meta: dict, grid) -> list[dict]:
    """Every rank's saved model state, memory-mapped (read as tensors are assembled, the optimizer
    state never), after checking each file against its SHA-256."""
    import torch

    from backend import checkpoint

    out = []
    for r in range(grid.size):
        file = ckpt / checkpoint.rank_file_name(r)
        if not file.is_file() or checkpoint._sha256(file) != meta["files"][file.name]["sha256"]:
            raise HFError(f"checkpoint {file} is missing or does not match its checksum (damaged)")
        try:
            state = torch.load(file, map_location="cpu", mmap=True, weights_only=False)
        except Exception as e:  # noqa: BLE001 - the checksum matched: a file torch cannot map
            raise HFError(f"checkpoint {file} cannot be read ({type(e).__name__})") from None
        out.append(state.get("model", {}))
    return out


DTYPES = {"fp32": ("float32", "F32"), "bf16": ("bfloat16", "BF16"), "fp16": ("float16", "F16")}


def export(checkpoint_path: str | Path, out: str | Path, dtype: str = "fp32",
           max_shard_bytes: int = MAX_SHARD_BYTES) -> list[Path]:
    """Write a `backend run`/`finetune` checkpoint of a Llama as a Hugging Face directory.

    One tensor at a time is assembled from the ranks' shards; the padded vocabulary rows are dropped.
    Returns the files written. Raises HFError (one line) when the checkpoint is not of a Llama.
    """
    import torch

    require_safetensors()
    from safetensors.torch import save_file

    from backend.generate import read_checkpoint
    from backend.llama import hf_shapes
    from twin.common import check_output, write_atomic

    if dtype not in DTYPES:
        raise HFError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    ckpt, meta, spec, grid = read_checkpoint(checkpoint_path)
    if not getattr(spec, "is_llama", False):
        raise HFError(f"checkpoint {ckpt} is of {spec.name!r}, a GPT: only Llama checkpoints export to Hugging Face")
    out = check_output(out, "--out", folder=True)
    torch_dtype = getattr(torch, DTYPES[dtype][0])
    shapes = hf_shapes(spec)
    layouts, states = _layouts(spec, grid), _rank_states(ckpt, meta, grid)

    def assemble(j: int) -> dict[str, torch.Tensor]:
        """The HF tensors of parameter j (one, or q/k/v, or gate/up), assembled from every rank."""
        names = layouts[0][j][0]
        full_shapes = [shapes[n] for n in names]  # the real vocabulary: readers give -1 for padding rows
        bases = [0]
        for shape in full_shapes:
            bases.append(bases[-1] + math.prod(shape))
        views = {n: IndexView(shape, base) for n, shape, base in zip(names, full_shapes, bases)}
        full = torch.zeros(bases[-1], dtype=torch.float32)
        for r in range(grid.size):
            _, key, shape, reader = layouts[r][j]
            t = states[r].get(key)
            if t is None or tuple(t.shape) != tuple(shape):
                raise HFError(f"checkpoint {ckpt}: rank {r}'s {key} is "
                              f"{'missing' if t is None else tuple(t.shape)}, expected {tuple(shape)}")
            idx = reader(views.__getitem__).reshape(-1)
            keep = idx >= 0  # -1: the vocabulary's padding rows
            full[idx[keep]] = t.detach().float().reshape(-1)[keep]
        return {n: full[b:b + math.prod(shapes[n])].view(shapes[n]).to(torch_dtype).clone()
                for n, b in zip(names, bases)}

    element = torch.tensor([], dtype=torch_dtype).element_size()
    groups, size = [[]], 0
    for j, entry in enumerate(layouts[0]):  # plan the files: consecutive parameters up to max_shard_bytes each
        nbytes = sum(math.prod(shapes[n]) for n in entry[0]) * element
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(j)
        size += nbytes
    files = [out / SINGLE] if len(groups) == 1 else \
        [out / f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    for stale in list(out.glob("model*.safetensors")) + [out / INDEX]:
        if stale.exists() and stale not in files:
            stale.unlink()
    weight_map = {}
    for group, file in zip(groups, files):
        tensors = {}
        for j in group:
            tensors.update(assemble(j))
        save_file(tensors, str(file), metadata={"format": "pt"})
        weight_map.update({name: file.name for name in tensors})
        del tensors
    written = list(files)
    if len(files) > 1:
        total = sum(math.prod(shape) for shape in shapes.values()) * element
        write_atomic(out / INDEX, json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        written.append(out / INDEX)
    run_cfg = meta.get("config", {})
    base = run_cfg.get("hf_config") if isinstance(run_cfg, dict) else None
    write_atomic(out / CONFIG, json.dumps(config_from_spec(spec, base, DTYPES[dtype][0]), indent=2))
    written.append(out / CONFIG)
    source = run_cfg.get("init_from") if isinstance(run_cfg, dict) else None
    if source and Path(source).is_dir() and Path(source).resolve() != out.resolve():
        for fname in TOKENIZER_FILES:
            if (Path(source) / fname).is_file():
                shutil.copyfile(Path(source) / fname, out / fname)
                written.append(out / fname)
    return written

