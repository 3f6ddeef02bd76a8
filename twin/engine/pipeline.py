"""The engine of a pipelined grid: one iteration of the P stage programs (twin/program/pipeline.py),
coupled by their point-to-point sends and receives (`simulate_pipeline`).

Each stage is simulated by one representative rank, as the symmetric engine (twin.engine.engine) does
for a whole grid: every rank of a stage runs the same program, and the collective model gives an
axis's collectives one time for all its groups. A stage has a compute stream, one stream per axis
and a `pipe` stream; ops on a stream run in program order, each once its deps are done.
- A compute op takes its time alone, times `overlap_slowdown` when a collective of its stage is in
  flight as it starts.
- A collective takes `collective_s(stage, i, concurrent)`, with `concurrent` the other axes of its
  stage in flight as it starts. (Unlike the symmetric engine, a rate is fixed when an op starts:
  nothing is re-rated while it runs.)
- A send takes `p2p_s(stage, i)` (its flows between the two stages' GPUs: twin.costs.p2p) on the
  sender's pipe stream; its receive, which occupies no stream, is done when the send is: a compute
  op that reads the received buffer waits for the receive.
- The all-reduce over the stages (the clipping norm) starts when every stage has reached it.

Breakdown, per stage then averaged over the stages: compute (its compute stream busy); a wait of the
compute stream for a collective is exposed communication of the collective's axis (for the part of
the wait the collective ran); a wait for a receive is exposed `pipe` communication while the send was
on the wire and **bubble** before (the stage had nothing to do until the previous stage produced),
as is a wait for the all-reduce over the stages and the stage's tail after its last compute op
(the pipeline's drain); anything else is idle. compute + exposed + bubble + idle = iteration time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from heapq import heappop, heappush
from typing import Callable

from twin.engine.engine import EngineResult
from twin.engine.sim import NS
from twin.program.grid import AXES
from twin.program.ops import Program
from twin.program.pipeline import PIPE

STREAMS = ("compute",) + AXES + (PIPE,)


@dataclass
class PipelineResult(EngineResult):
    """EngineResult of a pipelined grid: exposed_s has a `pipe` entry (point to point), bubble_s the
    bubble (mean over stages), stage_s each stage's (compute, bubble, idle) seconds."""

    bubble_s: float = 0.0
    stage_s: list[tuple[float, float, float]] = field(default_factory=list)


class _Stage:
    """One stage's streams and done times."""

    def __init__(self, k: int, program: Program):
        self.k, self.ops = k, program.ops
        n = len(self.ops)
        self.done = [-1] * n                       # completion time (ns), -1: not yet
        self.start = [0] * n
        self.queue = {s: [op.index for op in self.ops if op.stream == s and op.kind != "recv"] for s in STREAMS}
        self.pc = {s: 0 for s in STREAMS}
        self.busy = {s: False for s in STREAMS}
        self.inflight: dict[str, int] = {a: 0 for a in AXES}
        self.by_name = {op.name: op.index for op in self.ops if op.kind == "recv"}
        self.prev = [-1] * n                       # the previous op of each op's stream
        for q in self.queue.values():
            for a, b in zip(q, q[1:]):
                self.prev[b] = a
        self.compute_ns = 0
        self.exposed = {a: 0 for a in AXES + (PIPE,)}
        self.bubble = 0
        self.prev_end = 0
        self.last_compute_end = 0


