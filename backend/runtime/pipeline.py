"""A pipeline stage's program on one rank (twin/program/pipeline.py): the executor that runs it, its
point-to-point sends and receives, and which stage owns which weight.

The stage's program interleaves the forward and backward units of several micro-batches in the
schedule's order (GPipe, 1F1B, interleaved), so `PipelineExecutor.run_step` walks the whole program
in order rather than one micro-batch's segment at a time. Buffers are kept per micro-batch (the
`x:L3` of micro-batch 0 and of micro-batch 1 are in flight together); weights gathered over z
(`w:...`) are shared by every micro-batch, as cached layers are.

A send is `torch.distributed.isend` of its buffer to the rank of the peer stage with the same x, y,
z and data coordinates, a receive `irecv` into a fresh buffer; both are asynchronous on the stream
`pipe` and waited for where the program's dependencies say (a compute op that reads a received
buffer waits for its receive), every one by the end of the step. Each message carries a tag made
from its name (the same on both stages), so that messages between two stages never match out of
order (interleaving sends activations and gradients between the same two stages). A GPT's first
and last stage exchange the gradient shards of their tied token table at the end of the step (the
receive adds the other's to its own).

Each rank holds the parameter shards of the whole model (as an unpipelined rank does; they start
equal on every stage), and only its stage's are used and updated: the others never get a gradient,
so AdamW leaves them as they are. The global gradient norm counts a GPT's tied table once (on the
first stage).
"""

from __future__ import annotations

import time
import zlib
from collections import defaultdict

import torch
import torch.distributed as dist

from backend.runtime.comm import Pending
from backend.runtime.executor import Executor
from backend.runtime.moe import aux_value
from backend.runtime.layers import loss_value
from twin.program.ops import ACT_BYTES, Program
from twin.program.pipeline import chunk_layers

SHARED = "w:"  # buffers every micro-batch shares: weights gathered over z (cached layers too)


class StepEnv(dict):
    """The buffers of one micro-batch; names starting with SHARED live in the dict every micro-batch shares."""

    def __init__(self, shared: dict):
        super().__init__()
        self.shared = shared

    def _of(self, name):
        return self.shared if isinstance(name, str) and name.startswith(SHARED) else super()

    def __getitem__(self, name):
        return self._of(name).__getitem__(name)

    def __setitem__(self, name, value):
        self._of(name).__setitem__(name, value)

    def __contains__(self, name):
        return self._of(name).__contains__(name)

    def pop(self, name, *default):
        return self._of(name).pop(name, *default)

    def get(self, name, default=None):
        return self._of(name).get(name, default)


def tag_of(op) -> int:
    """The message tag of a send or receive: from its name without .send/.recv (both ends agree)."""
    return zlib.crc32(op.name.rsplit(".", 1)[0].encode()) & 0x7FFFFFF


def stage_last_uses(program: Program) -> dict[int, list[str]]:
    """op index -> the buffers to drop after it: the last use of each (micro-batch, buffer), shared
    buffers by name over the whole step."""
    last: dict[tuple, int] = {}
    drop: dict[int, list[str]] = defaultdict(list)
    for op in program.ops:
        for name in op.reads + ((op.add,) if op.add else ()):
            last[_key(op, name)] = op.index
        for name in op.writes:
            k = _key(op, name)
            if k in last and last[k] != op.index:
                drop[last[k]].append(name)
            last[k] = op.index
    for (_, name), i in last.items():
        drop[i].append(name)
    return dict(drop)


def _key(op, name: str) -> tuple:
    return (None if name.startswith(SHARED) else op.micro_batch, name)


