"""Spans drawn at the spread measured: what time-slicing adds to a CPU step beyond its ops' mean spans.

Where more ranks than cores share a CPU node, the scheduler time-slices them, and an op's span varies
from rank to rank and step to step far more than its mean shows: `backend bench` records each op's
`spread` (the coefficient of variation of its span over the ranks and the steps; with 8 ranks on 2
cores about 0.6-0.9 for compute ops and for the z all-gathers and reduce-scatters). The twin's
timeline holds every op at its mean span, in lockstep; but a collective overlapped with compute is
exposed by E[max(0, X - w)] (X its span, w the compute that hides it), which is more than
max(0, E[X] - w) when X varies. So a timeline of mean spans overlaps compute with collectives more
than the ranks do, its step comes out short and its compute share high, and the stretch that the
busy shares give (twin.host.cores) comes out high: on the grids whose z all-gathers are prefetched (z = 4
on 8 ranks) the predicted stretch ran well over the measured one.

The twin therefore simulates a CPU step DRAWS times with each op's span times a factor drawn
log-normal with mean 1 and the spread the profile's `span_spread` gives its class (seeded: the
result is deterministic), and takes the mean of the draws:
- a compute op (less the host time before it, which is the executor's own) at the spread of the
  compute ops;
- a collective that the compute op after its issue does not wait for (twin.host.order.charged_issues:
  it runs beside compute) at the spread of its kind and axis. A collective that its rank waits for
  at once is not drawn: its span is long on the ranks that arrived early and short on the last one,
  the mirror of their compute before it, so drawing it apart from that compute would count the
  ranks' drift twice, while its mean span, exposed whole, already holds the mean wait.
The host model (twin.host.sharing) takes the busy shares (and so the stretch) and the iteration as
their means over the draws; the recorded timeline stays the one of mean spans. The fit of the
collective core load replays bench's recorded steps the same way, so the load and the shares it
weighs come from one timeline model.
What this changed on the measured CPU loops is in their dated record in docs/ (the page on fitting
profiles).
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import replace
from typing import Callable

from twin.host.order import charged_issues

DRAWS = 16  # simulations per step (8 antithetic pairs)
SEED = 1


def spread_key(kind: str, axis: str) -> str:
    """The profile's `span_spread` key of a collective of this kind over this axis ("all_gather_z")."""
    return f"{kind}_{axis}"


def op_spreads(ops, spread: dict[str, float]) -> list[float]:
    """Per op of a program (in the order the host runs them), the coefficient of variation its span is
    drawn at (module docstring): "compute" for a compute op; for a collective the compute op after
    whose issue does not wait for, its kind and axis's, else "collective" (the median over every
    class measured); 0 for a collective its rank waits for at once."""
    beside = {c.index for cs in charged_issues(ops).values() for c in cs}
    out = []
    for op in ops:
        if not op.is_collective:
            out.append(spread.get("compute", 0.0))
        elif op.index in beside:
            out.append(spread.get(spread_key(op.kind, op.axis), spread.get("collective", 0.0)))
        else:
            out.append(0.0)
    return out


def factors(spreads: list[float], normals: list[float]) -> list[float]:
    """One draw: per op, a log-normal factor of mean 1 and the op's coefficient of variation, from a
    standard normal deviate per op (`normals`)."""
    out = []
    for cv, z in zip(spreads, normals):
        s2 = math.log(1.0 + cv * cv)
        out.append(math.exp(z * math.sqrt(s2) - s2 / 2.0) if cv > 0 else 1.0)
    return out


def draws(spreads: list[float]) -> list[list[float]]:
    """DRAWS draws of factors (seeded), in antithetic pairs: the second of each pair takes the first's
    deviates negated, so that a long span in one is a short one in the other and the mean over few
    draws settles sooner."""
    rng = random.Random(SEED)
    out = []
    for _ in range(DRAWS // 2):
        z = [rng.gauss(0.0, 1.0) for _ in spreads]
        out += [factors(spreads, z), factors(spreads, [-v for v in z])]
    return out


def drawn_runs(prog, compute_s: list[float], hosts: list[float], collective_s: Callable[[int, frozenset], float],
               spread: dict[str, float], engine: Callable, **engine_kw) -> list:
    """DRAWS engine results of the program (twin.engine.engine.simulate_program, or a stand-in with its
    signature: `engine`), each with every op's time times its drawn factor: compute_s[i] (seconds,
    the host time hosts[i] before it included and not drawn) and collective_s(i, concurrent)
    (seconds). Seeded: the same arguments give the same draws."""
    kw = {**engine_kw, "by_size": False}  # a drawn collective's time depends on the op, not its size only
    runs = []
    for f in draws(op_spreads(prog.ops, spread)):
        compute = [c if op.is_collective else (c - h) * x + h for op, c, h, x in zip(prog.ops, compute_s, hosts, f)]
        runs.append(engine(prog, compute, lambda i, concurrent, f=f: collective_s(i, concurrent) * f[i], **kw))
    return runs


def mean_result(plain, runs: list):
    """The engine result `plain` (the timeline of mean spans, its spans kept) with the iteration and
    its breakdown (seconds) replaced by their means over the drawn `runs`."""
    axes = plain.exposed_s.keys()
    return replace(plain, iteration_s=statistics.fmean(r.iteration_s for r in runs),
                   compute_s=statistics.fmean(r.compute_s for r in runs),
                   exposed_s={a: statistics.fmean(r.exposed_s.get(a, 0.0) for r in runs) for a in axes},
                   idle_s=statistics.fmean(r.idle_s for r in runs))


def mean_shares(shares: list[tuple[float, float]]) -> tuple[float, float]:
    """The mean over draws of twin.host.cores.busy_shares' (compute, collective) shares."""
    return statistics.fmean(c for c, _ in shares), statistics.fmean(m for _, m in shares)
