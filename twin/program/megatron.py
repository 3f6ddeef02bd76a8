"""Megatron-LM's schedule as the twin's program (`Options.framework = "megatron"`), as Narayanan et al.
(SC'21) and Korthikanti et al. (2022) ran it on Selene; docs/megatron.md says where and why it differs
from the 4D (AxoNN) program.

- Tensor parallelism is 1D: column-parallel qkv and mlp_up, row-parallel attn_out and mlp_down. In the
  twin's axes that is the **y axis** of a grid 1 x T x 1 x P x D: a normal layer splits its outputs
  over y (column-parallel, no forward all-reduce), a transposed one its inputs (row-parallel, the
  forward all-reduce of its output over y), heads split over y, the vocabulary of the embedding and
  the head over y (Megatron-LM's vocab-parallel embedding and cross-entropy all-reduces). A grid with
  G_x > 1 or G_z > 1 is refused (`check_framework`).
- The tensor-parallel all-reduces are on the critical path: the forward ones (attn_out, mlp_down) and
  the backward ones (qkv, mlp_up input gradients) are waited for before the next GEMM (no OAR: the
  weight-gradient GEMM waits for the all-reduce, as Megatron-LM's ColumnParallelLinear of 2021 did).
- Attention is not fused (no flash attention in 2021): a batched QK^T GEMM, the fused scale, causal
  mask and softmax kernel, dropout of the probabilities, a batched probabilities x V GEMM; the backward
  the four batched GEMMs and the two elementwise kernels (`attention_fwd`, `attention_bwd`).
- Data-parallel gradients: Megatron-LM's local DDP kept them in one fp16 buffer (fp16 training without
  `--accumulate-allreduce-grads-in-fp32`) and all-reduced them after the pipeline flush, not overlapped
  with the backward (ops.grad_ar_bytes: 2 bytes per parameter).
- Mixed-precision Adam with fp32 master weights, not sharded over data (the program's optimizer).
- The word embedding on the first stage, the tied head on the last, their gradients exchanged at the
  end of the step (twin/program/pipeline.py: Megatron-LM's embedding group).
- Pipeline sends use the scatter/gather optimization (SC'21, section 4.1): each of the T ranks of a
  stage sends 1/T of the activation to its peer and the receivers all-gather it over y (NVLink).
"""

from __future__ import annotations

import dataclasses

from topologies.common import TwinError
from twin.program.grid import Grid
from twin.program.ops import ACT_BYTES, Options, grad_buffer as D, weight_buffer as W

FRAMEWORKS = ("axonn", "megatron", "megatron-sp")
MASK_BYTES = 1  # a dropout mask element (uint8)


def is_megatron(options: Options) -> bool:
    """Megatron-LM's program, with or without sequence parallelism."""
    return options.framework.startswith("megatron")


def is_sequence_parallel(options: Options) -> bool:
    """Megatron-LM's program with sequence parallelism and selective recomputation (Korthikanti et al.)."""
    return options.framework == "megatron-sp"


def framework_options(options: Options, framework: str) -> Options:
    """`options` for `framework`: Megatron-LM's schedule overlaps none of the 4D switches (OAR, ORS,
    OAG, weight caching: there is no z axis and the backward all-reduce is synchronous)."""
    framework = framework.strip().lower()
    if framework not in FRAMEWORKS:
        raise TwinError(f"--framework {framework!r} is not one of {', '.join(FRAMEWORKS)}")
    if framework == "axonn":
        return dataclasses.replace(options, framework="axonn")
    # megatron-sp: selective recomputation recomputes the attention core alone (no full recompute pass)
    return dataclasses.replace(options, framework=framework, oar=False, ors=False, oag=False, cache_layers=0,
                               recompute=options.recompute and framework == "megatron")


def check_framework(grid: Grid, options: Options) -> None:
    """Raise TwinError (one line) when `grid` is not a grid of the framework's."""
    if not is_megatron(options):
        if options.framework != "axonn":
            raise TwinError(f"framework {options.framework!r} is not one of {', '.join(FRAMEWORKS)}")
        return
    if grid.x != 1 or grid.z != 1:
        good = Grid(1, grid.x * grid.y * grid.z, 1, grid.data, pipe=grid.pipe)
        raise TwinError(f"grid {grid}: Megatron-LM's 1D tensor parallelism is the grid's y axis (heads and "
                        f"column-parallel outputs split over y): use {good} "
                        "(1xTx1xPxD, or 1xTx1xD without a pipeline)")


