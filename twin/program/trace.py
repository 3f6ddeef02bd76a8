"""The one trace schema of the twin's timelines and the backend's records: a run folder of per-rank
Chrome trace event files, laid out as PyTorch's profiler writes them, so that Perfetto opens each
file and Holistic Trace Analysis (HTA) reads the folder.

    write_trace("runs/tiny/trace", spans, metadata, step=7)   # -> rank0.json, rank1.json, ...
    spans = read_trace("runs/tiny/trace")                     # every rank's spans back

One file per rank, `rank<R>.json`, holding:
- `"distributedInfo": {"rank": R, "world_size": N, "backend": ...}` on the file's first line
  (HTA finds a file's rank with the regex `"rank":\\s+(\\d+)`, so the space after the colon matters);
- one process (pid = R) with a host thread (tid 1) carrying the iteration annotation
  `ProfilerStep#<step>` (cat `user_annotation`) that spans the iteration, and one thread per stream
  with an integer stream id (`STREAM_IDS`: compute 7, as CUDA's default stream shows in PyTorch
  traces, then x, y, z, data 8..11);
- one complete ("X") event per op, cat `kernel`, start and duration in microseconds, with
  `args.stream` the integer stream id and `args.device` the rank. Compute kernels carry the
  program's op name; a collective carries the name NCCL/RCCL give their kernels
  (`ncclDevKernel_AllGather_RING_LL`, ...), which is how HTA tells communication from computation,
  and the program's op name in `args.op`. The other args: kind, stream name, axis, bytes, flops,
  GEMM sizes, the program's op index; a twin trace and a backend trace diff op by op by `args.op`.

Slices on one stream never overlap (a GPU stream runs one kernel at a time, and Perfetto and HTA
both assume it): a span that starts before the previous span of its stream has ended (an
asynchronous collective queued behind another) is written from that end, with the time it waited
in `args.queued_us`.

A twin trace also holds the engine's attribution of the compute stream's waits: on a thread "waits"
(tid `WAITS_TID`), one event `exposed <axis>` (cat `twin_wait`, not a kernel: HTA and `read_trace`
leave it out) per stretch that the engine's breakdown counts as exposed communication of that axis
(`read_waits` reads them back). Pictures and `trace_breakdown` draw these where a trace has them,
and only for a measured trace (which has none) fall back to `compute_gaps`' guess.
"""

from __future__ import annotations

import bisect
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from topologies.common import finite_json, write_atomic
from twin.program.program import STREAMS, Op

HOST_TID = 1
WAITS_TID = 2  # the twin's attributed waits (module docstring)
WAIT_CAT = "twin_wait"
TRACE_STREAMS = STREAMS + ("pipe",)  # and a pipeline stage's sends and receives (twin/program/pipeline.py)
STREAM_IDS = {s: 7 + i for i, s in enumerate(TRACE_STREAMS)}
STREAM_OF_ID = {v: k for k, v in STREAM_IDS.items()}
# Kernel names of the collective libraries (NCCL 2.19+; RCCL keeps NCCL's names).
COMM_KERNELS = {"all_gather": "ncclDevKernel_AllGather_RING_LL",
                "reduce_scatter": "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL",
                "all_reduce": "ncclDevKernel_AllReduce_Sum_f32_RING_LL"}
RANK_FILE = re.compile(r"rank(\d+)\.json$")


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


def covered_share(span: Span, others: list[Span]) -> float:
    """Fraction (0-1) of `span`'s duration during which one of the spans `others` was running."""
    if span.duration_s <= 0:
        return 0.0
    a, b = span.start_s, span.start_s + span.duration_s
    ivs = sorted((max(a, o.start_s), min(b, o.start_s + o.duration_s)) for o in others
                 if o.start_s < b and o.start_s + o.duration_s > a)
    covered, end = 0.0, a
    for lo, hi in ivs:
        lo = max(lo, end)
        if hi > lo:
            covered += hi - lo
            end = hi
    return min(1.0, covered / span.duration_s)  # start + duration - start may round above duration