def simulate_pipeline(programs: list[Program], compute_s: list[list[float]],
                      collective_s: Callable[[int, int, frozenset], float], p2p_s: Callable[[int, int], float],
                      overlap_slowdown: float = 1.0, record: bool = False,
                      stage_rank: Callable[[int], int] = lambda k: k) -> PipelineResult:
    """Simulate one iteration of the stage programs `programs` (module docstring). compute_s[k][i]:
    seconds compute op i of stage k takes alone; collective_s(k, i, concurrent), p2p_s(k, i): seconds
    of collective (or send, or pipeline all-reduce) op i of stage k. record: keep spans (rank, op index,
    start s, duration s), the rank of stage k being stage_rank(k) (ops index the stage's program)."""
    stages = [_Stage(k, p) for k, p in enumerate(programs)]
    P = len(stages)
    heap: list[tuple[int, int, int, str]] = []
    seq = 0
    waiters: dict[tuple[int, int], list[tuple[int, str]]] = {}
    arrived: dict[str, list[int]] = {}   # pipeline all-reduce name -> stages that reached it
    spans: list[tuple[int, int, float, float]] = []
    base = [[t * NS for t in cs] for cs in compute_s]
    now = 0
    nops = 0

    def push(t: int, k: int, stream: str) -> None:
        nonlocal seq
        heappush(heap, (t, seq, k, stream))
        seq += 1

    def begin(st: _Stage, stream: str, i: int, dur: float) -> None:
        nonlocal nops
        st.busy[stream] = True
        st.start[i] = now
        d = int(dur + 0.5)
        if stream in st.inflight:
            st.inflight[stream] += 1
        push(now + d, st.k, stream)
        nops += 1

    def attribute(st: _Stage, i: int, waited: int) -> None:
        """The compute stream of `st` starts op i at `now` after waiting since st.prev_end for op
        `waited`: walk back what delayed it (a collective's run is exposed time of its axis; a send on
        the wire exposed pipe time; before a send or the stages' all-reduce started, bubble)."""
        t1, t2, op = st.prev_end, now, st.ops[waited]
        while t2 > t1:
            if op.kind == "recv" or op.axis == PIPE:
                if op.kind == "recv":
                    peer = stages[op.peer]
                    start = peer.start[peer.by_send[op.name]]
                else:
                    start = st.start[op.index]
                t0 = min(t2, max(t1, start))
                st.exposed[PIPE] += t2 - t0
                st.bubble += t0 - t1
                return
            if op.stream not in AXES:
                return  # a compute op of its own: idle
            start = st.start[op.index]
            if start <= t1:
                st.exposed[op.stream] += t2 - t1
                return
            st.exposed[op.stream] += t2 - start
            t2 = start
            before = [d for d in op.deps] + ([st.prev[op.index]] if st.prev[op.index] >= 0 else [])
            if not before:
                return
            op = st.ops[max(before, key=lambda d: st.done[d])]

    def advance(st: _Stage, stream: str) -> None:
        if st.busy[stream]:
            return
        q = st.queue[stream]
        pc = st.pc[stream]
        if pc == len(q):
            return
        i = q[pc]
        op = st.ops[i]
        last_dep, last_t = -1, -1
        for d in op.deps:
            t = st.done[d]
            if t < 0:
                waiters.setdefault((st.k, d), []).append((st.k, stream))
                return
            if t >= last_t:
                last_dep, last_t = d, t
        if stream == "compute":
            if last_dep >= 0:
                attribute(st, i, last_dep)
            factor = overlap_slowdown if any(st.inflight.values()) else 1.0
            begin(st, stream, i, base[st.k][i] * factor)
        elif stream == PIPE and op.kind != "send":  # the all-reduce over the stages
            who = arrived.setdefault(op.name, [])
            who.append(st.k)
            st.busy[stream] = True
            if len(who) == P:
                dur = max(p2p_s(s.k, s.by_all[op.name]) for s in stages) * NS
                for s in stages:
                    s.busy[PIPE] = False
                    begin(s, PIPE, s.by_all[op.name], dur)
        elif stream == PIPE:
            begin(st, stream, i, p2p_s(st.k, i) * NS)
        else:
            conc = frozenset(a for a in AXES if a != stream and st.inflight[a])
            begin(st, stream, i, collective_s(st.k, i, conc) * NS)

    def complete(st: _Stage, i: int) -> None:
        st.done[i] = now
        for k, stream in waiters.pop((st.k, i), ()):
            advance(stages[k], stream)

    for st in stages:
        st.by_send = {}
        st.by_all = {op.name: op.index for op in st.ops if op.axis == PIPE and op.kind not in ("send", "recv")}
    for st in stages:
        for op in st.ops:
            if op.kind == "send":
                st.by_send[op.name.replace(".send", ".recv")] = op.index
    for st in stages:
        for s in STREAMS:
            advance(st, s)
    while heap:
        now, _, k, stream = heappop(heap)
        st = stages[k]
        i = st.queue[stream][st.pc[stream]]
        op = st.ops[i]
        st.busy[stream] = False
        st.pc[stream] += 1
        if stream in st.inflight:
            st.inflight[stream] -= 1
        if stream == "compute":
            st.compute_ns += now - st.start[i]
            st.prev_end = st.last_compute_end = now
        if record:
            spans.append((stage_rank(k), i, st.start[i] / NS, (now - st.start[i]) / NS))
        complete(st, i)
        if op.kind == "send":
            peer = stages[op.peer]
            j = peer.by_name[op.name.replace(".send", ".recv")]
            peer.start[j] = st.start[i]
            if record:
                spans.append((stage_rank(peer.k), j, st.start[i] / NS, (now - st.start[i]) / NS))
            nops += 1
            complete(peer, j)
        advance(st, stream)
    stuck = [(st.k, s) for st in stages for s in STREAMS if st.pc[s] < len(st.queue[s])]
    if stuck:
        k, s = stuck[0]
        st = stages[k]
        raise RuntimeError(f"deadlock: stage {k} stream {s} stopped at op {st.ops[st.queue[s][st.pc[s]]].name}")
    end = max(max(st.done) for st in stages)
    rows = []
    for st in stages:
        st.bubble += end - st.last_compute_end  # the drain: nothing left for this stage to do
        idle = end - st.compute_ns - sum(st.exposed.values()) - st.bubble
        rows.append((st.compute_ns / NS, st.bubble / NS, idle / NS))
    mean = lambda xs: sum(xs) / P  # noqa: E731
    return PipelineResult(iteration_s=end / NS, compute_s=mean([st.compute_ns for st in stages]) / NS,
                          exposed_s={a: mean([st.exposed[a] for st in stages]) / NS for a in AXES + (PIPE,)},
                          idle_s=mean([r[2] for r in rows]), simulated_ops=nops, ranks=P, spans=spans, classes=P,
                          bubble_s=mean([st.bubble for st in stages]) / NS, stage_s=rows)