def _gemm(b, name: str, m: int, n: int, k: int, layout: str, flops: float, nbytes: int, reads, writes) -> int:
    return b._compute(name, "gemm", (), {"flops": flops, "bytes": int(nbytes), "m": m, "n": n, "k": k,
                                         "layout": layout, "reads": tuple(reads), "writes": tuple(writes)})


def attention_fwd(blk, L: str, attn_in: str, attn_out: str) -> None:
    """Block L's unfused attention forward (the current phase: fwd or rec) on y-split heads."""
    b, model = blk.b, blk.model
    seqs, s, d = b.seqs, blk.s, model.head_dim
    heads = model.heads // blk.gy
    bh = seqs * heads              # (sequence, head) pairs of this rank
    e = bh * s * s                 # score elements
    qk = bh * s * d                # elements of q (or k, v, the context)
    f = 2.0 * e * d                # flops of one batched GEMM (per head: s x s x d)
    ph = b.phase
    _gemm(b, f"{L}.attn.{ph}.scores", bh * s, s, d, "NT", f, ACT_BYTES * (2 * qk + e), (attn_in,),
          (f"{L}.attn.scores",))
    b.compute(f"{L}.attn.{ph}.softmax", "elementwise", flops=5.0 * e, bytes=2 * ACT_BYTES * e, role="softmax",
              reads=(f"{L}.attn.scores",), writes=(f"{L}.attn.probs",))
    b.compute(f"{L}.attn.{ph}.dropout", "elementwise", flops=2.0 * e, bytes=(2 * ACT_BYTES + MASK_BYTES) * e,
              role="dropout", reads=(f"{L}.attn.probs",), writes=(f"{L}.attn.dropped",))
    _gemm(b, f"{L}.attn.{ph}.context", bh * s, d, s, "NN", f, ACT_BYTES * (e + 2 * qk),
          (f"{L}.attn.dropped", attn_in), (attn_out, f"{L}.attn.ctx"))


