"""The pieces of a program (twin/program/program.py documents the contract): its switches (`Options`), its
operations (`Op`), the `Program` with its counts, the `Builder` that appends ops in issue order (with
the prefetch, caching and deferral switches), and the sharding helpers (which block of a weight or
embedding table a rank holds). twin/program/blocks.py builds a transformer block's ops on a Builder;
twin/program/program.py builds the step.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field, fields

from topologies.common import InputError, TwinError
from twin.program.grid import AXES, Grid
from twin.program.model import ModelSpec

STREAMS = ("compute",) + AXES
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")  # all_to_all: twin/program/moe.py
COMPUTE_KINDS = ("gemm", "attention", "elementwise", "embedding", "loss", "optimizer")

ACT_BYTES = 2     # bf16 activations, weights in flight and their gradients
GRAD_AR_BYTES = 4  # gradient shards are all-reduced over data in fp32
STAT_BYTES = 4     # fp32 statistics (layer norm, softmax)
ADAMW_BYTES_PER_PARAM = 34  # read fp32 grad, master, m, v (16); write master, m, v (12); bf16 weight (2); +4 slack
ADAMW_FLOPS_PER_PARAM = 12


@dataclass(frozen=True)
class Options:
    """Switches of the 4D algorithm (all on by default except weight caching)."""

    oar: bool = True          # overlap the backward input-gradient all-reduce with the weight-gradient GEMM
    ors: bool = True          # defer z reduce-scatters; overlap them with earlier layers' backward
    oag: bool = True          # prefetch the next layer's z all-gather one layer ahead
    cache_layers: int = 0     # keep gathered weights of the first N blocks for the whole step
    recompute: bool = True    # full activation recomputation of each block in the backward pass
    micro_batches: int = 1    # gradient accumulation steps per iteration
    grad_clip: bool = True    # global-norm gradient clipping (three scalar all-reduces)
    goldfish_h: int = 0       # goldfish loss: tokens hashed per target to mask it (0: off)
    schedule: str = "1f1b"    # pipeline schedule with G_pipe > 1: gpipe, 1f1b or interleaved (twin/program/pipeline.py)
    chunks: int = 1           # model chunks (virtual stages) per pipeline stage; > 1 with the interleaved schedule
    moe_imbalance: float = 1.0  # MoE (twin only): the busiest expert's tokens over balanced; stretches the rows its rank's
    # experts and all-to-alls carry (twin/program/moe.py); the backend routes for real and ignores it


@dataclass(frozen=True)
class Op:
    """One operation of the program.

    flops: floating-point operations of this op on one rank (flop).
    bytes: compute ops, HBM bytes read plus written; collectives, the payload in bytes
        (all-gather: the gathered output; reduce-scatter: the full input; all-reduce: the buffer).
    m, n, k, layout: GEMM sizes (C[m,n] = A[m,k] B[k,n]; layout says which operand is transposed,
        NN, NT or TN). Attention ops use m = sequences x local heads, n = sequence length, k = head dim;
        RoPE ops n = sequence length (positions restart with each sequence), k = head dim.
    replicas: how many ranks compute this very op on the same data (G_x for ops on y-split tensors).
    phase, micro_batch, role, weight, reads, writes, add, accumulate: the dataflow (module docstring).
    """

    index: int
    name: str
    kind: str
    stream: str
    deps: tuple[int, ...] = ()
    flops: float = 0.0
    bytes: int = 0
    axis: str | None = None
    m: int = 0
    n: int = 0
    k: int = 0
    layout: str = ""
    replicas: int = 1
    # the dataflow the backend executes (see the module docstring)
    phase: str = ""
    micro_batch: int = -1
    role: str = ""
    weight: str = ""
    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    add: str = ""
    accumulate: str = ""
    peer: int = -1  # send, recv: the pipeline stage at the other end (twin/program/pipeline.py)

    @property
    def is_collective(self) -> bool:
        return self.kind in COLLECTIVES

    def wire_bytes(self, group_size: int) -> float:
        """Bytes each rank sends with a ring algorithm over `group_size` ranks (bytes)."""
        p = group_size
        if p <= 1 or not self.is_collective:
            return 0.0
        factor = 2.0 if self.kind == "all_reduce" else 1.0
        return factor * (p - 1) / p * self.bytes


_OP_DEFAULTS = {f.name: f.default for f in fields(Op)}  # every field, in order (index..stream: placeholders)
_N_FIELDS = len(_OP_DEFAULTS)
_object_new = object.__new__
_object_setattr = object.__setattr__


_KEYWORDS = set(_OP_DEFAULTS) - {"index", "name", "kind", "stream", "deps", "phase", "micro_batch"}


def changed(op: Op, **values) -> Op:
    """dataclasses.replace(op, **values) without the frozen dataclass's __init__ (its __dict__ copied
    and updated: about 10 times faster); an unknown field raises TypeError as replace would."""
    d = op.__dict__.copy()
    d.update(values)
    if len(d) != _N_FIELDS:
        raise TypeError(f"Op has no fields {sorted(set(values) - set(_OP_DEFAULTS))}")
    new = _object_new(Op)
    _object_setattr(new, "__dict__", d)
    return new


@dataclass
class Program:
    """The ops of one iteration for one rank, with what they were built from."""

    model: ModelSpec
    grid: Grid
    options: Options
    batch: int     # global batch, sequences
    seq_len: int   # tokens per sequence
    vocab: int     # padded vocabulary
    ops: list[Op] = field(default_factory=list)
    stage: int = 0  # the pipeline stage whose program this is (grid.pipe > 1)

    @property
    def tokens_per_micro_batch(self) -> int:
        """Tokens one rank processes per micro-batch."""
        return self.batch // (self.grid.z * self.grid.data) // self.options.micro_batches * self.seq_len

    @property
    def ranks(self) -> int:
        """The ranks that run this program: all of them, or a pipeline stage's."""
        return self.grid.size // self.grid.pipe

    def model_flops(self) -> float:
        """Flops of one iteration over the ranks that run this program, counting replicated work once (flop)."""
        return sum(op.flops / op.replicas for op in self.ops) * self.ranks

    def matmul_flops(self) -> float:
        """GEMM and attention flops of one iteration over all ranks, replicated work once (flop).

        With recomputation and no replication error this equals ModelSpec.reference_flops exactly.
        """
        return sum(op.flops / op.replicas for op in self.ops
                   if op.kind in ("gemm", "attention")) * self.ranks

    def comm_bytes(self) -> dict[str, float]:
        """Bytes on the wire sent per rank, by axis, for ring collectives (bytes)."""
        out = {a: 0.0 for a in AXES}
        for op in self.ops:
            if op.is_collective:
                out[op.axis] = out.get(op.axis, 0.0) + op.wire_bytes(self.grid.axis_size(op.axis))
            elif op.kind == "send":  # a pipeline stage's point-to-point sends (axis "pipe")
                out[op.axis] = out.get(op.axis, 0.0) + op.bytes
        return out

    def summary(self) -> dict:
        """Counts and totals: ops by kind, flops, payload and wire bytes per axis."""
        kinds = Counter(op.kind for op in self.ops)
        payload = defaultdict(int)
        for op in self.ops:
            if op.is_collective:
                payload[op.axis] += op.bytes
        return {
            "model": self.model.name, "grid": str(self.grid), "gpus": self.grid.size,
            "global_batch": self.batch, "seq_len": self.seq_len, "padded_vocab": self.vocab,
            "options": asdict(self.options),
            "ops": len(self.ops), "ops_by_kind": dict(sorted(kinds.items())),
            "flops_per_rank": sum(op.flops for op in self.ops),
            "model_flops": self.model_flops(),
            "matmul_flops": self.matmul_flops(),
            "reference_flops": self.model.reference_flops(self.batch, self.seq_len, self.vocab,
                                                          self.options.recompute),
            "payload_bytes_per_axis": {a: payload[a] for a in AXES + tuple(k for k in payload if k not in AXES)},
            "wire_bytes_per_axis": self.comm_bytes(),
        }


