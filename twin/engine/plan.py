"""What a run of the engine (twin.engine.engine) derives from a program's streams, axes and deps alone: a
Plan (each stream's ops in order, each op's position in its stream, its dependencies on other
streams, which ops others wait for), kept for the next program alike (a grid search's class-mates
differ only in sizes, twin.program.program.regrid); and `first_alike`, the first collective of each op's
(kind, axis, bytes), by which a run asks a collective's time once per distinct collective
(simulate_program's by_size)."""

from __future__ import annotations

from topologies import caches
from twin.program.grid import AXES


class Plan:
    """What a run derives from the program's streams, axes and deps alone (kept for programs alike).

    by_stream: stream -> its ops in program order; pos[i]: op i's position in its stream; axis_of[i];
    cross[i]: op i's dependencies on other streams (a stream's own earlier ops are done by stream
    order); waited_on[i]: an op of another stream depends on op i; counted[j]: every dependency of
    op j has j as its only such dependent, so nothing else ever waits for them and a group may wait
    for all its members' at once (GroupStream); todo: stream -> [(op, cross deps)] in order."""

    __slots__ = ("by_stream", "pos", "axis_of", "cross", "waited_on", "counted", "todo")

    def __init__(self, ops: list):
        n = len(ops)
        streams = [op.stream for op in ops]
        self.by_stream = by_stream = {s: [] for s in ("compute",) + AXES}
        for op in ops:
            by_stream[op.stream].append(op.index)
        self.pos = pos = [0] * n
        for stream_ops in by_stream.values():
            for k, i in enumerate(stream_ops):
                pos[i] = k
        # the axis whose stream a collective runs on (the expert axes' collectives: the data stream's)
        self.axis_of = [op.stream if op.axis in ("expert", "edata") else op.axis for op in ops]
        self.cross = cross = []
        dependents = [0] * n
        for op, s in zip(ops, streams):
            deps = op.deps
            if len(deps) == 1:  # most ops
                d = deps[0]
                if streams[d] == s:
                    deps = ()
                else:
                    dependents[d] += 1
            elif deps:
                deps = tuple([d for d in deps if streams[d] != s])
                for d in deps:
                    dependents[d] += 1
            cross.append(deps)
        self.waited_on = bytearray(k > 0 for k in dependents)
        self.counted = counted = bytearray(b"\x01" * n)
        for j, deps in enumerate(cross):
            for d in deps:
                if dependents[d] != 1:
                    counted[j] = 0
                    break
        self.todo = {k: [(i, cross[i]) for i in stream_ops] for k, stream_ops in by_stream.items()}


# (streams, axes, deps of every op) -> its plan, the latest PLANS_KEPT (programs alike share one)
_PLANS: dict[tuple, Plan] = caches.register("twin.engine.plan.plans", {})
PLANS_KEPT = 16


def plan_of(ops: list) -> Plan:
    """The Plan of a program's ops, made once for ops alike in streams, axes and deps (a grid search
    runs programs that differ only in sizes: twin.program.program.regrid)."""
    key = (tuple([op.stream for op in ops]), tuple([op.axis for op in ops]), tuple([op.deps for op in ops]))
    plan = _PLANS.pop(key, None)
    if plan is None:
        plan = Plan(ops)
        if len(_PLANS) >= PLANS_KEPT:
            del _PLANS[next(iter(_PLANS))]
    _PLANS[key] = plan  # the latest last
    return plan


def first_alike(ops: list, plan: Plan) -> list[int]:
    """For each op, the index of the first collective with its (kind, axis, bytes) (itself if none)."""
    first: dict[tuple, int] = {}
    same = list(range(len(ops)))
    for axis in AXES:
        for i in plan.by_stream[axis]:
            op = ops[i]
            same[i] = first.setdefault((op.kind, op.axis, op.bytes), i)
    return same
