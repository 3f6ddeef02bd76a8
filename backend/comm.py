"""Collectives over one axis of the grid, recorded under the program's op names.

    comm = Comm(ctx, recorder)
    comm.all_reduce(t, "x", "L0.qkv.fwd.ar_x")                     # in place, synchronous
    p = comm.all_gather(shard, "z", "L0.qkv.fwd.ag_z", async_op=True)
    full = p.wait()                                                 # the gathered tensor

Every call returns a `Pending` (already completed when synchronous); wait() returns the result.
A collective over an axis of size 1 is left out (not issued, not recorded), as in the program.

Bytes recorded follow the program's convention, not the dtype that happens to travel: weights in
flight, activations and their gradients count ACT_BYTES (bf16) per element, statistics STAT_BYTES and
data-axis gradient shards GRAD_AR_BYTES (fp32). On GPU (bf16) these are the real bytes; on CPU (fp32)
the activation payloads travel at twice that. The real size goes into the record's args.

gloo has no reduce-scatter: on CPU it is an all-reduce followed by taking this rank's chunk (twice
the traffic, same result); NCCL (and the fake test backend) use the native one.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from backend.dist import ParallelContext
from backend.recorder import NULL_RECORDER, Record, Recorder
from twin.program import ACT_BYTES

SUM, MAX = dist.ReduceOp.SUM, dist.ReduceOp.MAX
# the single-tensor collectives (named *_single since torch 2.13, *_tensor before)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Pending:
    """A collective in flight: wait() completes it, ends its record and returns the result."""

    def __init__(self, result: torch.Tensor, work=None, rec: Record | None = None,
                 recorder: Recorder = NULL_RECORDER, finish: Callable[[], torch.Tensor] | None = None):
        self.result, self._work, self._rec, self._recorder, self._finish = result, work, rec, recorder, finish
        self.done = work is None and finish is None

    def wait(self) -> torch.Tensor:
        if not self.done:
            if self._work is not None:
                self._work.wait()
            if self._finish is not None:
                self.result = self._finish()
            self._recorder.end(self._rec)
            self.done = True
        return self.result


class Comm:
    """The collectives of one rank, per axis, with recording."""

    def __init__(self, ctx: ParallelContext, recorder: Recorder = NULL_RECORDER):
        self.ctx = ctx
        self.recorder = recorder
        self.native_reduce_scatter = str(ctx.backend) != "gloo"

    def skip(self, axis: str) -> bool:
        """True when the axis has one rank: the collective is left out."""
        return self.ctx.size(axis) == 1

    def _begin(self, name: str, kind: str, axis: str, t: torch.Tensor, width: int) -> Record | None:
        return self.recorder.begin(name, kind, axis, axis=axis, bytes=t.numel() * width,
                                   actual_bytes=t.numel() * t.element_size(), dtype=str(t.dtype).replace("torch.", ""))

    def _out(self, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        if like.device.type == "cpu":  # zeros: the fake backend leaves outputs untouched
            return torch.zeros(shape, dtype=like.dtype, device=like.device)
        return torch.empty(shape, dtype=like.dtype, device=like.device)

    def all_reduce(self, t: torch.Tensor, axis: str, name: str, op=SUM, async_op: bool = False,
                   width: int = ACT_BYTES) -> Pending:
        """All-reduce `t` in place over `axis` (sum or max). Payload: the buffer."""
        if self.skip(axis):
            return Pending(t)
        rec = self._begin(name, "all_reduce", axis, t, width)
        work = dist.all_reduce(t, op=op, group=self.ctx.groups[axis], async_op=async_op)
        p = Pending(t, work, rec, self.recorder) if async_op else Pending(t)
        if not async_op:
            self.recorder.end(rec)
        return p

    def all_gather(self, t: torch.Tensor, axis: str, name: str, async_op: bool = False,
                   width: int = ACT_BYTES) -> Pending:
        """Gather the 1-D shards of the axis group into one 1-D tensor (axis order). Payload: the output."""
        if self.skip(axis):
            return Pending(t)
        out = self._out((t.numel() * self.ctx.size(axis),), t)
        rec = self._begin(name, "all_gather", axis, out, width)
        work = _all_gather(out, t.contiguous(), group=self.ctx.groups[axis], async_op=async_op)
        if async_op:
            return Pending(out, work, rec, self.recorder)
        self.recorder.end(rec)
        return Pending(out)

    def reduce_scatter(self, t: torch.Tensor, axis: str, name: str, async_op: bool = False,
                       width: int = ACT_BYTES) -> Pending:
        """Sum the 1-D tensors of the axis group and keep this rank's chunk (axis order). Payload: the input."""
        if self.skip(axis):
            return Pending(t)
        n, me = self.ctx.size(axis), self.ctx.coord(axis)
        chunk = t.numel() // n
        rec = self._begin(name, "reduce_scatter", axis, t, width)
        group = self.ctx.groups[axis]
        if self.native_reduce_scatter:
            out = self._out((chunk,), t)
            work = _reduce_scatter(out, t.contiguous(), group=group, async_op=async_op)
            finish = None
        else:  # gloo: all-reduce a copy, keep my chunk
            buf = t.contiguous().clone()
            work = dist.all_reduce(buf, group=group, async_op=async_op)
            out = buf[me * chunk:(me + 1) * chunk]

            def finish() -> torch.Tensor:
                return buf[me * chunk:(me + 1) * chunk]
        if async_op:
            return Pending(out, work, rec, self.recorder, finish)
        self.recorder.end(rec)
        return Pending(out)