class Builder:
    """Appends ops in issue order and keeps the state of the overlap switches."""

    def __init__(self, model: ModelSpec, grid: Grid, options: Options, batch: int, seq_len: int):
        self.model, self.grid, self.opt = model, grid, options
        self.axis_sizes = {a: grid.axis_size(a) for a in AXES}
        self.seq_len = seq_len
        self.vocab = model.padded_vocab(grid.y)
        self.seqs = batch // (grid.z * grid.data) // options.micro_batches  # per rank per micro-batch
        self.tokens = self.seqs * seq_len
        self.ops: list[Op] = []
        self.ready: int | None = None   # the op whose completion makes the current activation usable
        self.blocking: list[int] = []   # ops the next compute op must wait for (synchronous collectives)
        self.prefix = ""
        self.phase, self.mb = "fwd", -1  # pass and micro-batch of the ops being added
        self.gathers: list[tuple[str, str, int]] = []  # this pass's gather order: (key, name, bytes)
        self.gather_pos: dict[str, int] = {}  # weight key -> its position in `gathers`
        self.issued_gathers: dict[str, int | None] = {}
        self.last_main: int | None = None  # main GEMM of the previous gather visit (prefetch depth one)
        self.last_rs: dict[str, int] = {}  # weight key -> its latest reduce-scatter (or wgrad)

    # -- appending ------------------------------------------------------------------------------
    def _add(self, name: str, kind: str, stream: str, deps, kw: dict) -> int:
        """Append Op(index, prefix + name, kind, stream, deps (sorted, each once, no None), phase,
        micro_batch, **kw), made without the frozen dataclass's __init__ (one object.__setattr__ per
        field: about a third of a program's build time): its __dict__ is a copy of the defaults with
        the fields set. A field in `kw` that is unknown or positional (set by the builder) raises
        TypeError, and the op is equal to the one __init__ makes."""
        idx = len(self.ops)
        if None in deps:
            deps = [d for d in deps if d is not None]
        deps = tuple(deps) if len(deps) < 2 else tuple(sorted(set(deps)))
        d = _OP_DEFAULTS.copy()
        d["index"], d["name"], d["kind"], d["stream"], d["deps"] = idx, self.prefix + name, kind, stream, deps
        d["phase"], d["micro_batch"] = self.phase, self.mb
        if not kw.keys() <= _KEYWORDS:
            raise TypeError(f"Op got unexpected keyword arguments {sorted(set(kw) - _KEYWORDS)}")
        d.update(kw)
        op = _object_new(Op)
        _object_setattr(op, "__dict__", d)
        self.ops.append(op)
        return idx

    def compute(self, name: str, kind: str, deps=(), **kw) -> int:
        """A compute-stream op; it also waits for the current activation and blocking collectives."""
        return self._compute(name, kind, deps, kw)

    def _compute(self, name: str, kind: str, deps, kw: dict) -> int:
        idx = self._add(name, kind, "compute", [self.ready, *self.blocking, *deps], kw)
        self.blocking = []
        self.ready = idx
        return idx

    def collective(self, name: str, kind: str, axis: str, nbytes: int, deps=(), **kw) -> int | None:
        if self.axis_sizes[axis] == 1:
            return None
        kw["bytes"], kw["axis"] = int(nbytes), axis
        return self._add(name, kind, axis, deps, kw)

    def gemm(self, name: str, m: int, n: int, k: int, layout: str, a: str, b: str, out: str, deps=(),
             weight: str = "") -> int:
        """C[m,n] = op(A) op(B) (layout: which operand is transposed); reads buffers a, b, writes out."""
        return self._compute(name, "gemm", deps,
                             {"flops": 2.0 * m * n * k, "bytes": ACT_BYTES * (m * k + k * n + m * n), "m": m,
                              "n": n, "k": k, "layout": layout, "weight": weight, "reads": (a, b), "writes": (out,)})

    def elementwise(self, name: str, elements: int, flops_per_element: float, tensors: int,
                    replicas: int = 1, kind: str = "elementwise", **kw) -> int:
        kw["flops"], kw["bytes"], kw["replicas"] = flops_per_element * elements, ACT_BYTES * tensors * elements, replicas
        return self._compute(name, kind, (), kw)

    def allreduce_ready(self, name: str, axis: str, nbytes: int, buf: str, out: str | None = None,
                        add: str = "", role: str = "") -> None:
        """All-reduce buffer `buf` (the current activation) over `axis` into `out` (default: in
        place), then add buffer `add`; the result becomes the current activation. Without the
        collective (axis of size 1) its producer writes `out` and adds `add` itself."""
        out = out or buf
        ar = self.collective(name, "all_reduce", axis, nbytes, deps=[self.ready], reads=(buf,), writes=(out,),
                             add=add, role=role)
        if ar is not None:
            self.ready = ar
        elif out != buf or add:
            prod = self.ops[self.ready]
            writes = tuple(out if w == buf else w for w in prod.writes)
            self.ops[self.ready] = changed(prod, writes=writes, add=add)

    # -- weight gathers with prefetch and caching -------------------------------------------------
    def start_pass(self, order: list[tuple[str, str, int]]) -> None:
        """Declare the gather visits of a pass: (weight key, op name, bytes), in order."""
        self.gathers = [g for g in order if g[2] and self.grid.z > 1]
        self.gather_pos = {g[0]: i for i, g in enumerate(self.gathers)}
        self.issued_gathers = {}
        self.last_main = None

    def _issue_gather(self, i: int, deps) -> None:
        key, name, nbytes = self.gathers[i]
        self.issued_gathers[key] = self.collective(name, "all_gather", "z", nbytes, deps=deps, weight=key,
                                                   writes=(weight_buffer(key),))

    def gather(self, key: str) -> int | None:
        """The all-gather that makes weight `key` available (issuing it, and the prefetch, now)."""
        pos = self.gather_pos.get(key)
        if pos is None:
            return None  # not gathered in this pass (G_z = 1 or a cached layer)
        if key not in self.issued_gathers:
            self._issue_gather(pos, deps=[self.ready])  # issued when the program reaches it
        if self.opt.oag and pos + 1 < len(self.gathers):
            nxt = self.gathers[pos + 1][0]
            if nxt not in self.issued_gathers:
                first = self.last_main is None  # nothing to overlap yet: issue with this one
                self._issue_gather(pos + 1, deps=[self.ready if first else self.last_main])
        return self.issued_gathers[key]

    def main(self, idx: int) -> int:
        """Mark the main GEMM of a gather visit (frees the prefetch buffer when done)."""
        self.last_main = idx
        return idx

    def reduce_scatter(self, key: str, name: str, nbytes: int, wgrad: int) -> None:
        """Reduce-scatter the weight gradient that op `wgrad` wrote over z into `key`'s gradients
        (without z, `wgrad` accumulates them itself)."""
        grad = self.ops[wgrad].writes[0]
        rs = self.collective(name, "reduce_scatter", "z", nbytes, deps=[wgrad], weight=key, reads=(grad,),
                             accumulate=key)
        if rs is None:
            self.ops[wgrad] = changed(self.ops[wgrad], accumulate=key)
        self.last_rs[key] = wgrad if rs is None else rs
        if rs is not None and not self.opt.ors:
            self.blocking.append(rs)


