"""Collectives of the program on their axis's process group, asynchronous, timed to completion.

    p = comm.issue(op, tensor)      # op: a collective of the program (kind, axis, role, bytes)
    result = p.wait()               # all-reduce: the tensor, reduced in place; all-gather: the
                                    # gathered 1-D tensor (axis order); reduce-scatter: this rank's chunk

Every collective is issued with async_op=True. Its record (backend/runtime/recorder.py) starts at the issue
and ends when the collective *completes*: a callback on the work's future stamps the end (on GPU a
CUDA event on the stream the collective ran on), not the moment someone waits for it.

The record's `issue_us` is the host's wall time of issuing it: from the start of preparing its
buffers (the executor's, where it passes `started`) to the return of the asynchronous call. On a CPU
the host is the device, and the compute op after an issue starts that much later (gloo's thread
takes the issuing rank's core as it wakes to the transfer); on a GPU it is the launch cost on the host.

Bytes recorded are the program's (op.bytes: bf16 activations, fp32 statistics and data-axis
gradients); the size that travelled and its dtype go into the record's args.

gloo has no reduce-scatter: on CPU it is an all-reduce followed by taking this rank's chunk (twice
the traffic, same result); NCCL (and the fake test backend) use the native one.

All-to-all (the MoE dispatch and combine): `all_to_all_single` with the actual rows per member
(split sizes), on NCCL and on gloo alike (torch's gloo has a native all-to-all with splits,
alltoallv, for CPU tensors: checked with torch 2.13 on groups of two and four ranks). The counts
behind the splits are exchanged first by `exchange_counts`, a small synchronous all-to-all of ints.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from backend.runtime.dist import ParallelContext
from backend.runtime.recorder import NULL_RECORDER, Recorder
from twin.program.program import Op

OPS = {"max": dist.ReduceOp.MAX}  # reduction of an all-reduce by its role; SUM otherwise
# the single-tensor collectives (named *_single since torch 2.13, *_tensor before)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Pending:
    """A collective in flight: wait() blocks until it is complete and returns its result."""

    __slots__ = ("op", "work", "result", "chunk", "done", "post")

    def __init__(self, op, work, result: torch.Tensor, chunk: slice | None = None, post=None):
        self.op, self.work, self.result, self.chunk, self.done, self.post = op, work, result, chunk, False, post

    def wait(self) -> torch.Tensor:
        if not self.done:
            self.work.wait()
            if self.chunk is not None:
                self.result = self.result[self.chunk]
            if self.post is not None:  # an all-to-all's rows put in the order their reader wants
                self.result = self.post(self.result)
            self.done = True
        return self.result


class Comm:
    """Issues the program's collectives of one rank, recorded from issue to completion."""

    def __init__(self, ctx: ParallelContext, recorder: Recorder = NULL_RECORDER):
        self.ctx = ctx
        self.recorder = recorder
        self.native_reduce_scatter = str(ctx.backend) != "gloo"

    def _out(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        if like.device.type == "cpu":  # zeros: the fake backend leaves outputs untouched
            return torch.zeros(numel, dtype=like.dtype, device=like.device)
        return torch.empty(numel, dtype=like.dtype, device=like.device)

    def issue(self, op, t: torch.Tensor, started: float | None = None,
              splits: tuple[list[int], list[int]] | None = None, post=None) -> Pending:
        """Start collective `op` on tensor `t` (an all-reduce reduces `t` in place). started: the
        time.perf_counter() at which the caller began preparing `t` (default: now), the start of the
        record's `issue_us`. An all-to-all: `splits` = (rows sent to, rows received from each member
        of the group), `post` applied to the received rows on completion."""
        started = time.perf_counter() if started is None else started
        group = self.ctx.groups[op.axis]
        t = t.contiguous()
        chunk = None
        if op.kind == "all_to_all":
            ins, outs = splits
            out, sent = self._out(sum(outs) * math.prod(t.shape[1:]), t), t
            out = out.view(sum(outs), *t.shape[1:])
            issue = lambda: dist.all_to_all_single(out, t, output_split_sizes=outs, input_split_sizes=ins,  # noqa: E731
                                                   group=group, async_op=True)
        elif op.kind == "all_reduce":
            out, sent = t, t
            issue = lambda: dist.all_reduce(t, op=OPS.get(op.role, dist.ReduceOp.SUM), group=group, async_op=True)  # noqa: E731
        elif op.kind == "all_gather":
            out, sent = self._out(t.numel() * self.ctx.size(op.axis), t), t
            issue = lambda: _all_gather(out, t, group=group, async_op=True)  # noqa: E731
        elif self.native_reduce_scatter:
            out, sent = self._out(t.numel() // self.ctx.size(op.axis), t), t
            issue = lambda: _reduce_scatter(out, t, group=group, async_op=True)  # noqa: E731
        else:  # gloo: all-reduce a copy, keep my chunk
            n, me = self.ctx.size(op.axis), self.ctx.coord(op.axis)
            size = t.numel() // n
            out = sent = t.clone()
            chunk = slice(me * size, (me + 1) * size)
            issue = lambda: dist.all_reduce(out, group=group, async_op=True)  # noqa: E731
        rec = self.recorder.begin_op(op, actual_bytes=sent.numel() * sent.element_size(),
                                     dtype=str(sent.dtype).removeprefix("torch."))
        work = issue()
        if rec is not None:
            rec.args["issue_us"] = round((time.perf_counter() - started) * 1e6, 3)
            self.recorder.end_on_completion(rec, work)
        return Pending(op, work, out, chunk, post)

    def exchange_counts(self, axis: str, counts: torch.Tensor) -> torch.Tensor:
        """counts [members * c] (c per member, this rank's rows for each) -> what each member has
        for this rank, [members * c] in member order (a synchronous all-to-all of ints)."""
        out = torch.zeros_like(counts)
        dist.all_to_all_single(out, counts.contiguous(), group=self.ctx.groups[axis])
        return out

    # -- one collective outside a program (microbenchmarks), through the same path ------------------
    def _call(self, kind: str, t: torch.Tensor, axis: str, name: str, async_op: bool, role: str = "") -> Pending:
        nbytes = t.numel() * t.element_size() * (self.ctx.size(axis) if kind == "all_gather" else 1)
        p = self.issue(Op(-1, name, kind, axis, bytes=nbytes, axis=axis, role=role), t)
        if not async_op:
            p.wait()
        return p

    def all_reduce(self, t: torch.Tensor, axis: str, name: str, async_op: bool = False, role: str = "") -> Pending:
        """All-reduce `t` in place over `axis` (role "max": the maximum; else the sum)."""
        return self._call("all_reduce", t, axis, name, async_op, role)

    def all_gather(self, t: torch.Tensor, axis: str, name: str, async_op: bool = False) -> Pending:
        """Gather the 1-D shards of the axis group into one 1-D tensor (axis order)."""
        return self._call("all_gather", t, axis, name, async_op)

    def reduce_scatter(self, t: torch.Tensor, axis: str, name: str, async_op: bool = False) -> Pending:
        """Sum the 1-D tensors of the axis group and keep this rank's chunk (axis order)."""
        return self._call("reduce_scatter", t, axis, name, async_op)
