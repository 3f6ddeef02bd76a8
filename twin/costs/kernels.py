"""Kernel time model: how long each compute op of the program takes on one GPU (seconds).

- GEMM: flops / (reached large-GEMM flop/s x shape efficiency) x layout penalty, or at least the time
  to move its bytes through HBM. The shape efficiency is the measured one when the profile's table has
  a point near the shape (within a factor 2 in m, n and k); else a roofline with quantization:
  output tiles of tile_m x tile_n run in waves over the SMs/CUs (a last partial wave and partial edge
  tiles waste work), and a short inner size k reaches k/(k+k_half) of the rate.
  With layout tuning on, the GEMM runs in the fastest of NN/NT/TN (the same product with operands
  stored transposed), as AxoNN does on MI250X where rocBLAS runs TN up to ~8x slower.
- Attention (flash-style): max(flops / (peak x attention efficiency), bytes / HBM bandwidth).
- Elementwise, embedding, loss, optimizer: max(flops / reached GEMM rate, bytes / HBM bandwidth); or,
  where the profile measured the kind (and role) inside recorded training steps (`op_cost`, CPU), its
  measured line latency + bytes / bandwidth, which holds every cost of the real kernels (several
  passes over memory, eager dispatch, fp32 temporaries) that the roofline leaves out. A norm over
  x-split features has its own line (`cost_role`): it runs another kernel than the norm over whole
  features.
- On CPU, GEMMs run `compute_contention` times slower inside training than in their microbenchmarks
  (measured: the ranks share the cores with each other and with gloo's threads); a GEMM near a shape
  recorded inside training steps (`gemm_table` point with `training`) takes that point's rate
  instead, and attention's efficiency is the one measured inside training where it was recorded.
Every op also pays a fixed launch cost. The host's own time between ops, where the host is the
device (CPU ranks), is the host model's (twin.host), not the kernels'. `Profile.overlap_slowdown`
(compute slower while a collective overlaps it) is applied by the engine, which knows when
communication is in flight.
"""

from __future__ import annotations

import math

from twin.costs.profile_types import LAYOUTS, Profile
from twin.program.program import Op


SPLIT = "+x"  # suffix of the cost role of a norm over x-split features


def cost_role(op: Op) -> str:
    """The role an op's measured cost line (`Profile.op_cost`) is keyed by: the op's role, plus
    SPLIT for a norm over x-split features (it reads its statistics, all-reduced over x, from a
    `.stats` or `.grad_stats` buffer). The backend then runs its own several-pass kernel on the
    fp32 statistics instead of torch's fused norm (backend/runtime/layers.py), measured at about 1 ns per byte
    against 0.3 inside training on 2-8 ranks (14 CPU runs with x > 1 against the others)."""
    return op.role + SPLIT if any(r.endswith("stats") for r in op.reads) else op.role


class KernelModel:
    """Times of compute ops on one GPU described by a Profile (seconds)."""

    def __init__(self, profile: Profile, tuning: bool = True):
        self.profile = profile
        self.tuning = tuning
        self._cache: dict[tuple, float] = {}

    # -- GEMM ---------------------------------------------------------------------------------------
    def shape_efficiency(self, m: int, n: int, k: int) -> float:
        """Fraction of the reached large-GEMM rate a GEMM of this shape gets (roofline quantization)."""
        p = self.profile
        tiles_m, tiles_n = -(-m // p.tile_m), -(-n // p.tile_n)
        tiles = tiles_m * tiles_n
        waves = -(-tiles // p.compute_units)
        wave_eff = tiles / (waves * p.compute_units)
        pad_eff = (m * n) / (tiles_m * p.tile_m * tiles_n * p.tile_n)
        k_eff = k / (k + p.k_half)
        return wave_eff * pad_eff * k_eff

    def _measured_point(self, m: int, n: int, k: int, layout: str):
        """The nearest measured point within a factor 2 in every dimension, if any; one measured inside
        training steps first (twin.costs.profile_types.GemmPoint.training), else a microbenchmark's."""
        for training in (True, False):
            best, best_d = None, math.inf
            for pt in self.profile.gemm_table:
                if pt.layout != layout or pt.training != training:
                    continue
                ratios = [abs(math.log2(a / b)) for a, b in ((m, pt.m), (n, pt.n), (k, pt.k))]
                if max(ratios) <= 1.0 and sum(ratios) < best_d:
                    best, best_d = pt, sum(ratios)
            if best is not None:
                return best
        return None

    def _measured_rate(self, m: int, n: int, k: int, layout: str) -> float | None:
        """flop/s of the nearest measured point (see _measured_point), if any."""
        pt = self._measured_point(m, n, k, layout)
        return None if pt is None else pt.flops

    def layout_penalty(self, layout: str, flops: float) -> float:
        p = self.profile
        table = p.layout_penalty if flops >= p.layout_large_flops else p.layout_penalty_small
        return table.get(layout or "NN", 1.0)

    def gemm_time_layout(self, m: int, n: int, k: int, layout: str) -> float:
        """Seconds for C[m,n] = A[m,k] B[k,n] in a given layout (bf16 operands): at the rate of a point
        measured inside training (its whole span), or by the microbenchmark model x compute_contention."""
        p = self.profile
        flops = 2.0 * m * n * k
        pt = self._measured_point(m, n, k, layout)
        if pt is not None and pt.training:
            return flops / pt.flops
        if pt is not None:
            t_flop = flops / pt.flops
        else:
            t_flop = flops / (p.gemm_flops * self.shape_efficiency(m, n, k)) * self.layout_penalty(layout, flops)
        t_mem = 2.0 * (m * k + k * n + m * n) / p.hbm_bandwidth
        return (max(t_flop, t_mem) + p.launch_s) * p.compute_contention

    def gemm_time(self, m: int, n: int, k: int, layout: str) -> float:
        """Seconds for a GEMM: in its own layout, or the fastest layout when tuning is on."""
        key = (m, n, k, layout, self.tuning)
        t = self._cache.get(key)
        if t is None:
            layouts = LAYOUTS if self.tuning else (layout or "NN",)
            measured = [lay for lay in layouts if self._measured_rate(m, n, k, lay) is not None]
            layouts = measured or layouts  # tune among measured layouts only, where any was measured
            t = min(self.gemm_time_layout(m, n, k, lay) for lay in layouts)
            self._cache[key] = t
        return t

    # -- everything else ----------------------------------------------------------------------------
    def attention_time(self, op: Op) -> float:
        p = self.profile
        eff = p.attention_bwd_efficiency if op.name.endswith(".bwd") else p.attention_fwd_efficiency
        return max(op.flops / (p.peak_flops * eff), op.bytes / p.hbm_bandwidth) + p.launch_s

    def memory_bound_time(self, op: Op) -> float:
        p = self.profile
        cost = None
        if p.op_cost:
            role = cost_role(op)
            # a split norm's own line, else (a profile fitted before it had one) the role's, the kind's
            cost = p.op_cost_for(op.kind, role, exact=True) if role != op.role else None
            cost = cost or p.op_cost_for(op.kind, op.role)
        if cost is not None:
            return cost.latency_s + op.bytes / cost.bandwidth
        return max(op.flops / p.gemm_flops, op.bytes / p.hbm_bandwidth) + p.launch_s

    def kernel_time(self, op: Op) -> float:
        """Seconds of the op's kernel alone, without the host time between ops."""
        if op.kind == "gemm":
            return self.gemm_time(op.m, op.n, op.k, op.layout)
        if op.kind == "attention":
            return self.attention_time(op)
        return self.memory_bound_time(op)
