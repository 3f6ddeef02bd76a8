"""The ops of a mixture-of-experts block (in place of the MLP of layer i when model.moe_layer(i)),
appended to a Builder (twin/program/ops.py) by twin/program/blocks.py. The contract with the backend
is written out in docs/moe.md; in short:

Layout. The residual stream is as in a dense block: a rank's m tokens (its sequences of the
micro-batch, split over z and data), features split over x, replicated over y. Each expert is split by
the tensor axes as the dense MLP is (3D, AxoNN): expert_up a normal layer (h/G_x in, 2f/G_y or f/G_y
out, output all-reduced over x), expert_down a transposed one (f/G_y in, h/G_x out, all-reduced over
y), their weights (the rank's E/E_p experts stacked, `L<i>.expert_up`, `L<i>.expert_down`) sharded
again over z and gathered before use. The router (`L<i>.router`, h x E, no bias) is split over x only
(h/G_x x E on every rank of a y and z group), not sharded over z; its gradient is all-reduced over z
and data at the end of the step with every router's (`routers.grad.ar_z`, `routers.grad.ar_data`).

Forward of block i (pass `fwd` or `rec`; dense ops as in twin/program/blocks.py):
  ln2 -> router.gemm [m x E x h/G_x] -> router.ar_x -> router.topk (softmax fp32, top-k, renormalise;
  writes probs, gates, idx and this rank's per-expert counts) -> moe.permute (the routed rows in
  expert order: R rows of h/G_x) -> moe.dispatch (all_to_all over the expert group) ->
  expert_up.gemm [R x n_up/G_y x h/G_x] (+ ag_z, ar_x) -> expert_swiglu|expert_gelu ->
  expert_down.gemm [R x h/G_x x f/G_y] (+ ag_z, ar_y) -> moe.combine (all_to_all back) ->
  moe.unpermute (weighted sum of each token's k rows, + residual) -> x:L<i+1>;
  then router.ar_z, router.ar_data: the per-expert counts summed over the micro-batch's tokens (for
  the load-balancing loss; the backward's router.topk waits for them).
Backward: moe.unpermute (d of the rows, and the gates' gradient partial over x) -> router.ar_x of the
gates' gradient, moe.combine (all_to_all) -> expert_down dgrad (+ ar_x), wgrad, rs_z -> activation
bwd -> expert_up dgrad (+ ar_y) -> moe.dispatch (all_to_all back to the tokens' ranks), overlapped
with expert_up wgrad (+ rs_z), router.topk bwd (with the aux loss's gradient), router.dgrad, router.wgrad
-> moe.permute bwd (scatter-add of the rows, + the router's input gradient) -> ln2 bwd.
End of step: expert weights' gradient shards all-reduced over the edata group (`.grad.ar_edata`);
clipping's norm also all-reduced over the expert group (`opt.clip.ar_expert`).

R, the rows a rank sends and its experts receive, balanced: m * top_k dropless; with a capacity
factor, E * ceil(cf * m * top_k / E) (buffers padded to capacity). The all-to-alls run on the data
stream (the expert group is a subgroup of the data axis), with axis "expert" (and "edata" for the
expert gradients); `bytes` is the rank's whole send buffer (balanced), of which (E_p - 1)/E_p leaves
the rank. With E_p = 1 there is no all-to-all: moe.permute writes moe.recv, the expert_down output is
moe.back. Routing is data dependent: the program carries the balanced sizes; the backend sends the
actual counts, the twin stretches expert time and the all-to-alls by an imbalance factor.
"""

from __future__ import annotations

import math

from twin.program.moe_spec import check_imbalance, local_experts, router_params, routed_rows, stretch
from twin.program.ops import (ACT_BYTES, GRAD_AR_BYTES, STAT_BYTES, Builder, grad_buffer as D, linear_dims,
                              weight_buffer as W)

EXPERT_AXES = ("expert", "edata")   # op.axis of the MoE collectives; they run on the data stream
EXPERT_LINEARS = ("expert_up", "expert_down")
ALL_TO_ALL = "all_to_all"


def stream_of(axis: str) -> str:
    """The stream a collective of `axis` runs on (the expert axes: the data axis's stream)."""
    return "data" if axis in EXPERT_AXES else axis


