"""Hugging Face Llama checkpoints out.

`export(checkpoint, out)` writes `config.json` and the weights in safetensors (sharded with an
index when larger than `max_shard_bytes`) that `transformers.LlamaForCausalLM.from_pretrained`
loads: one tensor at a time is assembled from the rank files of a `backend run`/`finetune`
checkpoint (each rank's block is found by running its `hf_slices` readers on index views), and the
vocabulary padding rows are dropped.
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from backend.hf.load import INDEX, SINGLE, require_safetensors
from backend.hf.config import CONFIG, HFError, config_from_spec

if TYPE_CHECKING:
    import torch

    from twin.program.model import ModelSpec

MAX_SHARD_BYTES = 5 * 1024 ** 3  # transformers' default largest shard (5 GB)
# files of a Hugging Face model directory that an export copies from the directory it was imported from
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "generation_config.json")


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

    from backend.runtime.dist import ParallelContext
    from backend.models.llama import Llama, hf_layout

    model = Llama(spec, ParallelContext(grid, 0, torch.device("cpu"), "gloo", {}))
    names = {id(p): n for n, p in model.named_parameters()}
    return [[(hf, names[id(p)], p.shape, reader) for hf, p, reader in hf_layout(model, grid.coords(r))]
            for r in range(grid.size)]


def _rank_states(ckpt: Path, meta: dict, grid) -> list[dict]:
    """Every rank's saved model state, memory-mapped (read as tensors are assembled, the optimizer
    state never), after checking each file against its SHA-256."""
    import torch

    from backend.runtime import checkpoint

    out = []
    for r in range(grid.size):
        file = ckpt / checkpoint.rank_file_name(r)
        if not file.is_file() or checkpoint.file_sha256(file) != meta["files"][file.name]["sha256"]:
            raise HFError(f"checkpoint {file} is missing or does not match its checksum (damaged)")
        try:
            state = torch.load(file, map_location="cpu", mmap=True, weights_only=False)
        except Exception as e:  # noqa: BLE001 - the checksum matched: a file torch cannot map
            raise HFError(f"checkpoint {file} cannot be read ({type(e).__name__})") from None
        out.append(state.get("model", {}))
    return out


def _dcp_tensors(ckpt: Path, names: set[str]) -> dict[str, torch.Tensor]:
    """The full tensors `names` of a DCP checkpoint, after checking every file against its SHA-256."""
    from backend.runtime import checkpoint, dcp

    try:
        checkpoint.verify(ckpt)
    except checkpoint.CheckpointError as e:
        raise HFError(str(e)) from None
    tensors = dcp.read_weights(ckpt, names)
    missing = sorted(names - set(tensors))
    if missing:
        raise HFError(f"checkpoint {ckpt} has no {missing[0]}: it is not of this model")
    return tensors


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

    from backend.models.generate import read_checkpoint
    from backend.models.llama import hf_shapes
    from topologies.common import check_output, finite_json, naming, remove_quietly, write_atomic

    if dtype not in DTYPES:
        raise HFError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    ckpt, meta, spec, grid = read_checkpoint(checkpoint_path)
    if not getattr(spec, "is_llama", False):
        raise HFError(f"checkpoint {ckpt} is of {spec.name!r}, a GPT: only Llama checkpoints export to Hugging Face")
    out = check_output(out, "--out", folder=True)
    torch_dtype = getattr(torch, DTYPES[dtype][0])
    shapes = hf_shapes(spec)
    from backend.runtime import checkpoint
    layouts = _layouts(spec, grid)
    if meta["format"] == checkpoint.FORMAT:  # DCP: the full tensors under their Hugging Face names
        from_dcp = _dcp_tensors(ckpt, set(shapes))
        states = None
    else:
        states = _rank_states(ckpt, meta, grid)

    def assemble(j: int) -> dict[str, torch.Tensor]:
        """The HF tensors of parameter j (one, or q/k/v, or gate/up), assembled from every rank."""
        names = layouts[0][j][0]
        if states is None:
            return {n: from_dcp.pop(n).to(torch_dtype) for n in names}
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
        part = file.with_name(file.name + ".tmp")
        try:  # written whole or not at all: a failure (a full disk) leaves no partial file
            with naming(file):
                save_file(tensors, str(part), metadata={"format": "pt"})
                os.replace(part, file)
        except BaseException:
            remove_quietly(part)
            raise
        weight_map.update({name: file.name for name in tensors})
        del tensors
    written = list(files)
    if len(files) > 1:
        total = sum(math.prod(shape) for shape in shapes.values()) * element
        write_atomic(out / INDEX, finite_json({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        written.append(out / INDEX)
    run_cfg = meta.get("config", {})
    base = run_cfg.get("hf_config") if isinstance(run_cfg, dict) else None
    write_atomic(out / CONFIG, finite_json(config_from_spec(spec, base, DTYPES[dtype][0]), indent=2))
    written.append(out / CONFIG)
    source = run_cfg.get("init_from") if isinstance(run_cfg, dict) else None
    if source and Path(source).is_dir() and Path(source).resolve() != out.resolve():
        for fname in TOKENIZER_FILES:
            if (Path(source) / fname).is_file():
                shutil.copyfile(Path(source) / fname, out / fname)
                written.append(out / fname)
    return written

