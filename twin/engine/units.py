"""The engine of a large pipeline: each stage's units (the forward or the backward of one micro-batch
through one model chunk, twin.program.pipeline.schedule) scheduled as wholes (`run_units`).

A pipeline of P stages, M micro-batches and V chunks per stage has 2 M V units per stage; Megatron-LM's
1T-parameter run (P = 64, M = 512) has 65,536 of them and some 4 million ops. Every unit of a kind
does the same work, so twin.predict.pipe_units times one of each kind with the op-level engine (its
ops, their collectives and overlap) and this engine only places the units in time:
- a stage runs its units one after another, in its schedule's order;
- a unit that does not start the model (a forward on virtual stage v > 0) or end it (a backward on
  v < P V - 1) starts once its input arrived: the neighbouring stage's unit finished, then its send
  ran on that stage's `pipe` stream, sends one after another in the order their units finished
  (`send_s(stage, peer)` seconds each);
- a stage waiting for its input is in the bubble before the send began and exposed `pipe`
  communication while the send was on the wire, as twin.engine.pipeline counts it;
- with `blocking_sends` (Megatron-LM's synchronous sends) a stage also waits for its own send to end
  before its next unit: exposed `pipe` time.

What this leaves out, against the op-level engine: a unit's trailing collectives overlapping the
next unit's compute (a unit ends when its last op does), and a send slowing the compute beside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

Unit = tuple[str, int, int]  # ("F" or "B", micro-batch, chunk)


@dataclass(frozen=True)
class UnitCost:
    """One unit alone on its stage: seconds from its first op to its last, of which its compute
    stream was busy `compute_s` and its wait for each axis's collectives `exposed_s` (seconds)."""

    seconds: float
    compute_s: float
    exposed_s: dict[str, float]


@dataclass
class StageTimeline:
    """What one stage did in the units' part of the step (seconds): when its last unit ended, its
    compute and exposed communication inside units, its bubble and exposed `pipe` time between them,
    and (record) each unit's (unit, start, seconds)."""

    end_s: float = 0.0
    compute_s: float = 0.0
    exposed_s: dict[str, float] = field(default_factory=dict)
    bubble_s: float = 0.0
    pipe_s: float = 0.0
    spans: list[tuple[Unit, float, float]] = field(default_factory=list)


def run_units(schedules: list[list[Unit]], chunks: int, cost: Callable[[int, Unit], UnitCost],
              send_s: Callable[[int, int], float], record: bool = False,
              blocking_sends: bool = False) -> list[StageTimeline]:
    """Place every stage's units (`schedules[k]`, stage k's in order) in time (module docstring).
    cost(stage, unit): the unit's UnitCost; send_s(stage, peer): seconds of one send between the two
    stages. Raises RuntimeError when the schedules deadlock."""
    P, V = len(schedules), chunks
    last_v = P * V - 1
    arrival: dict[tuple[str, int, int], tuple[float, float]] = {}  # (kind, mb, virtual stage) -> (send start, arrival)
    pc = [0] * P
    now = [0.0] * P          # when each stage's previous unit ended
    pipe_free = [0.0] * P    # when each stage's pipe stream is free
    lines = [StageTimeline() for _ in range(P)]
    work = list(range(P))
    queued = [True] * P
    while work:
        k = work.pop()
        queued[k] = False
        units, line = schedules[k], lines[k]
        while pc[k] < len(units):
            kind, j, c = units[pc[k]]
            v = c * P + k
            needs = (kind == "F" and v > 0) or (kind == "B" and v < last_v)
            if needs:
                got = arrival.get((kind, j, v))
                if got is None:
                    break  # woken when the neighbour sends
                sent, arrived = got
                start = max(now[k], arrived)
                if start > now[k]:
                    wire = start - max(now[k], sent)
                    line.pipe_s += wire
                    line.bubble_s += start - now[k] - wire
            else:
                start = now[k]
            c_ = cost(k, (kind, j, c))
            end = start + c_.seconds
            line.compute_s += c_.compute_s
            for a, t in c_.exposed_s.items():
                line.exposed_s[a] = line.exposed_s.get(a, 0.0) + t
            if record:
                line.spans.append(((kind, j, c), start, c_.seconds))
            now[k] = end
            pc[k] += 1
            to = v + 1 if kind == "F" else v - 1
            if 0 <= to <= last_v and not (kind == "F" and v == last_v):
                peer = to % P
                s0 = max(end, pipe_free[k])
                s1 = s0 + send_s(k, peer)
                pipe_free[k] = s1
                arrival[(kind, j, to)] = (s0, s1)
                if blocking_sends:
                    line.pipe_s += s1 - end
                    now[k] = s1
                if not queued[peer] and peer != k:
                    queued[peer] = True
                    work.append(peer)
        line.end_s = now[k]
    stuck = [k for k in range(P) if pc[k] < len(schedules[k])]
    if stuck:
        k = stuck[0]
        raise RuntimeError(f"deadlock: stage {k} waits for the input of unit {schedules[k][pc[k]]}")
    return lines


__all__ = ["StageTimeline", "Unit", "UnitCost", "run_units"]