def weight_buffer(key: str) -> str:
    """The buffer that holds weight `key` gathered over z (a GEMM reads it)."""
    return f"w:{key}"


def grad_buffer(name: str) -> str:
    """The buffer that holds the gradient of buffer `name`."""
    return f"d:{name}"


def linear_dims(grid: Grid, k: int, n: int, transposed: bool) -> tuple[int, int, str, str]:
    """(k_local, n_local, in_axis, out_axis) of a linear layer's shard: a normal layer splits its
    input features over x and its outputs over y, a transposed one the reverse."""
    in_axis, out_axis = ("y", "x") if transposed else ("x", "y")
    return k // grid.axis_size(in_axis), n // grid.axis_size(out_axis), in_axis, out_axis


MAX_PROGRAM_OPS = 500_000  # a 8,000-layer model, or a 126-layer one (Llama 3.1 405B) with 64 micro-batches
# (its fine-tune on 128 Frontier GCDs at sequence length 8,192); building is linear in ops (~20 us each)


def check_program_size(model: ModelSpec, options: Options) -> None:
    """Raise TwinError, before building anything, when the program would exceed MAX_PROGRAM_OPS ops
    (about 60 per block per micro-batch), so that an absurd model (10^12 layers) is refused at once."""
    ops = options.micro_batches * (60 * model.layers + 30)
    if ops > MAX_PROGRAM_OPS:
        raise TwinError(f"the program of {model.name} would have about {ops:,} ops ({model.layers:,} layers x "
                        f"{options.micro_batches:,} micro-batches), more than the {MAX_PROGRAM_OPS:,} the twin "
                        "builds: use fewer layers or micro-batches")