def wait_span(rank: int, start_s: float, end_s: float, axis: str) -> Span:
    """A stretch of `rank`'s compute stream that the engine blames on a collective of `axis` (exposed
    communication), as a span on the pseudo-stream "waits"."""
    return Span(rank, f"exposed {axis}", "exposed", "waits", start_s, end_s - start_s, {"axis": axis})


@dataclass(frozen=True)
class HostGap:
    """The time between two consecutive compute ops of one rank (seconds; 0 where they touch), with
    what its collectives did meanwhile: the kinds of those in flight during it (spans of 0 s left
    out), whether none was issued or completed in it (`quiet`), and the one that completed last in
    it (the collective the next compute op waited for; None if none did) with the time from that
    completion to the next op's start."""

    seconds: float
    in_flight: frozenset[str]
    quiet: bool
    waited: Span | None = None
    wake_s: float = 0.0


def host_gaps(compute: list[Span], collectives: list[Span]) -> list[HostGap]:
    """The gaps between consecutive ops of one rank's compute spans (sorted by start), each with what
    the rank's `collectives` did during it (HostGap): what backend.bench.steps records as the
    executor's host time, free or beside a collective in flight, read off a run's trace."""
    out = []
    for a, b in zip(compute, compute[1:]):
        g0, g1 = a.start_s + a.duration_s, b.start_s
        done = [c for c in collectives if g0 < c.start_s + c.duration_s <= g1]
        in_flight = frozenset(c.kind for c in collectives
                              if c.duration_s > 0 and c.start_s < g1 and c.start_s + c.duration_s > g0)
        quiet = not done and not any(g0 <= c.start_s < g1 for c in collectives)
        last = max(done, key=lambda c: c.start_s + c.duration_s) if done else None
        out.append(HostGap(max(0.0, g1 - g0), in_flight, quiet, last,
                           b.start_s - (last.start_s + last.duration_s) if last else 0.0))
    return out


def op_args(op: Op) -> dict:
    """The args of an op's trace event: what identifies it across twin and backend."""
    return span_args(op.kind, op.stream, op.index, op.axis, op.bytes, op.m, op.n, op.k, op.layout, op.flops)


def span_args(kind: str, stream: str, index: int, axis: str | None = None, bytes: int = 0, m: int = 0,
              n: int = 0, k: int = 0, layout: str = "", flops: float = 0) -> dict:
    """The args of a span (both sides build them here): kind, stream, program index; a collective's
    axis and bytes; a GEMM's m, n, k and layout; flops when known."""
    args = {"kind": kind, "stream": stream, "index": index}
    if axis:
        args.update(axis=axis, bytes=bytes)
    if kind == "gemm":
        args.update(m=m, n=n, k=k, layout=layout)
    if flops:
        args["flops"] = flops
    return args


