"""The grid G_x x G_y x G_z x G_pipe x G_data: rank <-> coordinates, groups of each axis, validation.

Rank order: x varies fastest, then y, then z, then the pipeline stage p, then data:
    rank = x + G_x * (y + G_y * (z + G_z * (p + G_pipe * d)))
so the members of an x-group are consecutive ranks and sit inside a node first. A grid is written
XxYxZxD (G_pipe = 1, no pipeline) or XxYxZxPxD; the pipeline is not a collective axis (AXES): its
stages exchange activations and gradients point to point (twin/program/pipeline.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from topologies.common import TwinError
from twin.program.model import ModelSpec

AXES = ("x", "y", "z", "data")


@dataclass(frozen=True)
class Grid:
    """A 4D decomposition; written x`x`y`x`z`x`data on the command line, e.g. 8x8x4x128."""

    x: int
    y: int
    z: int
    data: int
    pipe: int = 1  # pipeline stages (G_pipe); written between z and data: XxYxZxPxD
    expert: int = 1  # E_p: experts split over groups of E_p consecutive data coordinates; suffix e<N>

    def __post_init__(self) -> None:
        for a in AXES + ("pipe", "expert"):
            v = getattr(self, a)
            if not isinstance(v, int) or v < 1:
                raise TwinError(f"grid: G_{a} must be a positive integer, got {v!r}")

    @classmethod
    def parse(cls, text: str) -> "Grid":
        """Parse 'XxYxZxD' or 'XxYxZxPxD' (four or five positive integers joined by 'x'), with an
        optional expert suffix 'e<N>' (E_p = N: 1x1x1x8e4)."""
        m = re.fullmatch(r"\s*(\d+)x(\d+)x(\d+)x(\d+)(?:x(\d+))?(?:e(\d+))?\s*", str(text))
        if m and m.group(6) is not None:  # the expert suffix (twin/program/moe.py)
            from twin.program.moe_grid import parse_expert
            return parse_expert(cls, text, m)
        if not m:
            raise TwinError(f"grid {text!r} is not of the form XxYxZxD or XxYxZxPxD (four or five positive "
                            "integers, x fastest, e.g. 8x8x4x128 or 8x8x4x2x64 with 2 pipeline stages)")
        g = [int(v) for v in m.groups() if v is not None]
        if len(g) == 5:
            return cls(g[0], g[1], g[2], g[4], pipe=g[3])
        return cls(*g)

    def __str__(self) -> str:
        e = f"e{self.expert}" if self.expert > 1 else ""
        if self.pipe > 1:
            return f"{self.x}x{self.y}x{self.z}x{self.pipe}x{self.data}{e}"
        return f"{self.x}x{self.y}x{self.z}x{self.data}{e}"

    @property
    def size(self) -> int:
        """Number of GPUs (ranks)."""
        return self.x * self.y * self.z * self.pipe * self.data

    @property
    def tensor_size(self) -> int:
        """x*y*z: the GPUs that share one copy of the model."""
        return self.x * self.y * self.z

    @property
    def edata(self) -> int:
        """G_data / E_p: the ranks an expert's gradients are all-reduced over (the "edata" group)."""
        return self.data // self.expert

    def axis_size(self, axis: str) -> int:
        return getattr(self, axis)

    def stride(self, axis: str) -> int:
        """Rank distance between consecutive members of a group of `axis`."""
        t = self.x * self.y * self.z
        return {"x": 1, "y": self.x, "z": self.x * self.y, "pipe": t, "data": t * self.pipe,
                "expert": t * self.pipe, "edata": t * self.pipe * self.expert}[axis]

    def coords(self, rank: int) -> tuple[int, int, int, int]:
        """(x, y, z, data) coordinates of a rank (its pipeline stage: `stage`)."""
        if not 0 <= rank < self.size:
            raise TwinError(f"rank {rank} is outside a grid of {self.size} GPUs")
        x, r = rank % self.x, rank // self.x
        y, r = r % self.y, r // self.y
        z, r = r % self.z, r // self.z
        return x, y, z, r // self.pipe

    def stage(self, rank: int) -> int:
        """The pipeline stage of a rank (0 without a pipeline)."""
        return rank // (self.x * self.y * self.z) % self.pipe

    def rank(self, x: int, y: int, z: int, data: int, pipe: int = 0) -> int:
        return x + self.x * (y + self.y * (z + self.z * (pipe + self.pipe * data)))

    def peer(self, rank: int, stage: int) -> int:
        """The rank of `stage` with the same x, y, z and data coordinates as `rank`."""
        return self.rank(*self.coords(rank), pipe=stage)

    def group(self, rank: int, axis: str) -> list[int]:
        """The ranks of `axis`'s group that contains `rank`, in axis order (also "expert" and "edata":
        twin/program/moe_grid.py)."""
        if axis in ("expert", "edata"):
            from twin.program.moe_grid import expert_group
            return expert_group(self, rank, axis)
        c = list(self.coords(rank))
        i = AXES.index(axis)
        p = self.stage(rank)
        members = []
        for v in range(self.axis_size(axis)):
            c[i] = v
            members.append(self.rank(*c, pipe=p))
        return members

    def groups(self, axis: str) -> list[list[int]]:
        """Every group of `axis`, each a list of ranks; together they partition the ranks."""
        if axis in ("expert", "edata"):
            from twin.program.moe_grid import expert_groups
            return expert_groups(self, axis)
        n, s = self.axis_size(axis), self.stride(axis)
        return [[base + j * s for j in range(n)]
                for base in range(self.size) if (base // s) % n == 0]

    def validate(self, model: ModelSpec, gpus: int | None = None, batch: int | None = None,
                 micro_batches: int = 1, seq_len: int | None = None) -> None:
        """Raise TwinError if this grid cannot run `model` on `gpus` GPUs with `batch` sequences."""
        if gpus is not None and self.size != gpus:
            what = "G_x*G_y*G_z*G_pipe*G_data" if self.pipe > 1 else "G_x*G_y*G_z*G_data"
            raise TwinError(f"grid {self} has {self.size} GPUs but --gpus is {gpus}: "
                            f"make {what} equal the GPU count")
        for what, v in (("global batch", batch), ("sequence length", seq_len)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise TwinError(f"{what} must be a positive integer, got {v!r}")
        h, name = model.hidden, model.name
        for axis in ("x", "y"):
            g = self.axis_size(axis)
            if h % g:
                raise TwinError(f"hidden size {h} of {name} is not divisible by G_{axis}={g}")
        if model.heads % self.y:
            raise TwinError(f"{model.heads} heads of {name} are not divisible by G_y={self.y} "
                            "(attention heads are split over y)")
        if model.n_kv_heads % self.y:
            raise TwinError(f"{model.n_kv_heads} key/value heads of {name} are not divisible by G_y={self.y} "
                            f"(q, k and v heads are split over y): use a G_y that divides {model.n_kv_heads}")
        if model.ffn % self.y:
            raise TwinError(f"MLP width {model.ffn} of {name} is not divisible by G_y={self.y}")
        s = model.seq_len if seq_len is None else seq_len
        if s % self.y:
            raise TwinError(f"sequence length {s} is not divisible by G_y={self.y}")
        b = model.global_batch if batch is None else batch
        shards = self.z * self.data
        if b % shards:
            raise TwinError(f"global batch {b} is not divisible by G_z*G_data={shards}: "
                            f"choose a batch that is a multiple of {shards}")
        if micro_batches < 1 or (b // shards) % micro_batches:
            raise TwinError(f"{b // shards} sequences per rank are not divisible into "
                            f"{micro_batches} micro-batches")
        vocab = model.padded_vocab(self.y)
        extra = [("token embedding", vocab, h, False)]
        extra += [("output head", vocab, h, False)] if model.is_llama else [("position embedding", s, h, False)]
        for lname, k, n, _ in model.linear_shapes() + extra:
            if (k * n // self.x // self.y) % self.z:
                raise TwinError(f"{lname} shard of {k}x{n}/(G_x*G_y) is not divisible by G_z={self.z}")
        if model.is_moe or self.expert > 1:
            from twin.program.moe_grid import validate_experts
            validate_experts(self, model)

