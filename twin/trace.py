"""Chrome trace event JSON, the one schema for the twin's timelines and the backend's records.

Layout (as PyTorch's profiler writes it, so Perfetto and other tools read it): one process per rank
(pid = rank), one thread per stream (tid = index in STREAMS: compute, x, y, z, data), complete ("X")
events with start and duration in microseconds. Each event's args carry the op's kind, stream, axis,
bytes, flops and GEMM sizes, so a twin trace and a backend trace diff op by op by name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from twin.common import write_atomic
from twin.program import STREAMS, Op


@dataclass(frozen=True)
class Span:
    """One op as it ran (or was simulated) on one rank: start and duration in seconds."""

    rank: int
    name: str
    kind: str
    stream: str
    start_s: float
    duration_s: float
    args: dict = field(default_factory=dict, compare=False, hash=False)


def op_args(op: Op) -> dict:
    """The args of an op's trace event: what identifies it across twin and backend."""
    args = {"kind": op.kind, "stream": op.stream, "index": op.index}
    if op.axis:
        args.update(axis=op.axis, bytes=op.bytes)
    if op.kind == "gemm":
        args.update(m=op.m, n=op.n, k=op.k, layout=op.layout)
    if op.flops:
        args["flops"] = op.flops
    return args


def trace_events(spans: list[Span], metadata: dict | None = None) -> dict:
    """The trace as a JSON-ready dict: process and thread names, then one X event per span."""
    events = []
    for rank in sorted({s.rank for s in spans}):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                       "args": {"name": f"rank {rank}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0,
                       "args": {"sort_index": rank}})
        for tid, stream in enumerate(STREAMS):
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                           "args": {"name": stream}})
    for s in sorted(spans, key=lambda s: (s.rank, s.start_s, STREAMS.index(s.stream))):
        events.append({"name": s.name, "cat": s.kind, "ph": "X", "pid": s.rank,
                       "tid": STREAMS.index(s.stream), "ts": round(s.start_s * 1e6, 3),
                       "dur": round(s.duration_s * 1e6, 3), "args": {"stream": s.stream, **s.args}})
    return {"traceEvents": events, "displayTimeUnit": "ms", "metadata": metadata or {}}


def write_trace(path: str | Path, spans: list[Span], metadata: dict | None = None) -> None:
    """Write spans as Chrome trace JSON (atomically: a temporary file, then a rename)."""
    write_atomic(path, json.dumps(trace_events(spans, metadata), separators=(",", ":"), sort_keys=True))


def read_trace(path: str | Path) -> list[Span]:
    """Read the X events of a trace written by either side back into spans."""
    data = json.loads(Path(path).read_text())
    out = []
    for e in data["traceEvents"]:
        if e.get("ph") != "X":
            continue
        args = dict(e.get("args", {}))
        stream = args.pop("stream", STREAMS[e["tid"]])
        out.append(Span(e["pid"], e["name"], e.get("cat", ""), stream, e["ts"] / 1e6, e["dur"] / 1e6, args))
    return out
