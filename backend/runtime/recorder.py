"""The op recorder: what each GEMM, collective and compute op of the program cost on this rank.

Every op is recorded under the program's name (twin/program/program.py) with the program's kind, stream,
axis, bytes and GEMM sizes, and its start and duration. Timing: CUDA events on the current stream on
GPU (resolved lazily, when spans are read), time.perf_counter on CPU. What a span means:
- a compute op: from the call of its kernel to its return (wall time). On CPU the span also carries
  `cpu_us`, the CPU time the rank's thread ran inside it (time.thread_time): where ranks outnumber
  cores the scheduler deschedules a rank in the middle of whichever op it is running, and that op's
  wall span absorbs another rank's time slice; `cpu_us` is the op's own cost, wall - cpu the time
  the rank waited for a core (calibration/validate.py uses both);
- an asynchronous collective: from its issue to its completion, stamped by a callback on its work's
  future (on GPU an event on the stream it ran on), not when it is waited for. It includes the time
  the collective waits for the group's last member to issue it. A collective issued while the
  previous one of its stream is still running starts when that one ends: the spans of one stream
  never overlap.

    rec = Recorder(enabled=True, device=torch.device("cpu"))
    with rec.op("L0.qkv.fwd.gemm", "gemm", "compute", m=64, n=96, k=32, layout="NN"):
        y = x @ w
    spans = rec.spans(rank)      # -> list[twin.program.trace.Span]; twin.program.trace.write_trace(folder, spans) writes them
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch

from twin.program.trace import Span, span_args


@dataclass
class Record:
    """One recorded op. bytes follow the program's convention (see backend/runtime/comm.py)."""

    name: str
    kind: str
    stream: str
    axis: str | None = None
    bytes: int = 0
    m: int = 0
    n: int = 0
    k: int = 0
    layout: str = ""
    args: dict = field(default_factory=dict)
    _start: object = None   # float seconds (CPU) or a CUDA event
    _end: object = None
    _cpu: float | None = None  # CPU compute ops: the thread's CPU time (s) at the start, then its span

    def key(self) -> tuple:
        """What identifies the op across twin and backend (name, kind, stream, axis, bytes, GEMM sizes)."""
        return (self.name, self.kind, self.stream, self.axis, self.bytes, self.m, self.n, self.k, self.layout)


class Recorder:
    """Collects Records; a disabled recorder costs one branch per op."""

    def __init__(self, enabled: bool = True, device: torch.device | str | None = None):
        self.enabled = enabled
        self.device = torch.device(device or "cpu")
        self.cuda = self.device.type == "cuda"
        self.records: list[Record] = []
        self._origin: object = None
        self.reset()

    def reset(self) -> None:
        """Forget all records; times restart from zero."""
        self.records = []
        self._origin = self._now()

    def _now(self) -> object:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def begin(self, name: str, kind: str, stream: str, axis: str | None = None, bytes: int = 0,
              m: int = 0, n: int = 0, k: int = 0, layout: str = "", **args) -> Record | None:
        """Start recording an op (returns None when disabled); finish it with end()."""
        if not self.enabled:
            return None
        rec = Record(name, kind, stream, axis, int(bytes), m, n, k, layout, args, self._now())
        self._start_cpu(rec)
        self.records.append(rec)
        return rec

    def begin_op(self, op, **args) -> Record | None:
        """Start recording program op `op` (its name, kind, stream, axis, bytes, GEMM sizes, index)."""
        if not self.enabled:
            return None
        rec = Record(op.name, op.kind, op.stream, op.axis, op.bytes, op.m, op.n, op.k, op.layout,
                     {"index": op.index, **args}, self._now())
        self._start_cpu(rec)
        self.records.append(rec)
        return rec

    def _start_cpu(self, rec: Record) -> None:
        """A compute op on CPU runs on this thread: note its CPU clock (a collective runs on gloo's)."""
        if not self.cuda and rec.stream == "compute":
            rec._cpu = time.thread_time()

    def end(self, rec: Record | None) -> None:
        if rec is not None:
            rec._end = self._now()
            if rec._cpu is not None:
                rec._cpu = time.thread_time() - rec._cpu

    def end_on_completion(self, rec: Record, work) -> None:
        """End `rec` when the collective `work` completes (a callback on its future)."""
        try:
            fut = work.get_future()
        except (AttributeError, RuntimeError):  # a backend without futures: end when issued
            self.end(rec)
            return

        def done(_):
            self.end(rec)

        fut.then(done)

    @contextmanager
    def op(self, name: str, kind: str, stream: str = "compute", **sizes) -> Iterator[Record | None]:
        """Record the ops issued inside the block as one op."""
        rec = self.begin(name, kind, stream, **sizes)
        try:
            yield rec
        finally:
            self.end(rec)

    def _seconds(self, ev: object) -> float:
        if self.cuda:
            return self._origin.elapsed_time(ev) / 1e3  # type: ignore[union-attr]
        return float(ev) - float(self._origin)  # type: ignore[arg-type]

    def spans(self, rank: int, program=None) -> list[Span]:
        """The records as trace spans of `rank` (start relative to the last reset, seconds).

        With the twin's `program`, each span's args carry the program's op index (as the twin's trace
        does); without it, the record's position.
        """
        index = {op.name: op.index for op in program.ops} if program is not None else {}
        if self.cuda:
            torch.cuda.synchronize(self.device)
        out = []
        stream_end: dict[str, float] = {}
        for i, r in enumerate(self.records):
            start = max(self._seconds(r._start), stream_end.get(r.stream, 0.0))
            end = max(self._seconds(r._end) if r._end is not None else start, start)
            stream_end[r.stream] = end
            args = {**span_args(r.kind, r.stream, index.get(r.name, i), r.axis, r.bytes, r.m, r.n, r.k, r.layout),
                    **r.args}
            if r._cpu is not None and r._end is not None:
                args["cpu_us"] = round(min(max(r._cpu, 0.0), end - start) * 1e6, 3)
            out.append(Span(rank, r.name, r.kind, r.stream, start, end - start, args))
        return out


NULL_RECORDER = Recorder(enabled=False)