class PipelineExecutor(Executor):
    """Runs one pipeline stage's program (module docstring)."""

    def __init__(self, program: Program, model, *args, **kwargs):
        super().__init__(program, model, *args, **kwargs)
        self.drop = stage_last_uses(program)
        self.shared: dict = {}
        self.envs: dict[int, StepEnv] = {}
        self.losses: dict[int, torch.Tensor] = {}
        ctx = model.ctx
        self.peer_rank = {s: ctx.grid.peer(ctx.rank, s) for s in range(ctx.grid.pipe)}

    def _env(self, mb: int) -> StepEnv:
        env = self.envs.get(mb)
        if env is None:
            env = self.envs[mb] = StepEnv(self.shared)
        return env

    # -- running ------------------------------------------------------------------------------------
    def wait(self, index: int) -> None:
        env = self.env  # completing an op switches to its micro-batch's buffers: come back after
        super().wait(index)
        self.env = env

    def execute(self, op) -> None:
        self.env = self._env(op.micro_batch)
        if op.kind in ("send", "recv"):
            for d in op.deps:
                if d in self.pending:
                    self.wait(d)
            self.pending[op.index] = self._p2p(op)
            self.by_stream[op.stream].append(op.index)
            return
        if op.role == "loss_bwd":  # the loss of the micro-batch, once its reductions are in
            for name in op.reads:
                self._wait_writer(name)
            self.losses[op.micro_batch] = loss_value(self.run, *[self.env[n] for n in op.reads]).detach()
        super().execute(op)

    def _p2p(self, op) -> Pending:
        started = time.perf_counter()
        peer = self.peer_rank[op.peer]
        if op.kind == "send":
            t = (self.model.flat_grads(op.weight).clone() if op.weight else self.read(op.reads[0])).contiguous()
            issue = lambda: dist.isend(t, dst=peer, tag=tag_of(op))  # noqa: E731
        else:
            dtype = self.ctx.compute_dtype
            numel = self.model.flat_grads(op.weight).numel() if op.weight else op.bytes // ACT_BYTES
            t = torch.empty(numel, dtype=torch.float32 if op.weight else dtype, device=self.ctx.device)
            issue = lambda: dist.irecv(t, src=peer, tag=tag_of(op))  # noqa: E731
        rec = self.recorder.begin_op(op, actual_bytes=t.numel() * t.element_size(),
                                     dtype=str(t.dtype).removeprefix("torch."))
        work = issue()
        if rec is not None:
            rec.args["issue_us"] = round((time.perf_counter() - started) * 1e6, 3)
            self.recorder.end_on_completion(rec, work)
        return Pending(op, work, t)

    def _complete(self, index: int, p) -> None:
        op = p.op
        self.env = self._env(op.micro_batch)
        if op.kind == "send":
            p.wait()
            self._drop(index)
        elif op.kind == "recv":
            result = p.wait()
            if op.accumulate:
                self.model.accumulate(op.accumulate, result)
            else:
                self.env[op.writes[0]] = result.view(-1, self.model.spec.hidden // self.ctx.size("x"))
            self._drop(index)
        else:
            super()._complete(index, p)

    def _wait_writer(self, name: str) -> None:
        mb = self.env
        for index in sorted(self.pending):
            p = self.pending.get(index)
            if p is not None and name in p.op.writes and self._env(p.op.micro_batch) is mb:
                self.wait(index)
        self.env = mb

    @torch.no_grad()
    def run_step(self, batches: list[tuple[torch.Tensor, torch.Tensor]], scale: float) -> torch.Tensor:
        """Every op of the step but the optimizer's, in program order: the units of the schedule, then
        the gradient reductions (all complete after). Returns scale * the sum of this rank's token
        losses over its micro-batches (0 on a stage without the loss)."""
        self.wait_all()
        self.shared.clear()
        self.envs.clear()
        self.losses.clear()
        self.run.scale, self.run.dloss = scale, 1.0
        self.run.aux_parts = []
        for j, (tokens, targets) in enumerate(batches):
            env = self._env(j)
            env["tokens"], env["targets"] = tokens, targets
        for op in self.program.ops:
            if op.phase != "opt":
                self.execute(op)
        self.wait_all()
        total = torch.zeros((), dtype=torch.float32, device=self.ctx.device)
        for v in self.losses.values():
            total += v
        if self.run.aux_parts:  # MoE: this stage's blocks' share of the load-balancing loss
            total += aux_value(self.run, self.program.model.experts, self.ctx.batch_shards).to(total.device)
        return total

    def optimizer_step(self, optimizer, max_norm: float) -> float | None:
        self.env = self._env(-1)
        out = super().optimizer_step(optimizer, max_norm)
        self.shared.clear()
        self.envs.clear()
        return out


def make_executor(program: Program, model, *args, **kwargs) -> Executor:
    """The executor of `program`: a pipeline stage's (PipelineExecutor) on a pipelined grid."""
    cls = PipelineExecutor if program.grid.pipe > 1 else Executor
    return cls(program, model, *args, **kwargs)


def owner_stage(model, ref_name: str) -> int:
    """The pipeline stage whose copy of a reference parameter is trained: a block's the stage of its
    chunk, the embedding tables the first, the final norm and a Llama's head the last."""
    grid, options, spec = model.ctx.grid, model.options, model.spec
    if ref_name.startswith(("blocks.", "model.layers.")):  # the GPT reference's, or Hugging Face Llama's
        i = int(ref_name.split(".")[2 if ref_name.startswith("model.") else 1])
        for s in range(grid.pipe):
            for c in range(options.chunks):
                if i in chunk_layers(spec, grid, options, s, c):
                    return s
    if ref_name.startswith(("wte", "wpe", "model.embed_tokens")):
        return 0
    return grid.pipe - 1