EMBEDDING_AXES = ("y", "x")  # an embedding table's rows (vocabulary or positions) split over y, features over x
NORM_AXIS = "x"              # layer norms act on the residual stream, whose features are split over x


def embedding_dims(grid: Grid, rows: int, hidden: int) -> tuple[int, int]:
    """Shape of this rank's block of an embedding table of `rows` x `hidden` (before the z-shard)."""
    return rows // grid.axis_size(EMBEDDING_AXES[0]), hidden // grid.axis_size(EMBEDDING_AXES[1])


def local_params(model: ModelSpec, grid: Grid) -> int:
    """Parameters whose optimizer state one rank holds (3D-sharded weights plus its layer norms)."""
    v = model.padded_vocab(grid.y)
    tables = 2 * v if model.is_llama else v + model.seq_len  # embedding and head, or wte and wpe
    sharded = model.layers * sum(k * n for _, k, n, _ in model.linear_shapes()) + tables * model.hidden
    norms = model.layers * model.norm_params_per_layer + model.final_norm_params
    if model.is_moe:  # experts and routers (twin/program/moe.py)
        from twin.program.moe_spec import moe_local_params
        return sharded // grid.tensor_size + norms // grid.x + moe_local_params(model, grid, range(model.layers))
    return sharded // grid.tensor_size + norms // grid.x