def kernel_name(span: Span) -> str:
    """The event name: a collective library's kernel name for a collective, else the op's name."""
    return COMM_KERNELS.get(span.kind, span.name)


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def rank_events(rank: int, spans: list[Span], step: int = 1, waits: list[Span] = ()) -> list[dict]:
    """The events of one rank's file: names of process and threads, the ProfilerStep annotation,
    one kernel event per span (slices on a stream made disjoint, see the module docstring), and
    the twin's attributed `waits` (wait_span) on their own thread."""
    events = [
        {"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}},
        {"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}},
        {"name": "thread_name", "ph": "M", "pid": rank, "tid": HOST_TID, "args": {"name": "host"}},
    ]
    for stream, tid in STREAM_IDS.items():
        events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                       "args": {"name": f"stream {tid} {stream}"}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": rank, "tid": tid,
                       "args": {"sort_index": tid}})
    if not spans:
        return events
    begin = min(s.start_s for s in spans)
    end = max(s.start_s + s.duration_s for s in spans)
    events.append({"name": f"ProfilerStep#{step}", "cat": "user_annotation", "ph": "X", "pid": rank,
                   "tid": HOST_TID, "ts": _us(begin), "dur": _us(end - begin), "args": {}})
    free = {}  # stream -> end (us) of its last written slice
    for corr, s in enumerate(sorted(spans, key=lambda s: (TRACE_STREAMS.index(s.stream), s.start_s)), 1):
        tid = STREAM_IDS[s.stream]
        ts, stop = _us(s.start_s), _us(s.start_s + s.duration_s)
        args = {**s.args, "device": rank, "stream": tid, "stream_name": s.stream, "correlation": corr}
        if s.kind in COMM_KERNELS:
            args["op"] = s.name
        if ts < free.get(tid, ts):
            args["queued_us"] = round(free[tid] - ts, 3)
            ts = free[tid]
        stop = max(stop, ts)
        free[tid] = stop
        events.append({"name": kernel_name(s), "cat": "kernel", "ph": "X", "pid": rank, "tid": tid,
                       "ts": ts, "dur": round(stop - ts, 3), "args": args})
    if waits:
        events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": WAITS_TID,
                       "args": {"name": "waits (the twin's exposed communication)"}})
    for w in waits:
        events.append({"name": w.name, "cat": WAIT_CAT, "ph": "X", "pid": rank, "tid": WAITS_TID,
                       "ts": _us(w.start_s), "dur": _us(w.duration_s), "args": {"axis": w.args["axis"]}})
    events.sort(key=lambda e: (e.get("ts", -1), e["tid"]))
    return events


def rank_file_text(rank: int, spans: list[Span], world_size: int, metadata: dict | None = None,
                   step: int = 1, backend: str = "nccl", waits: list[Span] = ()) -> str:
    """One rank's trace file: distributedInfo on the first line, then one event per line."""
    info = finite_json({"rank": rank, "world_size": world_size, "backend": backend}, separators=(", ", ": "))
    lines = [finite_json(e, separators=(",", ":")) for e in rank_events(rank, spans, step, waits)]
    return ('{"distributedInfo": ' + info + ',\n"schemaVersion": 1, "displayTimeUnit": "ms",\n'
            '"metadata": ' + finite_json(metadata or {}, sort_keys=True) + ',\n'
            '"traceEvents": [\n' + ",\n".join(lines) + "\n]}\n")


def write_trace(folder: str | Path, spans: list[Span], metadata: dict | None = None, step: int = 1,
                world_size: int | None = None, backend: str = "nccl", waits: list[Span] | None = None) -> list[Path]:
    """Write spans as a run folder of per-rank trace files (`rank<R>.json`, each written atomically),
    with the twin's attributed `waits` (wait_span) where given;
    returns their paths. Rank files of an earlier run in the folder are removed first, so that HTA,
    which reads every file of the folder, sees this run only. `world_size` defaults to the number of
    ranks in `spans` (the twin's symmetric mode writes only its representative rank)."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise NotADirectoryError(f"{folder} is a file; a trace is a folder of per-rank files: name a folder")
    folder.mkdir(parents=True, exist_ok=True)
    by_rank: dict[int, list[Span]] = {}
    for s in spans:
        by_rank.setdefault(s.rank, []).append(s)
    for old in folder.glob("rank*.json"):
        if RANK_FILE.search(old.name) and int(RANK_FILE.search(old.name).group(1)) not in by_rank:
            old.unlink()
    world = world_size or len(by_rank)
    paths = []
    for rank in sorted(by_rank):
        path = folder / f"rank{rank}.json"
        mine = [w for w in waits or () if w.rank == rank]
        write_atomic(path, rank_file_text(rank, by_rank[rank], world, metadata, step, backend, mine))
        paths.append(path)
    return paths


def trace_files(path: str | Path) -> list[Path]:
    """The rank files of a run folder (ordered by rank), or [path] for one file."""
    path = Path(path)
    if path.is_dir():
        files = [p for p in path.iterdir() if RANK_FILE.search(p.name)]
        return sorted(files, key=lambda p: int(RANK_FILE.search(p.name).group(1)))
    return [path]


def read_metadata(path: str | Path) -> dict:
    """The run metadata of a trace (folder or file): that of its first rank file."""
    files = trace_files(path)
    return json.loads(files[0].read_text()).get("metadata", {}) if files else {}


def read_trace(path: str | Path) -> list[Span]:
    """Read the kernel events of a run folder (or of one rank file) back into spans, under the
    program's op names, in the order (rank, start)."""
    out = []
    for file in trace_files(path):
        data = json.loads(Path(file).read_text())
        for e in data["traceEvents"]:
            if e.get("ph") != "X" or e.get("cat") != "kernel":
                continue
            args = dict(e.get("args", {}))
            stream = args.pop("stream_name", None) or STREAM_OF_ID.get(args.get("stream"), "compute")
            for key in ("stream", "device", "correlation", "queued_us"):
                args.pop(key, None)
            name = args.pop("op", e["name"])
            args["stream"] = stream
            out.append(Span(e["pid"], name, args.get("kind", ""), stream, e["ts"] / 1e6, e["dur"] / 1e6, args))
    out.sort(key=lambda s: (s.rank, s.start_s))
    return out


