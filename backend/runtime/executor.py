"""The executor: runs a `Program` (twin/program/program.py) op by op on one rank.

The program is a list of instructions; the executor dispatches each by its kind, as the pipeline
engines of DeepSpeed and torch.distributed.pipelining do:
- a compute op runs its kernel (backend/runtime/layers.py, chosen by the op's `role`) on the buffers it
  `reads` and stores what it `writes`, then adds the buffer `add` (a residual) and accumulates its
  output into the gradients of weight `accumulate` where the program says so;
- a collective is issued asynchronously on its axis's process group (backend/runtime/comm.py) and waited
  for only where a later op depends on it (`deps`), or where a later op on its stream is waited for
  (ops on one stream complete in program order);
- the backward pass is the program's backward ops (dgrad and wgrad GEMMs, recomputation) on the
  buffers the forward left: no autograd graph spans two ops.

Buffers live in one dictionary for the whole step; each is dropped after its last use in the
program (so a recomputed block keeps only its input between the passes, and a gathered weight lives
from its all-gather to its last GEMM). A weight buffer that no all-gather wrote (G_z = 1) is the
rank's own shard. The program's phases split the step into segments that `forward`, `backward`,
`reduce_gradients` and `optimizer_step` run; an op's name is for humans and traces only.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch

from backend.runtime.comm import Comm
from backend.runtime.gemm import GemmTuner
from backend.runtime.layers import COMPUTE, PAYLOADS, loss_value
from backend.runtime.moe import aux_coef_of, aux_value, experts_of, is_moe, moe_layers, routing_sources
from backend.runtime.recorder import NULL_RECORDER, Recorder
from twin.program.program import Program

INPUTS = ("tokens", "targets")  # the buffers a micro-batch brings


def segments(program: Program) -> dict[tuple[str, int], list]:
    """The program's ops by segment: ('fwd', j), ('bwd', j) for micro-batch j (recomputation belongs
    to the backward), ('grad', -1), ('opt', -1); program order within each."""
    out: dict[tuple[str, int], list] = defaultdict(list)
    for op in program.ops:
        out[("bwd" if op.phase == "rec" else op.phase, op.micro_batch)].append(op)
    return dict(out)


def last_uses(program: Program) -> dict[int, list[str]]:
    """op index -> the buffers to drop after it (their last read or write before the next write)."""
    last: dict[str, int] = {}
    drop: dict[int, list[str]] = defaultdict(list)
    for op in program.ops:
        for name in op.reads + ((op.add,) if op.add else ()):
            last[name] = op.index
        for name in op.writes:
            if name in last and last[name] != op.index:
                drop[last[name]].append(name)
            last[name] = op.index
    for name, i in last.items():
        drop[i].append(name)
    return dict(drop)


class Run:
    """What the kernels see of the run: the model, the tuner, the step's scalars, the current record."""

    def __init__(self, model, tuner: GemmTuner):
        self.model, self.tuner = model, tuner
        self.record = None        # the record of the running op (a kernel may add args to it)
        self.scale = 1.0          # the loss's scale: 1 / tokens counted over the global batch
        self.dloss = 1.0          # gradient flowing into the loss
        self.max_norm = 1.0       # clipping threshold of the global gradient norm
        self.grad_norm = None     # the norm before clipping, once computed
        self.optimizer = None
        self.executor = None      # the executor (an MoE kernel finds its routing in its buffers)
        self.routing_buffer: dict[int, str] = {}  # MoE: op index -> the `router.idx` buffer it follows
        self.aux_parts: list = []  # MoE: (sum of P over this rank's tokens, counts, tokens) per block, fwd
        self.aux_scale = 0.0      # MoE: router_aux_coef / (MoE layers * micro-batches)

    def routing_of(self, op):
        """The Routing (backend.runtime.moe) of the MoE block op belongs to."""
        return self.executor.env[self.routing_buffer[op.index]]