INPUTS = ("tokens", "targets")  # buffers a program reads without an op writing them (the data loader's)


def check_dataflow(program: "Program", where: str, by_micro_batch: bool = False) -> None:
    """Walk the ops as the executor does (complete[stream]: the last op of the stream known done) and
    check that every buffer is read after an op wrote it, and a buffer written on another stream than
    compute (a collective, a receive) only after waiting for that op; raises InputError (one line).
    by_micro_batch: buffers are each micro-batch's own (a pipeline stage's program), so a read finds the
    write of its micro-batch, or of the end of the step (micro-batch -1), not of another."""
    ops = program.ops
    writer: dict[tuple[int, str], int] = {}
    complete: dict[str, int] = {}
    local_weights = program.grid.z == 1
    for op in ops:
        mb = op.micro_batch if by_micro_batch else -1
        for d in op.deps:
            complete[ops[d].stream] = max(complete.get(ops[d].stream, -1), d)
        for name in op.reads + ((op.add,) if op.add else ()):
            w = writer.get((mb, name), writer.get((-1, name)))
            if w is None:
                if name in INPUTS or (local_weights and name.startswith("w:")):
                    continue
                raise InputError(f"{where}: op {op.name} reads {name!r} before any op writes it")
            if ops[w].stream != "compute" and complete.get(ops[w].stream, -1) < w:
                raise InputError(f"{where}: op {op.name} reads {name!r} without waiting for {ops[w].name}, "
                                 f"which writes it: add {w} to its deps")
        for name in op.writes:
            writer[(mb, name)] = op.index
        if op.stream == "compute":
            complete["compute"] = op.index
