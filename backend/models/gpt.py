"""The GPT of the 4D algorithm on one rank: its parameter shards, run by the program's executor
(backend.models.reference has the same GPT in one process, and the maps between the two).

GPT: learned token and position embeddings, `layers` pre-norm blocks (layer norm, causal attention,
layer norm, GELU MLP of width ffn), a final layer norm and a head tied to the token embedding; linear
layers without bias, layer norms with. The loss is the mean cross-entropy over all tokens of the
global batch. What runs, in which order and where, is the program's (twin/program/program.py); the weight
keys below are the ones its ops name (`weight`, `accumulate`).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from backend.runtime.dist import ParallelContext
from backend.runtime.executor import Executor
from backend.runtime.pipeline import make_executor
from backend.runtime.recorder import NULL_RECORDER, Recorder
from backend.runtime.moe import is_moe, moe_layer
from twin.program.grid import AXES
from twin.program.model import ModelSpec
from twin.program.moe import layer_linears
from twin.program.moe_spec import local_experts
from twin.program.program import (EMBEDDING_AXES, NORM_AXIS, Options, Program, build_program, embedding_dims,
                          linear_dims, weight_buffer)


class Params(nn.Module):
    """A plain holder of parameters (the names of the checkpoints' state dicts). Shared with
    backend.models.llama, which builds on this module's pieces."""


class GPT(nn.Module):
    """The 4D-parallel GPT on one rank. Parameters are this rank's fp32 shards.

    vocab: padded vocabulary (default spec.padded_vocab(G_y)). Initialization: N(0, 0.02) shards
    (backend.models.reference.load_from_reference for exact copies of a ReferenceGPT). tune_gemms: time the
    GEMM layouts once per shape and keep the fastest (default: on GPU only). program: the program to run (default:
    built from spec, grid and options for the batch of the first call). The position table has
    spec.seq_len rows: run a program of the same seq_len.
    """

    eps = 1e-5

    def __init__(self, spec: ModelSpec, ctx: ParallelContext, options: Options | None = None,
                 recorder: Recorder = NULL_RECORDER, vocab: int | None = None, seed: int = 0,
                 tune_gemms: bool | None = None, program: Program | None = None):
        super().__init__()
        self.spec, self.ctx = spec, ctx
        self.options = program.options if program is not None else options or Options()
        self.vocab = vocab or spec.padded_vocab(ctx.size("y"))
        self._make_parameters()
        gen = torch.Generator().manual_seed(seed * 1_000_003 + ctx.rank % ctx.grid.tensor_size)
        with torch.no_grad():
            for p in self.sharded_parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
            if is_moe(spec):  # experts differ over the expert group; a router is one over y, z and data
                gen.manual_seed(seed * 1_000_003 + ctx.rank % ctx.grid.tensor_size + 7_919 * (1 + ctx.coord("expert")))
                for p in expert_parameters(self):
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
                gen.manual_seed(seed * 1_000_003 + 104_729 + ctx.coord("x"))
                for p in self.keys["routers"]:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        self.buffers_of = {weight_buffer(k): k for k in self.keys}
        self._recorder, self._tune, self.program = recorder, tune_gemms, None
        self.executor: Executor | None = None
        self._others: dict[tuple[int, int], Executor] = {}  # executors of other batch shapes (one kept)
        if program is not None:
            self.use_program(program)

    def _make_parameters(self) -> None:
        """This rank's parameter shards (zeros; initialized by __init__) and `keys`: the program's
        weight keys -> parameters. `shapes`: linear weight key -> local (k, n) before the z-shard."""
        spec, ctx = self.spec, self.ctx
        grid, dev, gz, h = ctx.grid, ctx.device, ctx.size("z"), spec.hidden
        self.wte_shape = embedding_dims(grid, self.vocab, h)
        self.wpe_shape = embedding_dims(grid, spec.seq_len, h)
        self.emb = Params()
        self.emb.wte = nn.Parameter(torch.zeros(math.prod(self.wte_shape) // gz, device=dev))
        self.emb.wpe = nn.Parameter(torch.zeros(math.prod(self.wpe_shape) // gz, device=dev))
        features = h // ctx.size(NORM_AXIS)
        self.blocks = nn.ModuleList()
        self.shapes: dict[str, tuple[int, int]] = {}  # linear weight key -> local (k, n) before the z-shard
        for i in range(spec.layers):
            blk = Params()
            for ln in ("ln1", "ln2"):
                setattr(blk, ln, _norm(features, dev))
            add_linears(blk, spec, grid, i, self.shapes, dev)
            self.blocks.append(blk)

        self.lnf = _norm(features, dev)
        # weight keys of the program -> parameters
        self.keys: dict[str, list[nn.Parameter]] = {"emb": [self.emb.wte, self.emb.wpe], "head": [self.emb.wte],
                                                    "norms": self.norm_parameters(), "lnf": [self.lnf.weight, self.lnf.bias]}
        for i, blk in enumerate(self.blocks):
            for key, weight in block_linears(blk, spec, i).items():
                self.keys[key] = [weight]
            for ln in ("ln1", "ln2"):
                norm = getattr(blk, ln)
                self.keys[f"L{i}.{ln}"] = [norm.weight, norm.bias]
        if is_moe(spec):
            self.keys["routers"] = routers(self.blocks)

    # -- the program -------------------------------------------------------------------------------
    def use_program(self, program: Program) -> None:
        """Run `program` from now on (its model and grid must be this model's)."""
        if program.grid != self.ctx.grid or program.model.layers != self.spec.layers \
                or program.model.hidden != self.spec.hidden or program.vocab != self.vocab:
            raise ValueError(f"program of {program.model.name} on {program.grid} does not fit this model")
        self.program, self.options = program, program.options
        self.executor = make_executor(program, self, self._recorder, self._tune)

    def _executor_for(self, sequences: int, seq_len: int) -> Executor:
        """The executor of the program for micro-batches of `sequences` x `seq_len` on this rank: the
        model's program when it fits, else (e.g. a held-out batch) one built for that batch."""
        batch = sequences * self.ctx.batch_shards * self.options.micro_batches
        if self.program is None:
            self.use_program(build_program(self.spec, self.ctx.grid, self.options, batch=batch, seq_len=seq_len,
                                           stage=self.ctx.stage))
        if (self.program.batch, self.program.seq_len) == (batch, seq_len):
            return self.executor
        key = (batch, seq_len)
        if key not in self._others:
            prog = build_program(self.spec, self.ctx.grid, self.options, batch=batch, seq_len=seq_len,
                                 stage=self.ctx.stage)
            self._others = {key: make_executor(prog, self, self._recorder, self._tune)}
        return self._others[key]

    @property
    def recorder(self) -> Recorder:
        return self._recorder

    @recorder.setter
    def recorder(self, rec: Recorder) -> None:
        self._recorder = rec
        for exe in [self.executor, *self._others.values()]:
            if exe is not None:
                exe.recorder = rec

    # -- parameters by the program's weight keys -----------------------------------------------------
    def linears(self) -> list[nn.Parameter]:
        """The linear layers' weights in the model's order (L0.qkv, L0.attn_out, ..., L1.qkv, ...)."""
        return [w for i, b in enumerate(self.blocks) for key, w in block_linears(b, self.spec, i).items()
                if not key.endswith(".router")]

    def sharded_parameters(self) -> list[nn.Parameter]:
        """Parameters split over x, y and z (one copy per tensor-parallel rank): linears, wte, wpe."""
        return self.linears() + [self.emb.wte, self.emb.wpe]

    def norm_parameters(self) -> list[nn.Parameter]:
        """Layer-norm parameters (split over x, replicated over y and z) in the program's order."""
        out = []
        for b in self.blocks:
            out += [b.ln1.weight, b.ln1.bias, b.ln2.weight, b.ln2.bias]
        return out + [self.lnf.weight, self.lnf.bias]

    def unique_parameters(self) -> list[nn.Parameter]:
        """The parameters whose gradients this rank counts once in the global norm: its shards, and
        the layer norms on the ranks whose other coordinates of the norms' replicas are 0."""
        replica = [a for a in AXES if a not in (NORM_AXIS, "data")]
        first = all(self.ctx.coord(a) == 0 for a in replica)
        mine = self.sharded_parameters()
        if self.ctx.stage > 0:  # a pipeline's tied table: counted on the first stage (its copy on the last)
            mine = [p for p in mine if p is not self.emb.wte]
        mine = mine + (self.norm_parameters() if first else [])
        if is_moe(self.spec):  # split like the norms; the norm is also summed over the expert group,
            mine += self.keys["routers"] if first else []  # where only the experts differ
            experts = set(map(id, expert_parameters(self)))
            lead = self.ctx.coord("expert") == 0
            mine = [p for p in mine if id(p) in experts or lead]
        return mine

    def norm_params(self, key: str) -> list[nn.Parameter]:
        return self.keys[key]

    def router_weight(self, key: str) -> torch.Tensor:
        """The router of an MoE block, [h/G_x, E] (split over x only)."""
        return self.keys[key][0]

    def flat_shard(self, key: str, dtype: torch.dtype) -> torch.Tensor:
        """The z-shards of weight `key`, concatenated, in `dtype` (what its all-gather sends)."""
        params = self.keys[key]
        if len(params) == 1:
            return params[0].detach().reshape(-1).to(dtype)
        return torch.cat([p.detach().reshape(-1) for p in params]).to(dtype)

    def unpack(self, key: str, flat: torch.Tensor):
        """The local weight(s) of `key` from its gathered flat tensor [G_z * sum of shard sizes]."""
        rows = flat.view(self.ctx.size("z"), -1)
        if key in self.shapes:
            return rows.reshape(self.shapes[key])
        te = math.prod(self.wte_shape) // self.ctx.size("z")
        if key == "head":
            return rows.reshape(self.wte_shape)
        return rows[:, :te].reshape(self.wte_shape), rows[:, te:].reshape(self.wpe_shape)

    def local_weight(self, buffer: str):
        """Weight buffer `buffer` from this rank's own shard, when it is the whole block (G_z = 1)."""
        key = self.buffers_of.get(buffer)
        if key is None or self.ctx.size("z") != 1:
            return None
        return self.unpack(key, self.flat_shard(key, self.ctx.compute_dtype))

    def embedding_shapes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        return self.wte_shape, self.wpe_shape

    def embedding_offsets(self) -> tuple[int, int]:
        """First vocabulary row and first position of this rank's blocks of wte and wpe."""
        c = self.ctx.coord(EMBEDDING_AXES[0])
        return c * self.wte_shape[0], c * self.wpe_shape[0]

    def accumulate(self, key: str, flat: torch.Tensor) -> None:
        """Add a gradient of `key`'s shards (their concatenation, any shape) to the parameters' grads."""
        flat, off = flat.reshape(-1), 0
        for p in self.keys[key]:
            _add_grad(p, flat[off:off + p.numel()].view_as(p))
            off += p.numel()

    @staticmethod
    def accumulate_params(params, grads) -> None:
        for p, g in zip(params, grads):
            _add_grad(p, g)

    def flat_grads(self, key: str) -> torch.Tensor:
        """The gradients of `key`'s parameters, concatenated (zeros where none yet)."""
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in self.keys[key]])

    def set_grads(self, key: str, flat: torch.Tensor) -> None:
        off = 0
        for p in self.keys[key]:
            g = flat[off:off + p.numel()].view_as(p).to(p.dtype)
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)
            off += p.numel()

    # -- running -----------------------------------------------------------------------------------
    def forward(self, tokens: torch.Tensor, targets: torch.Tensor, micro_batch: int = 0,
                total_tokens: int | None = None, reduce_loss: bool = True) -> torch.Tensor:
        """Loss of this rank's sequences: tokens, targets [seqs, s] -> scalar; its backward() runs the
        program's backward ops of this micro-batch.

        Targets equal to IGNORE (-100; any negative) are left out of the loss (goldfish loss).
        The value is (sum of this rank's token losses) / total_tokens, so that gradients are those
        of the mean over the global batch. total_tokens default: the tokens counted in the loss
        over all z and data shards (a scalar all-reduce outside the program, not recorded).
        reduce_loss: also sum the value over z and data (outside the program, not recorded) so that
        it is the global mean on every rank; gradients are unchanged.
        """
        tokens, targets = tokens.to(self.ctx.device), targets.to(self.ctx.device)
        seqs, seq_len = tokens.shape
        if self.wpe_shape is not None and seq_len > self.spec.seq_len:
            raise ValueError(f"sequences of {seq_len} tokens exceed the position table ({self.spec.seq_len})")
        if total_tokens is None:
            counted = (targets >= 0).sum().to(torch.float32)
            total_tokens = int(sum_over_batch_shards(counted, self.ctx).item())
        exe = self._executor_for(seqs, seq_len)
        loss = _ProgramLoss.apply(self.lnf.weight, exe, micro_batch, tokens, targets, 1.0 / max(total_tokens, 1))
        if reduce_loss:
            loss = loss + (sum_over_batch_shards(loss.detach(), self.ctx) - loss.detach())
        return loss


class _ProgramLoss(torch.autograd.Function):
    """The forward ops of a micro-batch as one autograd node whose backward runs the backward ops.
    (`anchor`, a parameter, only makes the loss require a gradient.)"""

    @staticmethod
    def forward(ctx, anchor, exe: Executor, micro_batch: int, tokens, targets, scale: float):
        ctx.exe, ctx.micro_batch = exe, micro_batch
        return exe.forward(micro_batch, tokens, targets, scale)

    @staticmethod
    def backward(ctx, dloss):
        ctx.exe.backward(ctx.micro_batch, float(dloss))
        return None, None, None, None, None, None


def add_linears(blk: nn.Module, spec: ModelSpec, grid, layer: int, shapes: dict[str, tuple[int, int]],
                device) -> dict[str, nn.Parameter]:
    """Give block `blk` this rank's zero shards of layer `layer`'s linear weights (the k/G_x x n/G_y
    block, or its transposed split, flattened and cut over z); records each weight key's local (k, n)
    in `shapes` and returns weight key -> parameter. An MoE block (backend.models.moe) has its experts'
    stacked shards and a router in place of the MLP's weights."""
    out = {}
    for name, k, n, transposed in layer_linears(spec, layer):
        kl, nl, _, _ = linear_dims(grid, k, n, transposed)
        count = local_experts(spec, grid) if name.startswith("expert_") else 1  # a rank's experts, stacked
        shapes[f"L{layer}.{name}"] = (count, kl, nl) if name.startswith("expert_") else (kl, nl)
        lin = Params()
        lin.weight = nn.Parameter(torch.zeros(count * kl * nl // grid.z, device=device))
        setattr(blk, name, lin)
        out[f"L{layer}.{name}"] = lin.weight
    if moe_layer(spec, layer):
        blk.router = Params()
        blk.router.weight = nn.Parameter(torch.zeros(spec.hidden // grid.x, spec.experts, device=device))
        out[f"L{layer}.router"] = blk.router.weight
    return out


def block_linears(blk: nn.Module, spec: ModelSpec, layer: int) -> dict[str, nn.Parameter]:
    """Weight key -> parameter of block `layer`'s linears (and router), as add_linears made them."""
    out = {f"L{layer}.{name}": getattr(blk, name).weight for name, *_ in layer_linears(spec, layer)}
    if moe_layer(spec, layer):
        out[f"L{layer}.router"] = blk.router.weight
    return out


def routers(blocks) -> list[nn.Parameter]:
    """Every MoE block's router, in layer order (the program's weight "routers")."""
    return [b.router.weight for b in blocks if hasattr(b, "router")]


def expert_parameters(model) -> list[nn.Parameter]:
    """The experts' stacked shards of every MoE block (they differ across the expert group)."""
    return [b_lin.weight for b in model.blocks for name in ("expert_up", "expert_down")
            if (b_lin := getattr(b, name, None)) is not None]


def _norm(features: int, device) -> nn.Module:
    norm = Params()
    norm.weight = nn.Parameter(torch.ones(features, device=device))
    norm.bias = nn.Parameter(torch.zeros(features, device=device))
    return norm


def _add_grad(p: nn.Parameter, g: torch.Tensor) -> None:
    g = g.to(p.dtype)
    if p.grad is None:
        p.grad = g.clone()
    else:
        p.grad.add_(g)


def sum_over_batch_shards(value: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """Sum a tensor over the z and data axes (not part of the program; not recorded)."""
    value = value.clone()
    for axis in ("z", "data"):
        if ctx.groups.get(axis) is not None:
            dist.all_reduce(value, group=ctx.groups[axis])
    return value

