"""What a pipelined grid's communication costs: the collectives of its axes on the 5D rank layout, and
the point-to-point sends between stages as flows on the network (`PipelineModel`).

Collectives. A pipelined grid XxYxZxPxD runs each axis's collectives within a stage; every group of
the axis, in every stage, is taken to run at once (as the symmetric engine takes every group of an
axis to), so the x, y, z and data groups are laid out on the job's placement in the 5D rank order
(x fastest, then y, z, the stage, data) and timed by the collective model (twin.costs.collectives).

Sends. A send of stage s to stage t moves `bytes` from every rank of s to the rank of t with the same
x, y, z and data coordinates. All those pairs send at once, and in the steady state of 1F1B the
gradients flow back t -> s while the activations flow s -> t, so a send is timed as one step of
two-member rings over the pairs: flows in both directions, laid out and routed as the library lays
out a ring's (inside a node over the GPU links; across nodes through the NICs, channel-capped), and
shared by max-min fairness. Whether the pairs cross nodes is the placement's doing: with G_x G_y G_z
a multiple of the GPUs per node, every pair crosses. time = step latency + path latency + bytes /
the slowest pair's rate. The all-reduce of one scalar over the stages (the clipping norm) is a ring
over the P stages of such steps: 2 (P - 1) latencies.
"""

from __future__ import annotations

import numpy as np

from twin.costs.collectives import CollectiveModel
from twin.costs.flows import max_min_rates
from twin.program.grid import AXES


class PipelineModel(CollectiveModel):
    """The collective model of a pipelined grid (module docstring), with `p2p_time` for sends."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._pairs: dict[tuple[int, int], tuple[float, float]] = {}

    def _axis_gpus(self, axis: str) -> np.ndarray:
        """(groups, p) GPU ids of every group of `axis` over all stages, members in axis order."""
        g = self.grid
        r = np.arange(g.size).reshape(g.data, g.pipe, g.z, g.y, g.x)
        order = {"x": 4, "y": 3, "z": 2, "data": 0}
        r = np.moveaxis(r, order[axis], -1).reshape(-1, g.axis_size(axis))
        return self.placement.gpu[r]

    def stage_gpus(self, stage: int) -> np.ndarray:
        """GPU ids of the ranks of `stage`, in rank order (x fastest, then y, z, data)."""
        g = self.grid
        r = np.arange(g.size).reshape(g.data, g.pipe, g.z * g.y * g.x)[:, stage, :].reshape(-1)
        return self.placement.gpu[r]

    def pair(self, a: int, b: int) -> tuple[float, float]:
        """(latency s, rate bytes/s) of the sends between stages a and b (either direction)."""
        key = (min(a, b), max(a, b))
        hit = self._pairs.get(key)
        if hit is None:
            gpus = np.stack([self.stage_gpus(key[0]), self.stage_gpus(key[1])], axis=1)
            flows = self._ring_flows(gpus)
            rates = max_min_rates(flows.routes, self.capacity, flows.caps)
            rate = flows.slowest(rates)
            latency = self.system.collectives.step_latency + flows.path_latency(self.net.latency)
            hit = self._pairs[key] = (latency, rate)
        return hit

    def p2p_time(self, a: int, b: int, nbytes: int) -> float:
        """Seconds of a send of `nbytes` bytes from every rank of stage a to its peer on stage b."""
        if nbytes <= 0 or a == b:
            return 0.0
        latency, rate = self.pair(a, b)
        return latency + nbytes / rate

    def stages_all_reduce_time(self, nbytes: int) -> float:
        """Seconds of an all-reduce of `nbytes` over the P stages (a ring of sends between neighbours)."""
        P = self.grid.pipe
        if P == 1:
            return 0.0
        step = max(self.p2p_time(s, (s + 1) % P, -(-nbytes // P)) for s in range(P))
        return 2 * (P - 1) * step


def pipeline_timers(programs, model):
    """(collective_s(stage, i, concurrent), p2p_s(stage, i)) of the stage programs on `model` (a
    PipelineModel, or any model with .time, .p2p_time and .stages_all_reduce_time)."""
    def collective_s(k: int, i: int, concurrent: frozenset) -> float:
        op = programs[k].ops[i]
        return float(model.time(op.kind, op.axis, op.bytes, concurrent=concurrent))

    def p2p_s(k: int, i: int) -> float:
        op = programs[k].ops[i]
        if op.kind == "send":
            return float(model.p2p_time(k, op.peer, op.bytes))
        return float(model.stages_all_reduce_time(op.bytes))

    return collective_s, p2p_s


__all__ = ["AXES", "PipelineModel", "pipeline_timers"]
