"""The ops of one transformer block, GPT or Llama, appended to a Builder (twin/program/ops.py): the block's
forward (or recomputed forward) and backward, its norms and its four linear layers.

A GPT block: layer norm, qkv, attention, attn_out (+ residual), layer norm, mlp_up, GELU, mlp_down
(+ residual). A Llama block: RMSNorm, qkv, RoPE, attention over grouped-query heads, attn_out,
RMSNorm, mlp_up (gate and up fused), SwiGLU, mlp_down. Names, buffers and sharding: twin/program/program.py.
"""

from __future__ import annotations

from twin.program.ops import ACT_BYTES, STAT_BYTES, Builder, grad_buffer as D, linear_dims, weight_buffer as W


class Blocks:
    """Appends the ops of block i's passes to builder `b` (its current phase names the pass)."""

    def __init__(self, b: Builder):
        model, grid = b.model, b.grid
        self.b, self.model, self.grid, self.options = b, model, grid, b.opt
        self.llama = model.is_llama
        self.m, self.h, self.gx, self.gy, self.s = b.tokens, model.hidden, grid.x, grid.y, b.seq_len
        # each linear's shard (k_local, n_local, in_axis, out_axis), the same in every block
        self.lin = {ln: linear_dims(grid, k, n, t) for ln, k, n, t in model.linear_shapes()}
        self.qkv_local, self.f_local = model.qkv_width // grid.y, model.ffn // grid.y
        self.rope_width = (model.heads + model.n_kv_heads) * model.head_dim // grid.y  # rotated q and k features
        if model.is_moe:  # mixture-of-experts blocks in place of some MLPs (twin/program/moe.py)
            from twin.program.moe import MoE
            self.moe = MoE(b, self)

    # -- norms: statistics all-reduced over x (the features of the residual stream) ----------------
    def norm(self, name: str, inp: str, out: str) -> None:
        """Layer norm (GPT) or RMSNorm (Llama) of buffer `inp` into `out`."""
        b, m = self.b, self.m
        stats_role, stats, flops = ("rms_stats", 1, 4) if self.llama else ("ln_stats", 2, 8)
        ar = b.collective(f"{name}.{b.phase}.ar_x", "all_reduce", "x", STAT_BYTES * stats * m, deps=[b.ready],
                          role=stats_role, reads=(inp,), writes=(f"{name}.stats",))
        b.ready = ar if ar is not None else b.ready
        reads = (inp, f"{name}.stats") if ar is not None else (inp,)
        b.elementwise(f"{name}.{b.phase}", m * self.h // self.gx, flops, 2,
                      role="rms_norm" if self.llama else "layer_norm", weight=name, reads=reads,
                      writes=(out, f"{name}.ctx"))

    def norm_bwd(self, name: str, dout: str, dinp: str, add: str = "") -> None:
        """Input gradient `dinp` (+ buffer `add`) of a norm; its parameters' gradients."""
        b, m = self.b, self.m
        role, stats, flops = ("rms_grad_stats", 1, 8) if self.llama else ("ln_grad_stats", 2, 12)
        ar = b.collective(f"{name}.bwd.ar_x", "all_reduce", "x", STAT_BYTES * stats * m, deps=[b.ready],
                          role=role, weight=name, reads=(dout, f"{name}.ctx"), writes=(f"{name}.grad_stats",))
        b.ready = ar if ar is not None else b.ready
        reads = (dout, f"{name}.ctx") + ((f"{name}.grad_stats",) if ar is not None else ())
        b.elementwise(f"{name}.bwd", m * self.h // self.gx, flops, 4,
                      role="rms_norm_bwd" if self.llama else "layer_norm_bwd", weight=name, reads=reads,
                      writes=(dinp,), add=add)

    # -- linear layers ------------------------------------------------------------------------------
    def linear_fwd(self, lname: str, dims: tuple, inp: str, out: str, add: str = "") -> None:
        """Forward GEMM of linear `lname` whose shard is `dims` (linear_dims), its input all-reduce."""
        b, m = self.b, self.m
        kl, nl, in_axis, _ = dims
        ag = b.gather(lname)
        b.main(b.gemm(f"{lname}.{b.phase}.gemm", m, nl, kl, "NN", inp, W(lname), f"{lname}.out", deps=[ag],
                      weight=lname))
        b.allreduce_ready(f"{lname}.{b.phase}.ar_{in_axis}", in_axis, ACT_BYTES * m * nl, f"{lname}.out", out, add)

    def linear_bwd(self, lname: str, dims: tuple, inp: str, dout: str, dinp: str, gathered: bool) -> None:
        """dgrad (dinp = dout W^T, all-reduced), wgrad (inp^T dout), reduce-scatter of the latter."""
        b, m = self.b, self.m
        kl, nl, _, out_axis = dims
        ag = None if gathered else b.gather(lname)
        dgrad = b.gemm(f"{lname}.bwd.dgrad", m, kl, nl, "NT", dout, W(lname), dinp, deps=[ag], weight=lname)
        if not gathered:
            b.main(dgrad)
        grad_ready = b.ready
        ar = b.collective(f"{lname}.bwd.ar_{out_axis}", "all_reduce", out_axis, ACT_BYTES * m * kl,
                          deps=[dgrad], reads=(dinp,), writes=(dinp,))
        wgrad = b.gemm(f"{lname}.bwd.wgrad", kl, nl, m, "TN", inp, dout, f"g:{lname}",
                       deps=[] if self.options.oar else [ar], weight=lname)
        b.reduce_scatter(lname, f"{lname}.bwd.rs_z", ACT_BYTES * kl * nl, wgrad)
        b.ready = ar if ar is not None else grad_ready

    # -- the block ----------------------------------------------------------------------------------
    def io(self, i: int) -> dict[str, str]:
        """Buffers of block i: its input, the residual after attention, the inputs of its linears."""
        L = f"L{i}"
        act = "swiglu" if self.llama else "gelu"
        return {"x": f"x:{L}", "mid": f"{L}.mid", "out": f"x:L{i + 1}", "qkv": f"{L}.ln1.out",
                "attn_out": f"{L}.attn.out", "mlp_up": f"{L}.ln2.out", "mlp_down": f"{L}.{act}.out",
                "attn_in": f"{L}.rope.out" if self.llama else f"{L}.qkv.out"}

    def fwd(self, i: int) -> None:
        """Block i's forward ops (the recomputed forward when the builder's phase is `rec`)."""
        b, model, lin, m, s, gx, gy = self.b, self.model, self.lin, self.m, self.s, self.gx, self.gy
        L, io = f"L{i}", self.io(i)
        self.norm(f"{L}.ln1", io["x"], io["qkv"])
        self.linear_fwd(f"{L}.qkv", lin["qkv"], io["qkv"], f"{L}.qkv.out")
        if self.llama:  # rotary embeddings of q and k: 2 multiplies and an add per element
            b.elementwise(f"{L}.rope.{b.phase}", m * self.rope_width, 3, 2, replicas=gx, role="rope", n=s,
                          k=model.head_dim, reads=(f"{L}.qkv.out",), writes=(io["attn_in"],))
        b.compute(f"{L}.attn.{b.phase}", "attention", flops=4.0 * b.seqs * s * s * self.h / gy,
                  bytes=ACT_BYTES * m * (self.qkv_local + self.h // gy), m=b.seqs * (model.heads // gy), n=s,
                  k=model.head_dim, replicas=gx, role="attention", reads=(io["attn_in"],),
                  writes=(io["attn_out"], f"{L}.attn.ctx"))
        self.linear_fwd(f"{L}.attn_out", lin["attn_out"], io["attn_out"], io["mid"], add=io["x"])
        if model.moe_layer(i):
            self.moe.fwd(i)
            return
        self.norm(f"{L}.ln2", io["mid"], io["mlp_up"])
        self.linear_fwd(f"{L}.mlp_up", lin["mlp_up"], io["mlp_up"], f"{L}.mlp_up.out")
        if self.llama:  # silu(gate) * up: reads gate and up, writes the product
            b.elementwise(f"{L}.swiglu.{b.phase}", m * self.f_local, 6, 3, replicas=gx, role="swiglu",
                          reads=(f"{L}.mlp_up.out",), writes=(io["mlp_down"], f"{L}.swiglu.ctx"))
        else:
            b.elementwise(f"{L}.gelu.{b.phase}", m * model.ffn // gy, 8, 2, replicas=gx, role="gelu",
                          reads=(f"{L}.mlp_up.out",), writes=(io["mlp_down"], f"{L}.gelu.ctx"))
        self.linear_fwd(f"{L}.mlp_down", lin["mlp_down"], io["mlp_down"], io["out"], add=io["mid"])

    def bwd(self, i: int) -> None:
        """Block i's backward ops (after its recomputed forward, with recomputation)."""
        b, model, lin, m, s, gx, gy = self.b, self.model, self.lin, self.m, self.s, self.gx, self.gy
        L, io = f"L{i}", self.io(i)
        gathered = self.options.recompute  # with recomputation the backward reuses the recompute's gather
        if model.moe_layer(i):
            self.moe.bwd(i)
        else:
            self.linear_bwd(f"{L}.mlp_down", lin["mlp_down"], io["mlp_down"], D(io["out"]), D(io["mlp_down"]), gathered)
            if self.llama:
                b.elementwise(f"{L}.swiglu.bwd", m * self.f_local, 10, 5, replicas=gx, role="swiglu_bwd",
                              reads=(D(io["mlp_down"]), f"{L}.swiglu.ctx"), writes=(D(f"{L}.mlp_up.out"),))
            else:
                b.elementwise(f"{L}.gelu.bwd", m * model.ffn // gy, 8, 3, replicas=gx, role="gelu_bwd",
                              reads=(D(io["mlp_down"]), f"{L}.gelu.ctx"), writes=(D(f"{L}.mlp_up.out"),))
            self.linear_bwd(f"{L}.mlp_up", lin["mlp_up"], io["mlp_up"], D(f"{L}.mlp_up.out"), D(io["mlp_up"]), gathered)
            self.norm_bwd(f"{L}.ln2", D(io["mlp_up"]), D(io["mid"]), add=D(io["out"]))
        self.linear_bwd(f"{L}.attn_out", lin["attn_out"], io["attn_out"], D(io["mid"]), D(io["attn_out"]), gathered)
        b.compute(f"{L}.attn.bwd", "attention", flops=8.0 * b.seqs * s * s * self.h / gy,
                  bytes=ACT_BYTES * 2 * m * (self.qkv_local + self.h // gy), m=b.seqs * (model.heads // gy), n=s,
                  k=model.head_dim, replicas=gx, role="attention_bwd", reads=(D(io["attn_out"]), f"{L}.attn.ctx"),
                  writes=(D(io["attn_in"]),))
        if self.llama:  # the inverse rotation
            b.elementwise(f"{L}.rope.bwd", m * self.rope_width, 3, 2, replicas=gx, role="rope_bwd", n=s,
                          k=model.head_dim, reads=(D(io["attn_in"]),), writes=(D(f"{L}.qkv.out"),))
        self.linear_bwd(f"{L}.qkv", lin["qkv"], io["qkv"], D(f"{L}.qkv.out"), D(io["qkv"]), gathered)
        self.norm_bwd(f"{L}.ln1", D(io["qkv"]), D(io["x"]), add=D(io["mid"]))