def read_waits(path: str | Path) -> list[Span] | None:
    """The twin's attributed waits of a run folder (or rank file) as wait_span spans, in the order
    (rank, start); None when the trace has none (a measured trace)."""
    out, found = [], False
    for file in trace_files(path):
        for e in json.loads(Path(file).read_text())["traceEvents"]:
            if e.get("ph") == "M" and e.get("tid") == WAITS_TID:
                found = True
            elif e.get("ph") == "X" and e.get("cat") == WAIT_CAT:
                a = e["ts"] / 1e6
                out.append(wait_span(e["pid"], a, a + e["dur"] / 1e6, e["args"]["axis"]))
    out.sort(key=lambda s: (s.rank, s.start_s))
    return out if found else None


def attributed_gaps(spans: list[Span], waits: list[Span], end_s: float | None = None,
                    begin_s: float = 0.0) -> list[tuple[float, float, str | None]]:
    """One rank's stretches with its compute stream not running, as the engine attributed them:
    (start, end, axis) for each of its `waits` (wait_span), and (start, end, None) for the rest of the
    time from `begin_s` to `end_s` (default: the last span's end) that no compute op covers (idle)."""
    end_s = max((s.start_s + s.duration_s for s in spans), default=begin_s) if end_s is None else end_s
    out = [(w.start_s, w.start_s + w.duration_s, w.args["axis"]) for w in waits if w.duration_s > 0]
    taken = _union([(s.start_s, s.start_s + s.duration_s) for s in spans if s.stream == "compute"]
                   + [(a, b) for a, b, _ in out])
    t = begin_s
    for a, b in taken + [(end_s, end_s)]:
        if a > t + 1e-12:
            out.append((t, min(a, end_s), None))
        t = max(t, b)
    return sorted(out)


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def compute_gaps(spans: list[Span]) -> list[tuple[float, float, str | None]]:
    """The stretches of one rank's iteration when its compute stream runs nothing: (start, end, axis)
    in seconds, axis the communication stream it waits on (a stretch where several axes run goes to
    the one whose collective ends last, the one compute most likely waits for) or None when nothing
    runs at all (idle). A guess from the spans alone, for measured traces: a twin trace carries the
    engine's own attribution (read_waits, attributed_gaps), which pictures draw instead."""
    if not spans:
        return []
    begin = min(s.start_s for s in spans)
    end = max(s.start_s + s.duration_s for s in spans)
    busy = _union([(s.start_s, s.start_s + s.duration_s) for s in spans if s.stream == "compute"])
    comm = sorted((s.start_s, s.start_s + s.duration_s, s.stream) for s in spans if s.stream != "compute")
    gaps, t = [], begin
    for a, b in busy:
        if a > t:
            gaps.append((t, a))
        t = max(t, b)
    if end > t:
        gaps.append((t, end))
    starts = [c[0] for c in comm]
    longest = max((b - a for a, b, _ in comm), default=0.0)
    out: list[tuple[float, float, str | None]] = []
    for ga, gb in gaps:
        lo = bisect.bisect_left(starts, ga - longest)
        hi = bisect.bisect_right(starts, gb)
        near = [c for c in comm[lo:hi] if c[1] > ga and c[0] < gb and c[1] > c[0]]
        cuts = sorted({ga, gb, *(x for a, b, _ in near for x in (a, b) if ga < x < gb)})
        for a, b in zip(cuts, cuts[1:]):
            running = [(e, axis) for s0, e, axis in near if s0 <= a and e >= b]
            axis = max(running)[1] if running else None
            if out and out[-1][1] == a and out[-1][2] == axis:
                out[-1] = (out[-1][0], b, axis)
            else:
                out.append((a, b, axis))
    return out