class Executor:
    """Runs one rank's program (see the module docstring). model: backend.models.gpt.GPT (the parameters)."""

    def __init__(self, program: Program, model, recorder: Recorder = NULL_RECORDER,
                 tune_gemms: bool | None = None):
        ctx = model.ctx
        self.program, self.model, self.ctx = program, model, ctx
        self.comm = Comm(ctx, recorder)
        self.run = Run(model, GemmTuner(ctx.device.type == "cuda" if tune_gemms is None else tune_gemms))
        self.segments = segments(program)
        self.drop = last_uses(program)
        self.env: dict[str, object] = {}
        self.pending: dict[int, object] = {}          # op index -> Pending collective
        self.by_stream: dict[str, list[int]] = defaultdict(list)  # pending indices per stream, in order
        self.loss_ops = {op.micro_batch: op for op in program.ops if op.kind == "loss" and op.phase == "bwd"}
        # buffers a collective writes and a compute op writes again (an MoE block's counts, reduced in
        # the forward and recomputed): the compute op waits for the collective, not to lose its value
        by_collective = {n for op in program.ops if op.is_collective for n in op.writes}
        self.rewritten = {n for op in program.ops if not op.is_collective for n in op.writes} & by_collective
        self.run.executor = self
        if is_moe(program.model):  # which routing each all-to-all and grouped GEMM follows, and its direction
            self.a2a_to_experts = {}
            for index, (buffer, crossed) in routing_sources(program).items():
                self.run.routing_buffer[index] = buffer
                self.a2a_to_experts[index] = crossed % 2 == 0
            self.run.aux_scale = aux_coef_of(program.model) / (len(moe_layers(program.model))
                                                               * program.options.micro_batches)

    @property
    def recorder(self) -> Recorder:
        return self.comm.recorder

    @recorder.setter
    def recorder(self, rec: Recorder) -> None:
        self.comm.recorder = rec

    # -- buffers ------------------------------------------------------------------------------------
    def read(self, name: str):
        if name in self.env:
            return self.env[name]
        weight = self.model.local_weight(name)  # a weight no all-gather wrote: this rank's own shard
        if weight is None:
            raise RuntimeError(f"buffer {name!r} is read before any op of the program wrote it")
        return weight

    def _store(self, op, outputs) -> None:
        if not op.writes:
            return
        if len(op.writes) == 1:
            outputs = (outputs,)
        for name, value in zip(op.writes, outputs):
            self.env[name] = value
        if op.add:
            self.env[op.writes[0]] = self.env[op.writes[0]] + self.read(op.add)
        if op.accumulate:
            self.model.accumulate(op.accumulate, self.env[op.writes[0]])

    def _drop(self, index: int) -> None:
        for name in self.drop.get(index, ()):
            self.env.pop(name, None)

    # -- waiting ------------------------------------------------------------------------------------
    def wait(self, index: int) -> None:
        """Complete op `index` if it is in flight, and every earlier op of its stream first."""
        p = self.pending.get(index)
        if p is None:
            return
        queue = self.by_stream[p.op.stream]
        while queue and queue[0] <= index:
            first = queue.pop(0)
            self._complete(first, self.pending.pop(first))

    def _complete(self, index: int, p) -> None:
        op = p.op
        result = p.wait()
        if op.kind == "all_gather":
            self.env[op.writes[0]] = self.model.unpack(op.weight, result)
        elif op.kind == "reduce_scatter":
            self.model.accumulate(op.accumulate, result)
        elif op.role == "grad":
            self.model.set_grads(op.weight, result)
        else:
            self._store(op, result)
        self._drop(index)

    def wait_all(self) -> None:
        for index in sorted(self.pending):
            self.wait(index)

    # -- running ------------------------------------------------------------------------------------
    def execute(self, op) -> None:
        """Run (or issue) one op after waiting for its dependencies."""
        for d in op.deps:
            if d in self.pending:
                self.wait(d)
        if op.is_collective:
            self.pending[op.index] = self._issue(op)
            self.by_stream[op.stream].append(op.index)
            return
        for name in op.writes:  # a collective of an earlier pass still writing this buffer completes first
            if name in self.rewritten:
                self._wait_writer_of(name, op.micro_batch)
        args = [self.read(n) for n in op.reads]
        rec = self.recorder.begin_op(op)
        self.run.record = rec
        out = COMPUTE[op.role](self.run, op, *args)
        self.recorder.end(rec)
        self._store(op, out)
        self._drop(op.index)

    def _issue(self, op):
        """Issue collective `op` (its record's issue_us counts from here: preparing its buffers too)."""
        dtype, started = self.ctx.compute_dtype, time.perf_counter()
        if op.kind == "all_gather":
            return self.comm.issue(op, self.model.flat_shard(op.weight, dtype), started)
        if op.kind == "reduce_scatter":
            return self.comm.issue(op, self.read(op.reads[0]).reshape(-1), started)
        if op.role == "grad":
            return self.comm.issue(op, self.model.flat_grads(op.weight), started)
        if op.kind == "all_to_all":
            return self._issue_all_to_all(op, started)
        if op.role in PAYLOADS:  # computed here, before the issue (not part of the collective's time)
            return self.comm.issue(op, PAYLOADS[op.role](self.run, op, *[self.read(n) for n in op.reads]))
        return self.comm.issue(op, self.read(op.reads[0]), started)

    def _issue_all_to_all(self, op, started: float):
        """An MoE all-to-all with the actual rows: toward the experts (dispatch, and the combine's
        backward) the rows go in send order and arrive in expert order; back toward the tokens the
        reverse. The first dispatch of a routing exchanges its counts."""
        routing = self.run.routing_of(op)
        rows = self.read(op.reads[0])
        if self.a2a_to_experts[op.index]:
            if routing.recv is None:
                recv = self.comm.exchange_counts(op.axis, routing.send_counts)
                routing.recv = recv.view(routing.members, routing.n_local)
            splits = (routing.send_splits(), routing.recv_splits())
            return self.comm.issue(op, rows, started, splits, post=lambda r: r[routing.to_expert_order()])
        source_major = torch.empty_like(rows)
        source_major[routing.to_expert_order()] = rows
        return self.comm.issue(op, source_major, started, (routing.recv_splits(), routing.send_splits()))

    @torch.no_grad()  # kernels that need a local graph enable it themselves
    def run_segment(self, key: tuple[str, int]) -> None:
        for op in self.segments.get(key, ()):
            self.execute(op)

    # -- the step's parts ---------------------------------------------------------------------------
    def forward(self, micro_batch: int, tokens: torch.Tensor, targets: torch.Tensor, scale: float) -> torch.Tensor:
        """The forward ops of a micro-batch; returns scale * the sum of this rank's token losses."""
        self.run.scale = scale
        if micro_batch == 0:  # a new step: nothing of the last one is needed (cached weights changed)
            self.wait_all()
            self.env.clear()
        self.env["tokens"], self.env["targets"] = tokens, targets
        self.run.aux_parts = []
        self.run_segment(("fwd", micro_batch))
        op = self.loss_ops[micro_batch]
        for name in op.reads:  # the loss needs its reductions complete
            self._wait_writer(name)
        with torch.no_grad():
            value = loss_value(self.run, *[self.env[n] for n in op.reads])
            if self.run.aux_parts:  # MoE: this rank's share of the load-balancing loss (its counts summed first)
                for o in self.segments[("fwd", micro_batch)]:
                    if o.role == "expert_counts":
                        self.wait(o.index)
                value = value + aux_value(self.run, experts_of(self.program.model), self.ctx.batch_shards)
            return value

    def _wait_writer_of(self, name: str, micro_batch: int) -> None:
        for index in sorted(self.pending):
            p = self.pending.get(index)
            if p is not None and name in p.op.writes and p.op.micro_batch == micro_batch:
                self.wait(index)

    def _wait_writer(self, name: str) -> None:
        for index in sorted(self.pending):
            if name in self.pending[index].op.writes:
                self.wait(index)

    def backward(self, micro_batch: int, dloss: float = 1.0) -> None:
        """The backward ops of a micro-batch (with its recomputation), from d(loss) = dloss."""
        self.run.dloss = dloss
        self.run_segment(("bwd", micro_batch))

    def reduce_gradients(self) -> None:
        """The end-of-step gradient reductions (data, and z for the layer norms); all complete after."""
        self.run_segment(("grad", -1))
        self.wait_all()

    def optimizer_step(self, optimizer, max_norm: float) -> float | None:
        """Clipping and the optimizer; returns the gradient norm before clipping (None without clipping)."""
        self.run.optimizer, self.run.max_norm, self.run.grad_norm = optimizer, max_norm, None
        self.run_segment(("opt", -1))
        self.wait_all()
        self.env.clear()  # cached weights change with the step
        return self.run.grad_norm