def layer_linears(model, i: int) -> list[tuple[str, int, int, bool]]:
    """The linear layers of block i as (name, k, n, transposed) for one expert: a dense block's four,
    or in an MoE block qkv, attn_out, expert_up, expert_down (the router is not a 3D-split linear)."""
    lin = model.linear_shapes()
    if not model.moe_layer(i):
        return lin
    return lin[:2] + [("expert_up",) + lin[2][1:], ("expert_down",) + lin[3][1:]]


def expert_grad_bytes(model, grid, ln: str, k: int, n: int) -> int:
    """Payload (bytes) of the edata all-reduce of an expert linear's gradient shards on one rank."""
    return GRAD_AR_BYTES * local_experts(model, grid) * k * n // grid.tensor_size


class MoE:
    """Appends an MoE block's ops to builder `b`; `blk` (twin.program.blocks.Blocks) appends the norms."""

    def __init__(self, b: Builder, blk):
        model, grid = b.model, b.grid
        self.b, self.blk, self.model, self.grid = b, blk, model, grid
        self.m, self.h, self.gx, self.gy, self.E, self.k = b.tokens, model.hidden, grid.x, grid.y, model.experts, model.top_k
        self.ep = grid.expert
        self.R = routed_rows(model, b.tokens)
        check_imbalance(model, b.opt.moe_imbalance)
        # rows on the side of the busiest expert's rank (the twin's imbalance; = R when balanced)
        self.Rx = math.ceil(self.R * stretch(model, local_experts(model, grid), b.opt.moe_imbalance) - 1e-9)
        lin = {ln: (k, n, t) for ln, k, n, t in model.linear_shapes()}
        self.up = linear_dims(grid, *lin["mlp_up"])
        self.down = linear_dims(grid, *lin["mlp_down"])
        self.n_local = local_experts(model, grid)
        self.act = "swiglu" if model.is_llama else "gelu"
        self.counts: dict[int, list[int]] = {}  # layer -> the ops the backward's router.topk waits for

    # -- helpers ------------------------------------------------------------------------------------
    def names(self, i: int) -> dict[str, str]:
        L = f"L{i}"
        a2a = self.ep > 1
        return {"in": f"{L}.ln2.out", "mid": f"{L}.mid", "out": f"x:L{i + 1}",
                "logits": f"{L}.router.logits", "probs": f"{L}.router.probs", "gates": f"{L}.router.gates",
                "idx": f"{L}.router.idx", "counts": f"{L}.router.counts", "dgates": f"{L}.router.dgates",
                "dx_router": f"{L}.router.dx",
                "send": f"{L}.moe.send" if a2a else f"{L}.moe.recv", "recv": f"{L}.moe.recv",
                "up": f"{L}.expert_up.out", "act": f"{L}.expert_{self.act}.out",
                "eout": f"{L}.moe.out" if a2a else f"{L}.moe.back", "back": f"{L}.moe.back"}

    def all_to_all(self, name: str, reads: str, writes: str, deps) -> int | None:
        """An all-to-all of the rank's routed rows (R x h/G_x) over the expert group (None when E_p = 1)."""
        if self.ep == 1:
            return None
        b = self.b
        return b._add(name, ALL_TO_ALL, "data", deps, {"bytes": int(ACT_BYTES * self.Rx * self.h // self.gx),
                                                      "axis": "expert", "role": "moe_rows",
                                                      "reads": (reads,), "writes": (writes,)})

    def expert_gemm(self, name: str, key: str, m: int, n: int, k: int, layout: str, a: str, bb: str, out: str,
                    deps=(), role: str = "grouped_gemm") -> int:
        """A grouped GEMM over the rank's local experts: rows stacked by expert (m in all), each expert
        its own weight; flops 2 m n k, bytes the rows in and out plus every local expert's weight."""
        if layout == "TN":  # a weight gradient: C (every local expert's) = A^T B over the m rows
            nbytes = k * m + k * n + self.n_local * m * n
        else:               # rows times the weight (k x n, or n x k transposed)
            nbytes = m * k + m * n + self.n_local * k * n
        return self.b._compute(name, "gemm", deps, {
            "flops": 2.0 * m * n * k, "bytes": ACT_BYTES * nbytes, "m": m, "n": n, "k": k,
            "layout": layout, "weight": key, "role": role, "reads": (a, bb), "writes": (out,)})

    # -- forward ------------------------------------------------------------------------------------
    def fwd(self, i: int) -> None:
        """Block i's MoE in place of the MLP: from buffer L<i>.mid (after ln2) to x:L<i+1>."""
        b, blk, n, m, h, gx, gy, E, R = self.b, self.blk, self.names(i), self.m, self.h, self.gx, self.gy, self.E, self.R
        L, ph = f"L{i}", b.phase
        blk.norm(f"{L}.ln2", n["mid"], n["in"])
        b._compute(f"{L}.router.{ph}.gemm", "gemm", (), {
            "flops": 2.0 * m * E * (h // gx), "bytes": ACT_BYTES * (m * h // gx + h // gx * E + m * E), "m": m, "n": E,
            "k": h // gx, "layout": "NN", "replicas": gy, "role": "router", "weight": f"{L}.router",
            "reads": (n["in"],), "writes": (n["logits"],)})
        b.allreduce_ready(f"{L}.router.{ph}.ar_x", "x", STAT_BYTES * m * E, n["logits"])
        topk = b.elementwise(f"{L}.router.{ph}.topk", m * E, 8, 2, replicas=gx * gy, role="router_topk",
                             weight=f"{L}.router", reads=(n["logits"],),
                             writes=(n["probs"], n["gates"], n["idx"], n["counts"]))
        b.elementwise(f"{L}.moe.{ph}.permute", R * h // gx, 0, 2, replicas=gy, role="moe_permute",
                      reads=(n["in"], n["idx"]), writes=(n["send"],))
        disp = self.all_to_all(f"{L}.moe.{ph}.dispatch", n["send"], n["recv"], [b.ready])
        b.ready = disp if disp is not None else b.ready
        self.expert_fwd(i, n)
        comb = self.all_to_all(f"{L}.moe.{ph}.combine", n["eout"], n["back"], [b.ready])
        b.ready = comb if comb is not None else b.ready
        b.elementwise(f"{L}.moe.{ph}.unpermute", m * self.k * h // gx, 2, 2, replicas=gy, role="moe_unpermute",
                      reads=(n["back"], n["gates"], n["idx"]), writes=(n["out"],), add=n["mid"])
        # the counts of the micro-batch's tokens (the load-balancing loss): off the critical path
        cz = b.collective(f"{L}.router.{ph}.ar_z", "all_reduce", "z", STAT_BYTES * E, deps=[topk],
                          role="expert_counts", reads=(n["counts"],), writes=(n["counts"],))
        cd = b.collective(f"{L}.router.{ph}.ar_data", "all_reduce", "data", STAT_BYTES * E,
                          deps=[cz if cz is not None else topk], role="expert_counts", reads=(n["counts"],),
                          writes=(n["counts"],))
        self.counts[i] = [c for c in (cz, cd) if c is not None]

    def expert_fwd(self, i: int, n: dict) -> None:
        b, R, L, ph = self.b, self.Rx, f"L{i}", self.b.phase
        kl, nl, in_axis, _ = self.up
        ag = b.gather(f"{L}.expert_up")
        b.main(self.expert_gemm(f"{L}.expert_up.{ph}.gemm", f"{L}.expert_up", R, nl, kl, "NN", n["recv"],
                                W(f"{L}.expert_up"), n["up"], deps=[ag]))
        b.allreduce_ready(f"{L}.expert_up.{ph}.ar_{in_axis}", in_axis, ACT_BYTES * R * nl, n["up"])
        f_local = self.model.ffn // self.gy
        if self.model.is_llama:
            b.elementwise(f"{L}.expert_swiglu.{ph}", R * f_local, 6, 3, replicas=self.gx, role="swiglu",
                          reads=(n["up"],), writes=(n["act"], f"{L}.expert_swiglu.ctx"))
        else:
            b.elementwise(f"{L}.expert_gelu.{ph}", R * f_local, 8, 2, replicas=self.gx, role="gelu",
                          reads=(n["up"],), writes=(n["act"], f"{L}.expert_gelu.ctx"))
        kl, nl, in_axis, _ = self.down
        ag = b.gather(f"{L}.expert_down")
        b.main(self.expert_gemm(f"{L}.expert_down.{ph}.gemm", f"{L}.expert_down", R, nl, kl, "NN", n["act"],
                                W(f"{L}.expert_down"), f"{L}.expert_down.out", deps=[ag]))
        b.allreduce_ready(f"{L}.expert_down.{ph}.ar_{in_axis}", in_axis, ACT_BYTES * R * nl,
                          f"{L}.expert_down.out", n["eout"])

    def _expert_dgrad(self, key: str, dims, grad: str, out: str, gathered: bool) -> tuple[int, int | None]:
        """An expert GEMM's data gradient (`grad` times the weight, into `out`; the weight gathered first
        unless the recomputation kept it) and its all-reduce over the output axis: (dgrad, the
        all-reduce or None)."""
        b, R = self.b, self.Rx
        kl, nl, _, out_axis = dims
        ag = None if gathered else b.gather(key)
        dgrad = self.expert_gemm(f"{key}.bwd.dgrad", key, R, kl, nl, "NT", D(grad), W(key), D(out), deps=[ag])
        if not gathered:
            b.main(dgrad)
        ar = b.collective(f"{key}.bwd.ar_{out_axis}", "all_reduce", out_axis, ACT_BYTES * R * kl, deps=[dgrad],
                          reads=(D(out),), writes=(D(out),))
        return dgrad, ar

    def _expert_wgrad(self, key: str, dims, inp: str, grad: str, ar: int | None) -> int:
        """An expert GEMM's weight gradient (its input `inp` against `grad`; after the data gradient's
        all-reduce unless that overlaps) and its reduce-scatter over z; returns the GEMM."""
        kl, nl = dims[0], dims[1]
        wgrad = self.expert_gemm(f"{key}.bwd.wgrad", key, kl, nl, self.Rx, "TN", inp, D(grad), f"g:{key}",
                                 deps=[] if self.b.opt.oar else [ar])
        self.b.reduce_scatter(key, f"{key}.bwd.rs_z", ACT_BYTES * self.n_local * kl * nl, wgrad)
        return wgrad

    # -- backward -----------------------------------------------------------------------------------
    def bwd(self, i: int) -> None:
        """Block i's MoE backward: from d:x:L<i+1> to d:L<i>.mid (ln2's backward included)."""
        b, blk, n, m, h, gx, gy, E, R = self.b, self.blk, self.names(i), self.m, self.h, self.gx, self.gy, self.E, self.R
        L = f"L{i}"
        gathered = b.opt.recompute
        R = self.Rx  # the rows on the experts' side
        unperm = b.elementwise(f"{L}.moe.bwd.unpermute", m * self.k * h // gx, 4, 3, replicas=gy,
                               role="moe_unpermute_bwd", reads=(D(n["out"]), n["back"], n["gates"], n["idx"]),
                               writes=(D(n["back"]), n["dgates"]))
        ar_g = b.collective(f"{L}.router.bwd.ar_x", "all_reduce", "x", STAT_BYTES * m * self.k, deps=[unperm],
                            role="gate_grad", reads=(n["dgates"],), writes=(n["dgates"],))
        comb = self.all_to_all(f"{L}.moe.bwd.combine", D(n["back"]), D(n["eout"]), [unperm])
        b.ready = comb if comb is not None else b.ready
        # expert_down (transposed: input f/G_y, output h/G_x)
        dgrad, ar = self._expert_dgrad(f"{L}.expert_down", self.down, n["eout"], n["act"], gathered)
        self._expert_wgrad(f"{L}.expert_down", self.down, n["act"], n["eout"], ar)
        b.ready = ar if ar is not None else dgrad
        f_local = self.model.ffn // gy
        act = "expert_swiglu" if self.model.is_llama else "expert_gelu"
        if self.model.is_llama:
            b.elementwise(f"{L}.{act}.bwd", R * f_local, 10, 5, replicas=gx, role="swiglu_bwd",
                          reads=(D(n["act"]), f"{L}.{act}.ctx"), writes=(D(n["up"]),))
        else:
            b.elementwise(f"{L}.{act}.bwd", R * f_local, 8, 3, replicas=gx, role="gelu_bwd",
                          reads=(D(n["act"]), f"{L}.{act}.ctx"), writes=(D(n["up"]),))
        # expert_up (normal: input h/G_x, output n_up/G_y), dgrad all-reduced over y; the dispatch's
        # all-to-all of the data gradient goes between its data and weight gradients
        dgrad, ar = self._expert_dgrad(f"{L}.expert_up", self.up, n["up"], n["recv"], gathered)
        disp = self.all_to_all(f"{L}.moe.bwd.dispatch", D(n["recv"]), D(n["send"]), [ar if ar is not None else dgrad])
        wgrad = self._expert_wgrad(f"{L}.expert_up", self.up, n["recv"], n["up"], ar)
        # the router's backward overlaps the dispatch's all-to-all
        b.ready = wgrad
        b.elementwise(f"{L}.router.bwd.topk", m * E, 10, 4, replicas=gx * gy, role="router_topk_bwd",
                      weight=f"{L}.router", reads=(n["dgates"], n["probs"], n["idx"], n["counts"]),
                      writes=(D(n["logits"]),))
        ops = b.ops
        topk = len(ops) - 1
        extra = [ar_g] + self.counts.get(i, [])
        b.ops[topk] = _with_deps(ops[topk], extra)
        b._compute(f"{L}.router.bwd.dgrad", "gemm", (), {
            "flops": 2.0 * m * (h // gx) * E, "bytes": ACT_BYTES * (m * E + h // gx * E + m * h // gx), "m": m,
            "n": h // gx, "k": E, "layout": "NT", "replicas": gy, "role": "router_dgrad", "weight": f"{L}.router",
            "reads": (D(n["logits"]),), "writes": (n["dx_router"],)})
        b._compute(f"{L}.router.bwd.wgrad", "gemm", (), {
            "flops": 2.0 * (h // gx) * E * m, "bytes": ACT_BYTES * (m * h // gx + m * E + h // gx * E), "m": h // gx,
            "n": E, "k": m, "layout": "TN", "replicas": gy, "role": "router_wgrad", "weight": f"{L}.router",
            "reads": (n["in"], D(n["logits"])), "writes": (f"g:{L}.router",), "accumulate": f"{L}.router"})
        b.elementwise(f"{L}.moe.bwd.permute", self.R * h // gx, 1, 2, replicas=gy, role="moe_permute_bwd",
                      reads=(D(n["send"]), n["idx"]), writes=(D(n["in"]),), add=n["dx_router"])
        if disp is not None:
            b.ops[-1] = _with_deps(b.ops[-1], [disp])
        blk.norm_bwd(f"{L}.ln2", D(n["in"]), D(n["mid"]), add=D(n["out"]))

    # -- end of step ----------------------------------------------------------------------------------
    def grad_reduction(self, key: str, k: int, n: int, deps) -> int | None:
        """The edata all-reduce of an expert linear's gradient shards (None when G_data / E_p = 1)."""
        if self.grid.edata == 1:
            return None
        return self.b._add(f"{key}.grad.ar_edata", "all_reduce", "data", deps, {
            "bytes": expert_grad_bytes(self.model, self.grid, key, k, n), "axis": "edata", "role": "grad",
            "weight": key})

    def router_reductions(self, layers) -> list[int | None]:
        """The z and data all-reduces of the routers' gradients of `layers` (after the backward)."""
        b = self.b
        nbytes = GRAD_AR_BYTES * router_params(self.model, self.grid, layers)
        if not nbytes:
            return []
        rz = b.collective("routers.grad.ar_z", "all_reduce", "z", nbytes, deps=[b.ready], role="grad", weight="routers")
        rd = b.collective("routers.grad.ar_data", "all_reduce", "data", nbytes, deps=[rz if rz is not None else b.ready],
                          role="grad", weight="routers")
        return [rd if rd is not None else rz]

    def clip_expert(self) -> None:
        """The clipping norm's all-reduce over the expert group (expert parameters differ across it)."""
        b = self.b
        if self.ep == 1:
            return
        b.ready = b._add("opt.clip.ar_expert", "all_reduce", "data", [b.ready], {
            "bytes": STAT_BYTES, "axis": "expert", "reads": ("opt.norm",), "writes": ("opt.norm",)})


def _with_deps(op, extra):
    from twin.program.ops import changed
    deps = tuple(sorted(set(op.deps) | {d for d in extra if d is not None}))
    return changed(op, deps=deps)