def trace_breakdown(spans: list[Span], waits: list[Span] | None = None) -> dict:
    """Where one iteration's time goes, measured on a trace (seconds, mean over its ranks), in the
    simulator's terms: `compute` (the compute stream runs an op), `exposed_comm[axis]` (the compute
    stream is idle while a collective of that axis runs), `idle` (nothing runs), and `iteration`
    (first start to last end). These are HTA's temporal breakdown (compute, non-compute, idle) with
    non-compute split by axis. With the twin's `waits` (read_waits) the split is the engine's own
    (attributed_gaps); without (a measured trace) it is `compute_gaps`' guess."""
    by_rank: dict[int, list[Span]] = {}
    for s in spans:
        by_rank.setdefault(s.rank, []).append(s)
    waits_of: dict[int, list[Span]] = {}
    for w in waits or ():
        waits_of.setdefault(w.rank, []).append(w)
    total = {"compute": 0.0, "exposed_comm": {a: 0.0 for a in STREAMS[1:]}, "idle": 0.0, "iteration": 0.0}
    for mine in by_rank.values():
        begin = min(s.start_s for s in mine)
        end = max(s.start_s + s.duration_s for s in mine)
        total["compute"] += sum(b - a for a, b in _union([(s.start_s, s.start_s + s.duration_s)
                                                          for s in mine if s.stream == "compute"]))
        total["iteration"] += end - begin
        gaps = compute_gaps(mine) if waits is None else attributed_gaps(mine, waits_of.get(mine[0].rank, []), end, begin)
        for a, b, axis in gaps:
            if axis is None:
                total["idle"] += b - a
            else:
                total["exposed_comm"][axis] = total["exposed_comm"].get(axis, 0.0) + b - a
    n = max(len(by_rank), 1)
    return {"compute": total["compute"] / n, "exposed_comm": {a: v / n for a, v in total["exposed_comm"].items()},
            "idle": total["idle"] / n, "iteration": total["iteration"] / n}


def check_nesting(path: str | Path) -> list[str]:
    """Problems that would break Perfetto's or HTA's reading of a trace: slices on one track that
    overlap without nesting, a file without a rank, non-integer stream ids. [] when there are none."""
    problems = []
    for file in trace_files(path):
        text = Path(file).read_text()
        if not re.search(r'"rank":\s+(\d+)', text.split("\n", 1)[0]):
            problems.append(f"{file}: no distributedInfo rank on the first line")
        tracks: dict[tuple, list] = {}
        for e in json.loads(text)["traceEvents"]:
            if e.get("ph") == "X":
                tracks.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"], e["name"]))
                if e.get("cat") == "kernel" and not isinstance(e["args"].get("stream"), int):
                    problems.append(f"{file}: {e['name']} has a non-integer stream")
        for key, slices in tracks.items():
            slices.sort(key=lambda t: (t[0], -t[1]))
            stack: list[tuple] = []
            for a, b, name in slices:
                while stack and stack[-1][1] <= a + 1e-6:
                    stack.pop()
                if stack and b > stack[-1][1] + 1e-6:
                    problems.append(f"{file}: {name} at {a} us overlaps {stack[-1][2]} on track {key}")
                stack.append((a, b, name))
    return problems
