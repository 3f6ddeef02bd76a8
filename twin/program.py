"""The schedule of one training iteration for one rank: the contract between twin and backend.

`build_program(model, grid, options)` returns the ordered list of ops that every rank runs. Each op
has a stable name (e.g. `L12.mlp_up.bwd.dgrad`), a kind, a stream (`compute` or the communication
stream of an axis: `x`, `y`, `z`, `data`), the indices of the ops it waits for, and its sizes.
Ops on one stream run in program order; `deps` holds only the waits across streams.

Naming: `[mb<j>.]<layer>.<pass>.<what>`; layers are `emb`, `L<i>.{ln1,qkv,attn,attn_out,ln2,mlp_up,
gelu,mlp_down}`, `lnf`, `head`, `loss` (a Llama block: `L<i>.{ln1,qkv,rope,attn,attn_out,ln2,mlp_up,
swiglu,mlp_down}`, its `ln*` RMSNorms); passes are `fwd`, `rec` (recomputed forward), `bwd`, `grad`
(gradient all-reduces at the end of the step) and `opt`. Collectives end in `ag_z`, `rs_z`, `ar_<axis>`.
The micro-batch prefix `mb<j>.` appears only with more than one micro-batch. A collective over an
axis of size 1 is left out.

Sharding (see DESIGN.md): a linear layer's W (k x n) is split k/G_in by n/G_out and the block is
sharded again over z. Attention heads split over y: with grouped-query attention (a Llama) each y-shard
holds heads/G_y query heads and kv_heads/G_y key/value heads (so G_y divides kv_heads; the qkv layer's
columns of y-shard j are [q | k | v] of its heads), and mlp_up is gate and up fused into one GEMM whose
y-shard j holds [gate_j | up_j] (so G_y divides ffn); RoPE and SwiGLU are elementwise ops on y-split
tensors. A Llama's head is its own weight (untied), laid out as the embedding: vocabulary over y.
A normal layer has input features split over x and output over y; a transposed
layer the reverse. Tokens are split over z and data by whole sequences. Attention and the
elementwise ops on y-split activations are computed identically by the G_x ranks of an x-group
(`replicas`), so model flops are sum(flops / replicas) over ops, times the number of ranks.

Dataflow (what the backend's executor runs; the twin uses only kinds, streams, deps and sizes): each
op names the buffers it `reads` and `writes` (activations such as `x:L3` the input of block 3,
`L3.qkv.out`; `d:<buffer>` its gradient; `w:<weight>` a weight gathered over z; `g:<weight>` a weight
gradient before its reduce-scatter; `tokens`, `targets` the micro-batch), the parameters it uses
(`weight`, a key such as `L3.qkv`, `emb`, `head`, `L3.ln1`, `norms`), its `role` (the kernel of a
compute op, e.g. `layer_norm`, `attention_bwd`, `adamw`; what an all-reduce reduces: `ln_stats`,
`loss_sums`, `max`, `grad`, or its buffer in place), a buffer to `add` to its output (a residual) and
the weight whose gradients its output `accumulate`s into. `phase` (`fwd`, `rec`, `bwd`, `grad`, `opt`)
and `micro_batch` (-1 for the end of the step) say which part of the step it belongs to.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field, replace

from twin.common import TwinError
from twin.grid import AXES, Grid
from twin.model import ModelSpec

STREAMS = ("compute",) + AXES
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")
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

    @property
    def tokens_per_micro_batch(self) -> int:
        """Tokens one rank processes per micro-batch."""
        return self.batch // (self.grid.z * self.grid.data) // self.options.micro_batches * self.seq_len

    def model_flops(self) -> float:
        """Flops of one iteration over all ranks, counting replicated work once (flop)."""
        return sum(op.flops / op.replicas for op in self.ops) * self.grid.size

    def matmul_flops(self) -> float:
        """GEMM and attention flops of one iteration over all ranks, replicated work once (flop).

        With recomputation and no replication error this equals ModelSpec.reference_flops exactly.
        """
        return sum(op.flops / op.replicas for op in self.ops
                   if op.kind in ("gemm", "attention")) * self.grid.size

    def comm_bytes(self) -> dict[str, float]:
        """Bytes on the wire sent per rank, by axis, for ring collectives (bytes)."""
        out = {a: 0.0 for a in AXES}
        for op in self.ops:
            if op.is_collective:
                out[op.axis] += op.wire_bytes(self.grid.axis_size(op.axis))
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
            "payload_bytes_per_axis": {a: payload[a] for a in AXES},
            "wire_bytes_per_axis": self.comm_bytes(),
        }


class _Builder:
    """Appends ops in issue order and keeps the state of the overlap switches."""

    def __init__(self, model: ModelSpec, grid: Grid, options: Options, batch: int, seq_len: int):
        self.model, self.grid, self.opt = model, grid, options
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
    def _add(self, name: str, kind: str, stream: str, deps, **kw) -> int:
        idx = len(self.ops)
        deps = tuple(sorted({d for d in deps if d is not None}))
        self.ops.append(Op(idx, self.prefix + name, kind, stream, deps, phase=self.phase,
                           micro_batch=self.mb, **kw))
        return idx

    def compute(self, name: str, kind: str, deps=(), **kw) -> int:
        """A compute-stream op; it also waits for the current activation and blocking collectives."""
        idx = self._add(name, kind, "compute", [self.ready, *self.blocking, *deps], **kw)
        self.blocking = []
        self.ready = idx
        return idx

    def collective(self, name: str, kind: str, axis: str, nbytes: int, deps=(), **kw) -> int | None:
        if self.grid.axis_size(axis) == 1:
            return None
        return self._add(name, kind, axis, deps, bytes=int(nbytes), axis=axis, **kw)

    def gemm(self, name: str, m: int, n: int, k: int, layout: str, a: str, b: str, out: str, deps=(),
             weight: str = "") -> int:
        """C[m,n] = op(A) op(B) (layout: which operand is transposed); reads buffers a, b, writes out."""
        nbytes = ACT_BYTES * (m * k + k * n + m * n)
        return self.compute(name, "gemm", deps, flops=2.0 * m * n * k, bytes=nbytes, m=m, n=n, k=k,
                            layout=layout, weight=weight, reads=(a, b), writes=(out,))

    def elementwise(self, name: str, elements: int, flops_per_element: float, tensors: int,
                    replicas: int = 1, kind: str = "elementwise", **kw) -> int:
        return self.compute(name, kind, flops=flops_per_element * elements,
                            bytes=ACT_BYTES * tensors * elements, replicas=replicas, **kw)

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
            self.ops[self.ready] = replace(prod, writes=writes, add=add)

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
            self.ops[wgrad] = replace(self.ops[wgrad], accumulate=key)
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


def build_program(model: ModelSpec, grid: Grid, options: Options | None = None,
                  batch: int | None = None, seq_len: int | None = None) -> Program:
    """Build the program of one iteration for one rank (the same for every rank).

    batch: global batch in sequences (default: the model's); seq_len: tokens per sequence.
    Raises TwinError when the grid cannot run the model.
    """
    options = options or Options()
    batch = model.global_batch if batch is None else batch
    seq_len = model.seq_len if seq_len is None else seq_len
    grid.validate(model, batch=batch, micro_batches=options.micro_batches, seq_len=seq_len)
    check_program_size(model, options)
    b = _Builder(model, grid, options, batch, seq_len)
    h, gx, gy = model.hidden, grid.x, grid.y
    m, V, s = b.tokens, b.vocab, seq_len
    llama = model.is_llama
    wte_bytes = ACT_BYTES * math.prod(embedding_dims(grid, V, h))  # the head's bytes too (tied or not)
    emb_bytes = wte_bytes + (0 if llama else ACT_BYTES * math.prod(embedding_dims(grid, s, h)))
    qkv_local, f_local = model.qkv_width // gy, model.ffn // gy
    linears = model.linear_shapes()
    W, D = weight_buffer, grad_buffer
    rope_width = (model.heads + model.n_kv_heads) * model.head_dim // gy  # the rotated q and k features

    def wbytes(k, n, t):
        kl, nl, _, _ = linear_dims(grid, k, n, t)
        return ACT_BYTES * kl * nl

    def cached(i: int, first_mb: bool) -> bool:
        return i < options.cache_layers and not first_mb

    def layer_norm(name: str, inp: str, out: str) -> None:
        """Layer norm of buffer `inp` (statistics all-reduced over x) into `out`."""
        if llama:
            return rms_norm(name, inp, out)
        stats = b.collective(f"{name}.{b.phase}.ar_x", "all_reduce", "x", STAT_BYTES * 2 * m, deps=[b.ready],
                             role="ln_stats", reads=(inp,), writes=(f"{name}.stats",))
        b.ready = stats if stats is not None else b.ready
        reads = (inp, f"{name}.stats") if stats is not None else (inp,)
        b.elementwise(f"{name}.{b.phase}", m * h // gx, 8, 2, role="layer_norm", weight=name, reads=reads,
                      writes=(out, f"{name}.ctx"))

    def rms_norm(name: str, inp: str, out: str) -> None:
        """RMSNorm of buffer `inp` (per-token sum of squares all-reduced over x) into `out`."""
        stats = b.collective(f"{name}.{b.phase}.ar_x", "all_reduce", "x", STAT_BYTES * m, deps=[b.ready],
                             role="rms_stats", reads=(inp,), writes=(f"{name}.stats",))
        b.ready = stats if stats is not None else b.ready
        reads = (inp, f"{name}.stats") if stats is not None else (inp,)
        b.elementwise(f"{name}.{b.phase}", m * h // gx, 4, 2, role="rms_norm", weight=name, reads=reads,
                      writes=(out, f"{name}.ctx"))

    def rms_norm_bwd(name: str, dout: str, dinp: str, add: str = "") -> None:
        sums = b.collective(f"{name}.bwd.ar_x", "all_reduce", "x", STAT_BYTES * m, deps=[b.ready],
                            role="rms_grad_stats", weight=name, reads=(dout, f"{name}.ctx"),
                            writes=(f"{name}.grad_stats",))
        b.ready = sums if sums is not None else b.ready
        reads = (dout, f"{name}.ctx") + ((f"{name}.grad_stats",) if sums is not None else ())
        b.elementwise(f"{name}.bwd", m * h // gx, 8, 4, role="rms_norm_bwd", weight=name, reads=reads,
                      writes=(dinp,), add=add)

    def layer_norm_bwd(name: str, dout: str, dinp: str, add: str = "") -> None:
        """Input gradient `dinp` (+ buffer `add`) of a layer norm; its parameters' gradients."""
        if llama:
            return rms_norm_bwd(name, dout, dinp, add)
        sums = b.collective(f"{name}.bwd.ar_x", "all_reduce", "x", STAT_BYTES * 2 * m, deps=[b.ready],
                            role="ln_grad_stats", weight=name, reads=(dout, f"{name}.ctx"),
                            writes=(f"{name}.grad_stats",))
        b.ready = sums if sums is not None else b.ready
        reads = (dout, f"{name}.ctx") + ((f"{name}.grad_stats",) if sums is not None else ())
        b.elementwise(f"{name}.bwd", m * h // gx, 12, 4, role="layer_norm_bwd", weight=name, reads=reads,
                      writes=(dinp,), add=add)

    def linear_fwd(lname: str, k: int, n: int, t: bool, inp: str, out: str, add: str = "") -> None:
        kl, nl, in_axis, _ = linear_dims(grid, k, n, t)
        ag = b.gather(lname)
        b.main(b.gemm(f"{lname}.{b.phase}.gemm", m, nl, kl, "NN", inp, W(lname), f"{lname}.out", deps=[ag],
                      weight=lname))
        b.allreduce_ready(f"{lname}.{b.phase}.ar_{in_axis}", in_axis, ACT_BYTES * m * nl, f"{lname}.out", out, add)

    def linear_bwd(lname: str, k: int, n: int, t: bool, inp: str, dout: str, dinp: str, gathered: bool) -> None:
        """dgrad (dinp = dout W^T, all-reduced), wgrad (inp^T dout), reduce-scatter of the latter."""
        kl, nl, _, out_axis = linear_dims(grid, k, n, t)
        ag = None if gathered else b.gather(lname)
        dgrad = b.gemm(f"{lname}.bwd.dgrad", m, kl, nl, "NT", dout, W(lname), dinp, deps=[ag], weight=lname)
        if not gathered:
            b.main(dgrad)
        grad_ready = b.ready
        ar = b.collective(f"{lname}.bwd.ar_{out_axis}", "all_reduce", out_axis, ACT_BYTES * m * kl,
                          deps=[dgrad], reads=(dinp,), writes=(dinp,))
        wgrad = b.gemm(f"{lname}.bwd.wgrad", kl, nl, m, "TN", inp, dout, f"g:{lname}",
                       deps=[] if options.oar else [ar], weight=lname)
        b.reduce_scatter(lname, f"{lname}.bwd.rs_z", ACT_BYTES * kl * nl, wgrad)
        b.ready = ar if ar is not None else grad_ready

    def block_io(i: int) -> dict[str, str]:
        """Buffers of block i: its input, the residual after attention, the inputs of its linears."""
        L = f"L{i}"
        act = "swiglu" if llama else "gelu"
        return {"x": f"x:{L}", "mid": f"{L}.mid", "out": f"x:L{i + 1}", "qkv": f"{L}.ln1.out",
                "attn_out": f"{L}.attn.out", "mlp_up": f"{L}.ln2.out", "mlp_down": f"{L}.{act}.out",
                "attn_in": f"{L}.rope.out" if llama else f"{L}.qkv.out"}

    def block_fwd(i: int) -> None:
        L, io = f"L{i}", block_io(i)
        heads = model.heads // gy
        lin = {ln: (k, n, t) for ln, k, n, t in linears}
        layer_norm(f"{L}.ln1", io["x"], io["qkv"])
        linear_fwd(f"{L}.qkv", *lin["qkv"], io["qkv"], f"{L}.qkv.out")
        if llama:  # rotary embeddings of q and k: 2 multiplies and an add per element
            b.elementwise(f"{L}.rope.{b.phase}", m * rope_width, 3, 2, replicas=gx, role="rope", n=s,
                          k=model.head_dim, reads=(f"{L}.qkv.out",), writes=(io["attn_in"],))
        b.compute(f"{L}.attn.{b.phase}", "attention", flops=4.0 * b.seqs * s * s * h / gy,
                  bytes=ACT_BYTES * m * (qkv_local + h // gy), m=b.seqs * heads, n=s, k=model.head_dim,
                  replicas=gx, role="attention", reads=(io["attn_in"],), writes=(io["attn_out"], f"{L}.attn.ctx"))
        linear_fwd(f"{L}.attn_out", *lin["attn_out"], io["attn_out"], io["mid"], add=io["x"])
        layer_norm(f"{L}.ln2", io["mid"], io["mlp_up"])
        linear_fwd(f"{L}.mlp_up", *lin["mlp_up"], io["mlp_up"], f"{L}.mlp_up.out")
        if llama:  # silu(gate) * up: reads gate and up, writes the product
            b.elementwise(f"{L}.swiglu.{b.phase}", m * f_local, 6, 3, replicas=gx, role="swiglu",
                          reads=(f"{L}.mlp_up.out",), writes=(io["mlp_down"], f"{L}.swiglu.ctx"))
        else:
            b.elementwise(f"{L}.gelu.{b.phase}", m * model.ffn // gy, 8, 2, replicas=gx, role="gelu",
                          reads=(f"{L}.mlp_up.out",), writes=(io["mlp_down"], f"{L}.gelu.ctx"))
        linear_fwd(f"{L}.mlp_down", *lin["mlp_down"], io["mlp_down"], io["out"], add=io["mid"])

    def block_bwd(i: int) -> None:
        L, io = f"L{i}", block_io(i)
        heads = model.heads // gy
        lin = {ln: (k, n, t) for ln, k, n, t in linears}
        gathered = options.recompute  # with recomputation the backward reuses the recompute's gather
        linear_bwd(f"{L}.mlp_down", *lin["mlp_down"], io["mlp_down"], D(io["out"]), D(io["mlp_down"]), gathered)
        if llama:
            b.elementwise(f"{L}.swiglu.bwd", m * f_local, 10, 5, replicas=gx, role="swiglu_bwd",
                          reads=(D(io["mlp_down"]), f"{L}.swiglu.ctx"), writes=(D(f"{L}.mlp_up.out"),))
        else:
            b.elementwise(f"{L}.gelu.bwd", m * model.ffn // gy, 8, 3, replicas=gx, role="gelu_bwd",
                          reads=(D(io["mlp_down"]), f"{L}.gelu.ctx"), writes=(D(f"{L}.mlp_up.out"),))
        linear_bwd(f"{L}.mlp_up", *lin["mlp_up"], io["mlp_up"], D(f"{L}.mlp_up.out"), D(io["mlp_up"]), gathered)
        layer_norm_bwd(f"{L}.ln2", D(io["mlp_up"]), D(io["mid"]), add=D(io["out"]))
        linear_bwd(f"{L}.attn_out", *lin["attn_out"], io["attn_out"], D(io["mid"]), D(io["attn_out"]), gathered)
        b.compute(f"{L}.attn.bwd", "attention", flops=8.0 * b.seqs * s * s * h / gy,
                  bytes=ACT_BYTES * 2 * m * (qkv_local + h // gy), m=b.seqs * heads, n=s, k=model.head_dim,
                  replicas=gx, role="attention_bwd", reads=(D(io["attn_out"]), f"{L}.attn.ctx"),
                  writes=(D(io["attn_in"]),))
        if llama:  # the inverse rotation
            b.elementwise(f"{L}.rope.bwd", m * rope_width, 3, 2, replicas=gx, role="rope_bwd", n=s,
                          k=model.head_dim, reads=(D(io["attn_in"]),), writes=(D(f"{L}.qkv.out"),))
        linear_bwd(f"{L}.qkv", *lin["qkv"], io["qkv"], D(f"{L}.qkv.out"), D(io["qkv"]), gathered)
        layer_norm_bwd(f"{L}.ln1", D(io["qkv"]), D(io["x"]), add=D(io["mid"]))

    def fwd_order(first_mb: bool) -> list[tuple[str, str, int]]:
        order = [("emb", "emb.fwd.ag_z", emb_bytes)]
        for i in range(model.layers):
            if not cached(i, first_mb):
                order += [(f"L{i}.{ln}", f"L{i}.{ln}.fwd.ag_z", wbytes(k, n, t)) for ln, k, n, t in linears]
        return order + [("head", "head.fwd.ag_z", wte_bytes)]

    def bwd_order() -> list[tuple[str, str, int]]:
        order = [("head", "head.bwd.ag_z", wte_bytes)]
        for i in reversed(range(model.layers)):
            if i < options.cache_layers:
                continue
            lin = linears if options.recompute else linears[::-1]
            order += [(f"L{i}.{ln}", f"L{i}.{ln}.bwd.ag_z", wbytes(k, n, t)) for ln, k, n, t in lin]
        return order

    x0, xl = "x:L0", f"x:L{model.layers}"
    for mb in range(options.micro_batches):
        b.prefix = f"mb{mb}." if options.micro_batches > 1 else ""
        b.ready, b.mb, b.phase = None, mb, "fwd"
        # forward
        b.start_pass(fwd_order(mb == 0))
        ag = b.gather("emb")
        b.main(b.compute("emb.fwd", "embedding", deps=[ag], flops=float(m * h // gx),
                         bytes=ACT_BYTES * 3 * m * h // gx, role="embedding", weight="emb",
                         reads=("tokens", W("emb")), writes=("emb.out",)))
        b.allreduce_ready("emb.fwd.ar_y", "y", ACT_BYTES * m * h // gx, "emb.out", x0)
        for i in range(model.layers):
            block_fwd(i)
        layer_norm("lnf", xl, "lnf.out")
        ag = b.gather("head")
        b.main(b.gemm("head.fwd.gemm", m, V // gy, h // gx, "NT", "lnf.out", W("head"), "head.out", deps=[ag],
                      weight="head"))
        b.allreduce_ready("head.fwd.ar_x", "x", ACT_BYTES * m * V // gy, "head.out", "logits")
        if options.goldfish_h:  # the goldfish mask: integer hashing of h ids per target, no flops; the
            # data loader applies it to the targets (backend.goldfish), the loss still runs over every token
            b.compute("loss.fwd.mask", "elementwise", flops=0.0, bytes=8 * 2 * m, replicas=gx * gy,
                      role="goldfish_mask", reads=("targets",))
        local_sums = grid.y == 1  # nothing to reduce over y: the loss's sums are this rank's own
        b.compute("loss.fwd", "loss", flops=5.0 * m * V / gy, bytes=4 * m * V // gy, replicas=gx, role="loss",
                  reads=("logits", "targets"), writes=("loss.max",) + (("loss.sums",) if local_sums else ()))
        b.allreduce_ready("loss.fwd.ar_y_max", "y", STAT_BYTES * m, "loss.max", role="max")
        ar = b.collective("loss.fwd.ar_y_sum", "all_reduce", "y", STAT_BYTES * 2 * m, deps=[b.ready],
                          role="loss_sums", reads=("logits", "loss.max", "targets"), writes=("loss.sums",))
        b.ready = ar if ar is not None else b.ready
        # backward
        b.phase = "bwd"
        b.start_pass(bwd_order())
        b.compute("loss.bwd", "loss", flops=3.0 * m * V / gy, bytes=4 * m * V // gy, replicas=gx, role="loss_bwd",
                  reads=("logits", "targets", "loss.max", "loss.sums"), writes=(D("logits"),))
        # the head is a normal layer whose weight is wte^T: dgrad is NN, wgrad produces wte's layout
        kl, nl = h // gx, V // gy
        ag = b.gather("head")
        dgrad = b.main(b.gemm("head.bwd.dgrad", m, kl, nl, "NN", D("logits"), W("head"), D("lnf.out"), deps=[ag],
                              weight="head"))
        ar = b.collective("head.bwd.ar_y", "all_reduce", "y", ACT_BYTES * m * kl, deps=[dgrad],
                          reads=(D("lnf.out"),), writes=(D("lnf.out"),))
        wgrad = b.gemm("head.bwd.wgrad", nl, kl, m, "TN", D("logits"), "lnf.out", "g:head",
                       deps=[] if options.oar else [ar], weight="head")
        b.reduce_scatter("head", "head.bwd.rs_z", ACT_BYTES * kl * nl, wgrad)
        b.ready = ar if ar is not None else dgrad
        layer_norm_bwd("lnf", D("lnf.out"), D(xl))
        for i in reversed(range(model.layers)):
            if options.recompute:
                b.phase = "rec"
                block_fwd(i)
                b.phase = "bwd"
            block_bwd(i)
        b.compute("emb.bwd", "embedding", flops=float(m * h // gx), bytes=ACT_BYTES * 3 * m * h // gx,
                  role="embedding_bwd", weight="emb", reads=(D(x0), "tokens"), writes=("g:emb",))
        b.reduce_scatter("emb", "emb.bwd.rs_z", emb_bytes, b.ready)

    # end of step: after the backward pass, each gradient shard is all-reduced over data once its
    # reduce-scatter is done (in layer order), then the optimizer runs
    b.prefix, b.mb, b.phase = "", -1, "grad"
    grad_ar = []
    P = grid.tensor_size
    end_of_backward = b.ready
    for i in range(model.layers):
        for ln, k, n, _ in linears:
            key = f"L{i}.{ln}"
            grad_ar.append(b.collective(f"{key}.grad.ar_data", "all_reduce", "data",
                                        GRAD_AR_BYTES * k * n // P, deps=[b.last_rs[key], end_of_backward],
                                        role="grad", weight=key))
    if llama:  # the untied head has its own gradient
        for key in ("emb", "head"):
            grad_ar.append(b.collective(f"{key}.grad.ar_data", "all_reduce", "data", GRAD_AR_BYTES * V * h // P,
                                        deps=[b.last_rs[key], end_of_backward], role="grad", weight=key))
    else:
        grad_ar.append(b.collective("emb.grad.ar_data", "all_reduce", "data",
                                    GRAD_AR_BYTES * (V + s) * h // P,
                                    deps=[b.last_rs["emb"], b.last_rs["head"], end_of_backward], role="grad",
                                    weight="emb"))
    norm_params = (model.layers * model.norm_params_per_layer + model.final_norm_params) // gx
    nz = b.collective("norms.grad.ar_z", "all_reduce", "z", STAT_BYTES * norm_params, deps=[b.ready],
                      role="grad", weight="norms")
    grad_ar.append(b.collective("norms.grad.ar_data", "all_reduce", "data", STAT_BYTES * norm_params,
                                deps=[nz if nz is not None else b.ready], role="grad", weight="norms"))
    n_local = _local_params(model, grid)
    b.phase = "opt"
    clip = ()
    if options.grad_clip:
        b.compute("opt.norm", "elementwise", deps=grad_ar, flops=2.0 * n_local, bytes=GRAD_AR_BYTES * n_local,
                  role="grad_norm", writes=("opt.norm",))
        for axis in ("x", "y", "z"):
            b.allreduce_ready(f"opt.clip.ar_{axis}", axis, STAT_BYTES, "opt.norm")
        grad_ar, clip = [], ("opt.norm",)
    b.compute("opt.step", "optimizer", deps=grad_ar, flops=float(ADAMW_FLOPS_PER_PARAM * n_local),
              bytes=ADAMW_BYTES_PER_PARAM * n_local, role="adamw", reads=clip)
    return Program(model, grid, options, batch, seq_len, b.vocab, b.ops)


def _local_params(model: ModelSpec, grid: Grid) -> int:
    """Parameters whose optimizer state one rank holds (3D-sharded weights plus its layer norms)."""
    v = model.padded_vocab(grid.y)
    tables = 2 * v if model.is_llama else v + model.seq_len  # embedding and head, or wte and wpe
    sharded = model.layers * sum(k * n for _, k, n, _ in model.linear_shapes()) + tables * model.hidden
    norms = model.layers * model.norm_params_per_layer + model.final_norm_params
    return sharded // grid.tensor_size + norms // grid.x