def attention_bwd(blk, L: str, attn_in: str, attn_out: str) -> None:
    """Block L's unfused attention backward: the gradients of the context GEMM, dropout, softmax and
    the scores GEMM, into d:attn_in (q, k and v)."""
    b, model = blk.b, blk.model
    seqs, s, d = b.seqs, blk.s, model.head_dim
    bh = seqs * (model.heads // blk.gy)
    e, qk = bh * s * s, bh * s * d
    f = 2.0 * e * d
    dout = D(attn_out)
    _gemm(b, f"{L}.attn.bwd.dprobs", bh * s, s, d, "NT", f, ACT_BYTES * (2 * qk + e), (dout, f"{L}.attn.ctx"),
          (D(f"{L}.attn.dropped"),))
    _gemm(b, f"{L}.attn.bwd.dv", bh * s, d, s, "TN", f, ACT_BYTES * (e + 2 * qk), (f"{L}.attn.dropped", dout),
          (D(f"{L}.attn.v"),))
    b.compute(f"{L}.attn.bwd.dropout", "elementwise", flops=2.0 * e, bytes=(2 * ACT_BYTES + MASK_BYTES) * e,
              role="dropout_bwd", reads=(D(f"{L}.attn.dropped"),), writes=(D(f"{L}.attn.probs"),))
    b.compute(f"{L}.attn.bwd.softmax", "elementwise", flops=4.0 * e, bytes=3 * ACT_BYTES * e, role="softmax_bwd",
              reads=(D(f"{L}.attn.probs"), f"{L}.attn.probs"), writes=(D(f"{L}.attn.scores"),))
    _gemm(b, f"{L}.attn.bwd.dq", bh * s, d, s, "NN", f, ACT_BYTES * (e + 2 * qk), (D(f"{L}.attn.scores"), attn_in),
          (D(f"{L}.attn.q"),))
    _gemm(b, f"{L}.attn.bwd.dk", bh * s, d, s, "TN", f, ACT_BYTES * (e + 2 * qk), (D(f"{L}.attn.scores"), attn_in),
          (D(attn_in),))


def dropout_add(blk, name: str, buf: str) -> None:
    """Megatron-LM's fused bias, dropout and residual add after a row-parallel linear (on the whole
    hidden state, the same on every tensor-parallel rank): reads the output and the residual, writes
    the sum and the dropout mask."""
    b = blk.b
    e = blk.m * blk.h
    b.compute(f"{name}.{b.phase}.dropout_add", "elementwise", flops=3.0 * e, bytes=(3 * ACT_BYTES + MASK_BYTES) * e,
              replicas=blk.gy, role="bias_dropout_add", reads=(buf,), writes=(buf,))


def dropout_add_bwd(blk, name: str, dbuf: str) -> None:
    """The backward of `dropout_add`: the gradient through the dropout mask (the residual's passes as is)."""
    b = blk.b
    e = blk.m * blk.h
    b.compute(f"{name}.bwd.dropout_add", "elementwise", flops=1.0 * e, bytes=(2 * ACT_BYTES + MASK_BYTES) * e,
              replicas=blk.gy, role="bias_dropout_add_bwd", reads=(dbuf,), writes=(dbuf,))


# -- sequence parallelism with selective recomputation (Korthikanti et al. 2022): framework "megatron-sp" ----------
# The residual stream, its layer norms and dropouts are split by sequence over the t GPUs (m/t tokens
# each); a column-parallel layer all-gathers its input over y first, a row-parallel layer
# reduce-scatters its output over y instead of all-reducing it. The backward re-gathers a
# column-parallel layer's input for its weight gradient (issued with the input-gradient GEMM, as the
# 2022 code overlaps it) and reduce-scatters the input gradient behind the weight-gradient GEMM.
# Selective recomputation: only the attention core (QK^T, softmax, dropout, context) is recomputed
# in the backward, not the linears or the norms.


def _seq_elementwise(blk, name: str, role: str, flops: float, nbytes_per: float, reads, writes) -> None:
    b = blk.b
    e = blk.m * blk.h // blk.gy  # this rank's m/t tokens of the residual stream
    b.compute(name, "elementwise", flops=flops * e, bytes=int(nbytes_per * e), role=role, reads=tuple(reads),
              writes=tuple(writes))


def _gather(blk, name: str, buf: str) -> None:
    """All-gather buffer `buf` (m/t tokens) over y into the whole sequence; the current activation."""
    b = blk.b
    ag = b.collective(name, "all_gather", "y", ACT_BYTES * blk.m * blk.h, deps=[b.ready], reads=(buf,), writes=(buf,))
    b.ready = ag if ag is not None else b.ready


def sp_fwd(blk, i: int) -> None:
    """Block i's forward with sequence parallelism (its phase: fwd)."""
    b, model, m, h, t = blk.b, blk.model, blk.m, blk.h, blk.gy
    L, io = f"L{i}", blk.io(i)
    ph = b.phase
    f = model.ffn
    _seq_elementwise(blk, f"{L}.ln1.{ph}", "layer_norm", 8, 2 * ACT_BYTES, (io["x"],), (io["qkv"],))
    _gather(blk, f"{L}.ln1.{ph}.ag_y", io["qkv"])
    b.gemm(f"{L}.qkv.{ph}.gemm", m, 3 * h // t, h, "NN", io["qkv"], W(f"{L}.qkv"), io["attn_in"], weight=f"{L}.qkv")
    attention_fwd(blk, L, io["attn_in"], io["attn_out"])
    _row_parallel_fwd(blk, f"{L}.attn_out", m, h, h // t, io["attn_out"], io["mid"], io["x"])
    _seq_elementwise(blk, f"{L}.ln2.{ph}", "layer_norm", 8, 2 * ACT_BYTES, (io["mid"],), (io["mlp_up"],))
    _gather(blk, f"{L}.ln2.{ph}.ag_y", io["mlp_up"])
    b.gemm(f"{L}.mlp_up.{ph}.gemm", m, f // t, h, "NN", io["mlp_up"], W(f"{L}.mlp_up"), f"{L}.mlp_up.out",
           weight=f"{L}.mlp_up")
    b.elementwise(f"{L}.gelu.{ph}", m * f // t, 8, 2, role="gelu", reads=(f"{L}.mlp_up.out",),
                  writes=(io["mlp_down"], f"{L}.gelu.ctx"))
    _row_parallel_fwd(blk, f"{L}.mlp_down", m, h, f // t, io["mlp_down"], io["out"], io["mid"])


def _row_parallel_fwd(blk, lname: str, m: int, n: int, k: int, inp: str, out: str, residual: str) -> None:
    """A row-parallel linear: the GEMM, the reduce-scatter of its output over y, bias-dropout-add."""
    b = blk.b
    b.gemm(f"{lname}.{b.phase}.gemm", m, n, k, "NN", inp, W(lname), f"{lname}.out", weight=lname)
    rs = b.collective(f"{lname}.{b.phase}.rs_y", "reduce_scatter", "y", ACT_BYTES * m * n, deps=[b.ready],
                      reads=(f"{lname}.out",), writes=(out,))
    b.ready = rs if rs is not None else b.ready
    _seq_elementwise(blk, f"{lname}.{b.phase}.dropout_add", "bias_dropout_add", 3, 3 * ACT_BYTES + MASK_BYTES,
                     (out, residual), (out,))


def _column_parallel_bwd(blk, lname: str, m: int, n: int, k: int, inp: str, dout: str, dinp: str) -> None:
    """A column-parallel linear's backward: the input re-gathered over y (with the dgrad GEMM), dgrad,
    the reduce-scatter of the input gradient over y behind the wgrad GEMM."""
    b = blk.b
    start = b.ready
    ag = b.collective(f"{lname}.bwd.ag_y", "all_gather", "y", ACT_BYTES * m * k, deps=[start], reads=(inp,),
                      writes=(inp,))
    dgrad = b.gemm(f"{lname}.bwd.dgrad", m, k, n, "NT", dout, W(lname), dinp, weight=lname)
    rs = b.collective(f"{lname}.bwd.rs_y", "reduce_scatter", "y", ACT_BYTES * m * k, deps=[dgrad], reads=(dinp,),
                      writes=(dinp,))
    wgrad = b.gemm(f"{lname}.bwd.wgrad", k, n, m, "TN", inp, dout, f"g:{lname}", deps=[ag], weight=lname)
    b.ops[wgrad] = dataclasses.replace(b.ops[wgrad], accumulate=lname)
    b.last_rs[lname] = wgrad
    b.ready = rs if rs is not None else wgrad


def _row_parallel_bwd(blk, lname: str, m: int, n: int, k: int, inp: str, dout: str, dinp: str) -> None:
    """A row-parallel linear's backward: the output gradient gathered over y, dgrad, wgrad."""
    b = blk.b
    _gather(blk, f"{lname}.bwd.ag_y", dout)
    b.gemm(f"{lname}.bwd.dgrad", m, k, n, "NT", dout, W(lname), dinp, weight=lname)
    wgrad = b.gemm(f"{lname}.bwd.wgrad", k, n, m, "TN", inp, dout, f"g:{lname}", weight=lname)
    b.ops[wgrad] = dataclasses.replace(b.ops[wgrad], accumulate=lname)
    b.last_rs[lname] = wgrad
    b.ready = wgrad


def sp_bwd(blk, i: int) -> None:
    """Block i's backward with sequence parallelism and selective recomputation of the attention core."""
    b, model, m, h, t = blk.b, blk.model, blk.m, blk.h, blk.gy
    L, io = f"L{i}", blk.io(i)
    f = model.ffn
    _seq_elementwise(blk, f"{L}.mlp_down.bwd.dropout_add", "bias_dropout_add_bwd", 1, 2 * ACT_BYTES + MASK_BYTES,
                     (D(io["out"]),), (D(io["out"]),))
    _row_parallel_bwd(blk, f"{L}.mlp_down", m, h, f // t, io["mlp_down"], D(io["out"]), D(io["mlp_down"]))
    b.elementwise(f"{L}.gelu.bwd", m * f // t, 8, 3, role="gelu_bwd", reads=(D(io["mlp_down"]), f"{L}.gelu.ctx"),
                  writes=(D(f"{L}.mlp_up.out"),))
    _column_parallel_bwd(blk, f"{L}.mlp_up", m, f // t, h, io["mlp_up"], D(f"{L}.mlp_up.out"), D(io["mlp_up"]))
    _seq_elementwise(blk, f"{L}.ln2.bwd", "layer_norm_bwd", 12, 4 * ACT_BYTES, (D(io["mlp_up"]), D(io["out"])),
                     (D(io["mid"]),))
    _seq_elementwise(blk, f"{L}.attn_out.bwd.dropout_add", "bias_dropout_add_bwd", 1, 2 * ACT_BYTES + MASK_BYTES,
                     (D(io["mid"]),), (D(io["mid"]),))
    _row_parallel_bwd(blk, f"{L}.attn_out", m, h, h // t, io["attn_out"], D(io["mid"]), D(io["attn_out"]))
    ph = b.phase
    b.phase = "rec"  # selective recomputation: the attention core alone
    attention_fwd(blk, L, io["attn_in"], io["attn_out"])
    b.phase = ph
    attention_bwd(blk, L, io["attn_in"], io["attn_out"])
    _column_parallel_bwd(blk, f"{L}.qkv", m, 3 * h // t, h, io["qkv"], D(io["attn_in"]), D(io["qkv"]))
    _seq_elementwise(blk, f"{L}.ln1.bwd", "layer_norm_bwd", 12, 4 * ACT_BYTES, (D(io["qkv"]), D(io["mid"])),
                     (D(io["x"]),))
