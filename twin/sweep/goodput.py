"""Expected wall time and goodput of a training run under node failures, with checkpoints.

The model (Daly 2006, the "higher-order" estimate; J. T. Daly, "A higher order estimate of the optimum
checkpoint interval for restart dumps", Future Generation Computer Systems 22(3), 2006): failures of
the job arrive as a Poisson process of mean time between failures M (a node's MTBF divided by the
job's node count: any node's failure stops the job). The run is cut into segments of tau of work, each
followed by a checkpoint written in delta; after a failure the job restarts in R and redoes the work
since the last checkpoint. The expected wall time of one segment, restarts and rework included, is

    E = M exp(R / M) (exp((tau + delta) / M) - 1)

so the goodput (useful work per wall second) is tau / E and a run of T seconds of work takes T E / tau
(valid when T is many segments). It counts failures during restarts and checkpoints too; it assumes
a restart always resumes from the last checkpoint, and no planned downtime.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Goodput:
    """goodput: useful work per wall second (0..1]; job_mtbf_h: the job's mean time between failures;
    wall_s: expected wall time of the run; failures: expected failures during it."""

    goodput: float
    job_mtbf_h: float
    wall_s: float
    failures: float


def under_failures(work_s: float, nodes: int, node_mtbf_h: float, every_s: float, write_s: float,
                   restart_s: float) -> Goodput:
    """Daly's expected wall time of `work_s` seconds of training on `nodes` nodes (see the module
    docstring); every_s, write_s, restart_s: the checkpoint interval (work), its write and a restart."""
    if nodes < 1 or node_mtbf_h <= 0 or every_s <= 0 or write_s < 0 or restart_s < 0 or work_s < 0:
        raise ValueError("under_failures: nodes, MTBF and interval must be positive, times non-negative")
    m = node_mtbf_h * 3600.0 / nodes
    x = (every_s + write_s) / m
    if x + restart_s / m > 700:  # exp overflows: the job fails far more often than it checkpoints
        return Goodput(0.0, m / 3600.0, math.inf, math.inf)
    segment = m * math.exp(restart_s / m) * math.expm1(x)
    g = every_s / segment
    wall = work_s / g
    return Goodput(g, m / 3600.0, wall, wall / m)
