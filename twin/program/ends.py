"""The ops around the blocks, appended to a Builder (twin/program/ops.py): the embedding, the final
norm, the head and the loss (forward and backward), the end-of-step gradient reductions and the
optimizer. twin/program/program.py strings them around every block of one rank; a pipeline stage
(twin/program/pipeline.py) adds only the ends its model chunks hold. Names and buffers:
twin/program/program.py.
"""

from __future__ import annotations

import math

from twin.program.blocks import Blocks
from twin.program.ops import (ACT_BYTES, ADAMW_BYTES_PER_PARAM, ADAMW_FLOPS_PER_PARAM, GRAD_AR_BYTES, STAT_BYTES,
                              Builder, embedding_dims, grad_buffer as D, linear_dims, weight_buffer as W)


class Ends:
    """Appends the step's ops outside the blocks to builder `b`; `blk` appends a block's."""

    def __init__(self, b: Builder, blk: Blocks):
        model, grid = b.model, b.grid
        self.b, self.blk, self.model, self.grid, self.options = b, blk, model, grid, b.opt
        self.llama = model.is_llama
        h, V, s = model.hidden, b.vocab, b.seq_len
        self.wte_bytes = ACT_BYTES * math.prod(embedding_dims(grid, V, h))  # the head's bytes too (tied or not)
        self.emb_bytes = self.wte_bytes + (0 if self.llama else ACT_BYTES * math.prod(embedding_dims(grid, s, h)))
        self.wbytes = {ln: ACT_BYTES * math.prod(linear_dims(grid, k, n, t)[:2])
                       for ln, k, n, t in model.linear_shapes()}
        if model.is_moe:  # an MoE block's expert linears: the rank's experts stacked (twin/program/moe.py)
            from twin.program.moe import local_experts
            e = local_experts(model, grid)
            self.wbytes.update(expert_up=e * self.wbytes["mlp_up"], expert_down=e * self.wbytes["mlp_down"])

    def linears(self, i: int) -> list:
        """The linear layers of block i (an MoE block's expert linears in place of its MLP's)."""
        if not self.model.is_moe:
            return self.model.linear_shapes()
        from twin.program.moe import layer_linears
        return layer_linears(self.model, i)

    # -- the gather order of a pass ----------------------------------------------------------------
    def fwd_order(self, layers, first_mb: bool, emb: bool = True, head: bool = True) -> list[tuple[str, str, int]]:
        """Gather visits of a forward pass over blocks `layers` (with the embedding and the head)."""
        cache = self.options.cache_layers
        order = [("emb", "emb.fwd.ag_z", self.emb_bytes)] if emb else []
        for i in layers:
            if not (i < cache and not first_mb):
                order += [(f"L{i}.{ln}", f"L{i}.{ln}.fwd.ag_z", self.wbytes[ln])
                          for ln, _, _, _ in self.linears(i)]
        return order + ([("head", "head.fwd.ag_z", self.wte_bytes)] if head else [])

    def bwd_order(self, layers, head: bool = True) -> list[tuple[str, str, int]]:
        """Gather visits of a backward pass over blocks `layers` (descending), after the head's."""
        order = [("head", "head.bwd.ag_z", self.wte_bytes)] if head else []
        for i in layers:
            if i < self.options.cache_layers:
                continue
            linears = self.linears(i)
            lin = linears if self.options.recompute else linears[::-1]
            order += [(f"L{i}.{ln}", f"L{i}.{ln}.bwd.ag_z", self.wbytes[ln]) for ln, _, _, _ in lin]
        return order

    # -- forward -----------------------------------------------------------------------------------
    def emb_fwd(self) -> None:
        """The embedding of the micro-batch's tokens into x:L0."""
        b, m, h, gx = self.b, self.b.tokens, self.model.hidden, self.grid.x
        ag = b.gather("emb")
        b.main(b.compute("emb.fwd", "embedding", deps=[ag], flops=float(m * h // gx),
                         bytes=ACT_BYTES * 3 * m * h // gx, role="embedding", weight="emb",
                         reads=("tokens", W("emb")), writes=("emb.out",)))
        b.allreduce_ready("emb.fwd.ar_y", "y", ACT_BYTES * m * h // gx, "emb.out", "x:L0")

    def head_fwd(self) -> None:
        """The final norm of x:L<layers>, the head and the loss's forward."""
        b, model, grid, options = self.b, self.model, self.grid, self.options
        m, V, h, gx, gy = b.tokens, b.vocab, model.hidden, grid.x, grid.y
        self.blk.norm("lnf", f"x:L{model.layers}", "lnf.out")
        ag = b.gather("head")
        b.main(b.gemm("head.fwd.gemm", m, V // gy, h // gx, "NT", "lnf.out", W("head"), "head.out", deps=[ag],
                      weight="head"))
        b.allreduce_ready("head.fwd.ar_x", "x", ACT_BYTES * m * V // gy, "head.out", "logits")
        if options.goldfish_h:  # the goldfish mask: integer hashing of h ids per target, no flops; the
            # data loader applies it to the targets (backend.training.goldfish), the loss still runs over every token
            b.compute("loss.fwd.mask", "elementwise", flops=0.0, bytes=8 * 2 * m, replicas=gx * gy,
                      role="goldfish_mask", reads=("targets",))
        local_sums = grid.y == 1  # nothing to reduce over y: the loss's sums are this rank's own
        b.compute("loss.fwd", "loss", flops=5.0 * m * V / gy, bytes=4 * m * V // gy, replicas=gx, role="loss",
                  reads=("logits", "targets"), writes=("loss.max",) + (("loss.sums",) if local_sums else ()))
        b.allreduce_ready("loss.fwd.ar_y_max", "y", STAT_BYTES * m, "loss.max", role="max")
        ar = b.collective("loss.fwd.ar_y_sum", "all_reduce", "y", STAT_BYTES * 2 * m, deps=[b.ready],
                          role="loss_sums", reads=("logits", "loss.max", "targets"), writes=("loss.sums",))
        b.ready = ar if ar is not None else b.ready

    # -- backward ----------------------------------------------------------------------------------
    def head_bwd(self) -> None:
        """The loss's backward, the head's (dgrad, wgrad, reduce-scatter) and the final norm's, into
        d:x:L<layers>."""
        b, model, grid, options = self.b, self.model, self.grid, self.options
        m, V, h, gx, gy = b.tokens, b.vocab, model.hidden, grid.x, grid.y
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
        self.blk.norm_bwd("lnf", D("lnf.out"), D(f"x:L{model.layers}"))

    def blocks_bwd(self, layers) -> None:
        """Blocks `layers` (descending) backward, each after its recomputed forward."""
        b, blk = self.b, self.blk
        for i in layers:
            if self.options.recompute:
                b.phase = "rec"
                blk.fwd(i)
                b.phase = "bwd"
            blk.bwd(i)

    def emb_bwd(self) -> None:
        """The embedding's weight gradient from d:x:L0, and its reduce-scatter."""
        b, m, h, gx = self.b, self.b.tokens, self.model.hidden, self.grid.x
        b.compute("emb.bwd", "embedding", flops=float(m * h // gx), bytes=ACT_BYTES * 3 * m * h // gx,
                  role="embedding_bwd", weight="emb", reads=(D("x:L0"), "tokens"), writes=("g:emb",))
        b.reduce_scatter("emb", "emb.bwd.rs_z", self.emb_bytes, b.ready)

    # -- the end of the step -------------------------------------------------------------------------
    def grad_reductions(self, layers, tied: list[str], after: dict[str, list[int]] | None = None,
                        norm_params: int | None = None) -> list[int | None]:
        """The data all-reduces of the gradient shards of blocks `layers` and of the tables in `tied`
        (each entry "emb" or "head": a GPT's emb waits for both, its head's gradients accumulate into
        emb's), after the backward pass (a table's also after the ops `after[table]`); then the norms'
        z and data all-reduces
        (`norm_params`: the norms' parameters of this rank, default every norm's). Returns the
        all-reduces (None where an axis has size 1)."""
        b, model, grid = self.b, self.model, self.grid
        b.prefix, b.mb, b.phase = "", -1, "grad"
        grad_ar = []
        P = grid.tensor_size
        end = b.ready
        params = grad_params(model, b.vocab, b.seq_len)
        for i in layers:
            for ln, k, n, _ in self.linears(i):
                key = f"L{i}.{ln}"
                if ln.startswith("expert_"):  # over the edata group (twin/program/moe.py)
                    grad_ar.append(self.blk.moe.grad_reduction(key, k, n, [b.last_rs[key], end]))
                    continue
                grad_ar.append(b.collective(f"{key}.grad.ar_data", "all_reduce", "data",
                                            GRAD_AR_BYTES * params[key] // P, deps=[b.last_rs[key], end],
                                            role="grad", weight=key))
        for key in tied:
            waits = [b.last_rs.get(k) for k in (("emb", "head") if key == "emb" and not self.llama else (key,))]
            grad_ar.append(b.collective(f"{key}.grad.ar_data", "all_reduce", "data", GRAD_AR_BYTES * params[key] // P,
                                        deps=[*waits, end, *(after or {}).get(key, ())], role="grad", weight=key))
        if model.is_moe:
            grad_ar += self.blk.moe.router_reductions(layers)
        if norm_params is None:
            norm_params = (model.layers * model.norm_params_per_layer + model.final_norm_params) // grid.x
        nz = b.collective("norms.grad.ar_z", "all_reduce", "z", STAT_BYTES * norm_params, deps=[b.ready],
                          role="grad", weight="norms")
        grad_ar.append(b.collective("norms.grad.ar_data", "all_reduce", "data", STAT_BYTES * norm_params,
                                    deps=[nz if nz is not None else b.ready], role="grad", weight="norms"))
        return grad_ar

    def optimizer(self, grad_ar: list, n_local: int, pipe=None) -> None:
        """Clipping (the global norm all-reduced over x, y, z, and the stages: `pipe(deps)` appends that
        all-reduce) and AdamW on `n_local` parameters."""
        b = self.b
        sizes = optimizer_sizes(n_local)
        b.phase = "opt"
        clip = ()
        if self.options.grad_clip:
            b.compute("opt.norm", "elementwise", deps=grad_ar, role="grad_norm", writes=("opt.norm",),
                      **sizes["grad_norm"])
            for axis in ("x", "y", "z"):
                b.allreduce_ready(f"opt.clip.ar_{axis}", axis, STAT_BYTES, "opt.norm")
            if self.model.is_moe:
                self.blk.moe.clip_expert()
            if pipe is not None:
                b.ready = pipe([b.ready])
            grad_ar, clip = [], ("opt.norm",)
        b.compute("opt.step", "optimizer", deps=grad_ar, role="adamw", reads=clip, **sizes["adamw"])


def grad_params(model, vocab: int, seq_len: int) -> dict[str, int]:
    """Parameters of each weight whose gradient shards are all-reduced over data (a GPT's `emb`: its
    token and position tables, which the head shares; a Llama's `emb` and `head` apart)."""
    params = {f"L{i}.{ln}": k * n for i in range(model.layers) for ln, k, n, _ in model.linear_shapes()}
    params["emb"] = params["head"] = vocab * model.hidden  # a GPT's head: the copy a last pipeline stage keeps
    if not model.is_llama:
        params["emb"] = (vocab + seq_len) * model.hidden
    return params


def optimizer_sizes(n_local: int) -> dict[str, dict]:
    """Flops and bytes of the optimizer's compute ops (by role) for `n_local` parameters on a rank."""
    return {"grad_norm": {"flops": 2.0 * n_local, "bytes": GRAD_AR_BYTES * n_local},
            "adamw": {"flops": float(ADAMW_FLOPS_PER_PARAM * n_local), "bytes": ADAMW_BYTES_PER_PARAM * n_local}}
