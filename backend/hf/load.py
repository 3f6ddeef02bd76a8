"""Hugging Face Llama checkpoints in (backend.hf.export writes them out, backend.hf.config reads and
writes their config.json).

In: `HFCheckpoint(dir)` reads `config.json` (a Llama: `spec()` is its ModelSpec) and the safetensors
files (one `model.safetensors`, or shards listed by `model.safetensors.index.json`), and checks every
tensor the model needs is there with the shape the config implies, reading the files' headers only.
`load_into(model, dir)` then gives each rank its parameters' shards: the model's `hf_slices` says, for
each parameter, which Hugging Face tensor it comes from and how to cut this rank's flat shard out of
it with basic 2-D slicing; the slicing runs on `safe_open(...).get_slice(name)`, so a rank reads only
the blocks it keeps (never a whole tensor, unless it keeps the whole tensor). A checkpoint with a
tied head (`tie_word_embeddings`, no `lm_head.weight`) is untied on the way in: the head starts as a
copy of the embedding.

Only backend.hf.load, backend.hf.export and backend.hf.config read or write Hugging Face files;
`safetensors` is imported there, when used.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from backend.hf.config import HFError, read_config, spec_from_config

if TYPE_CHECKING:
    from twin.program.model import ModelSpec

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"


def require_safetensors() -> None:
    """Say in one line how to install safetensors when it is missing."""
    try:
        import safetensors  # noqa: F401
    except ImportError:
        raise HFError("Hugging Face checkpoints need the safetensors package: pip install safetensors") from None


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
        """The JSON header of a safetensors file (names, dtypes, shapes), without reading tensors; the
        file's size must be the one its header describes (a truncated download is refused here)."""
        try:
            with open(file, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                n = int.from_bytes(f.read(8), "little")
                if not 0 < n < min(100 * 1024 ** 2, size):
                    raise ValueError(f"a header of {n} bytes in a file of {size}")
                header = json.loads(f.read(n))
                if not isinstance(header, dict):
                    raise ValueError("its header is not a JSON object")
        except (OSError, ValueError, UnicodeDecodeError) as e:
            raise HFError(f"{file} is not a safetensors file ({e})") from None
        header.pop("__metadata__", None)
        end = 0
        for name, entry in header.items():
            offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
            if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
                    and 0 <= offsets[0] <= offsets[1]):
                raise HFError(f"{file}: tensor {name} has no valid data_offsets in its header (a damaged file)")
            end = max(end, offsets[1])
        if size != 8 + n + end:
            what = "truncated (an interrupted download?)" if size < 8 + n + end else "longer than its header says"
            raise HFError(f"{file} is {what}: {size:,} bytes, its header describes {8 + n + end:,}; "
                          "download it again")
        return header

    def check(self, spec: ModelSpec) -> None:
        """Every tensor the model needs is present with the shape `spec` implies (raises HFError)."""
        from backend.models.llama import hf_shapes

        headers = {file: self._header(file) for file in sorted(set(self.files.values()))}  # each file whole
        for name, shape in hf_shapes(spec).items():
            source = self.source_name(name)
            if source not in self.files:
                raise HFError(f"{self.dir}: tensor {name} is missing from the safetensors files")
            file = self.files[source]
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
    reading only the blocks it keeps (backend.models.llama.hf_slices says which).

    wrap: tests only, wraps each lazy slice (to see what a rank reads).
    """
    import torch

    from backend.models.llama import hf_slices

    ckpt = HFCheckpoint(hf_dir)

    def get(name: str):
        return wrap(ckpt.slice(name)) if wrap else ckpt.slice(name)

    try:
        with torch.no_grad():
            for names, param, reader in hf_slices(model):
                block = reader(get)
                if block.numel() != param.numel():
                    raise HFError(f"{hf_dir}: {', '.join(names)} give {block.numel()} values for a shard of {param.numel()}")
                if block.is_floating_point() and not bool(torch.isfinite(block).all()):
                    raise HFError(f"{ckpt.files[ckpt.source_name(names[0])]}: {' or '.join(names)} holds NaN or "
                                  "infinite values: these weights cannot be trained from")
                param.copy_(block.reshape(param.shape).to(param.device, param.dtype))
    finally:
        ckpt.close()

