"""What a kernel profile holds: the `Profile` dataclass and the measured points and tables in it.

`Profile` is one GPU's (or CPU rank's) kernel performance, with the measured GEMM points, node-share
figures, op costs and collective lines that replace the models where they were measured;
`Profile.for_ranks` picks the figures of a rank count and `CollectiveTable.time` looks a collective up.
twin.costs.profile loads a profile from its TOML file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

LAYOUTS = ("NN", "NT", "TN")


@dataclass(frozen=True)
class GemmPoint:
    """One measured GEMM: C[m,n] = A[m,k] B[k,n] in `layout`, reaching `flops` flop/s per rank while
    `ranks` ranks shared the node (0: not recorded, applies to any count). `training`: measured inside
    recorded training steps (its span, everything included), not by a microbenchmark."""

    m: int
    n: int
    k: int
    layout: str
    flops: float
    ranks: int = 0
    training: bool = False


@dataclass(frozen=True)
class NodeShare:
    """What one rank gets while `ranks` ranks share a node (fitted from `backend bench` on that many
    ranks): per-op overhead (s), memory bandwidth per rank (bytes/s), compute slowdown under overlap."""

    ranks: int
    launch_s: float
    hbm_bandwidth: float
    overlap_slowdown: float
    compute_scale: float = 1.0  # a rank's GEMM rate relative to the profile's own (peak_flops, gemm_flops)
    attention_fwd_efficiency: float = 0.0  # measured, of the scaled peak (0: the profile's own)
    attention_bwd_efficiency: float = 0.0
    host_op_s: float = 0.0  # measured host time per compute op of the executor (0: the profile's own)
    # measured inside recorded training steps (`backend bench`): GEMMs and attention ran this many
    # times slower than their microbenchmarks while no collective overlapped them (the ranks share the
    # cores with each other and with gloo's threads), and collectives this many times slower than
    # alone, the median over the recorded ones (1, 1: not measured)
    compute_contention: float = 1.0
    collective_slowdown: float = 1.0
    # the same per axis, where training steps recorded collectives of it: {axis: factor}
    axis_slowdown: dict[str, float] = field(default_factory=dict, compare=False, hash=False)
    # a collective progresses at this share of its rate while its rank's compute runs (fitted from
    # the recorded training steps: gloo's threads and the compute share the cores; 1: not measured)
    comm_share: float = 1.0
    # how much longer than their on-CPU time the compute ops of the recorded steps took (summed span
    # over summed on-CPU time: the rank's fluid share of the cores, inverted), which the in-training
    # op times hold (0: not measured)
    stretch: float = 0.0
    # host time per collective the executor issues, charged to the compute op after it (twin.host.order.host_times)
    host_issue_s: float = 0.0
    # how much an op's span varies over the ranks and steps (coefficient of variation), per class:
    # "compute", a collective's "kind_axis", "collective" (twin.host.spread; {}: not measured)
    span_spread: dict[str, float] = field(default_factory=dict, compare=False, hash=False)
    # host time of an MoE dispatch that first exchanges its row counts (twin.host.order.count_exchange),
    # charged to the compute op after it whether or not that op waits for it (0: not measured)
    host_exchange_s: float = 0.0


@dataclass(frozen=True)
class OpCost:
    """A compute op kind (and role; "" for every role) the GEMM and attention models do not cover,
    measured inside recorded training steps while `ranks` ranks shared the node:
    seconds = latency_s + op bytes / bandwidth (bytes as twin.program.program counts them, bytes/s)."""

    kind: str
    role: str
    ranks: int
    latency_s: float
    bandwidth: float


@dataclass(frozen=True)
class CollectivePoint:
    """A measured collective: seconds = latency_s + bytes / bandwidth (real payload bytes, bytes/s),
    for `kind` over groups of `group_size` (rank stride `stride`) while `ranks` ranks share the node.
    `axis`: the grid axis it was measured on inside training ("" when measured alone, or any axis):
    each axis plays its own part in the schedule (x all-reduces block the next GEMM, z all-gathers are
    prefetched, data all-reduces leave in one burst at the end), which changes what it costs."""

    kind: str
    group_size: int
    ranks: int
    latency_s: float
    bandwidth: float
    stride: int = 0
    axis: str = ""


GRADIENT_AXES = ("data", "edata")  # collectives of fp32 gradients at the end of the step (GRAD_AR_BYTES)


def payload_bytes(axis: str, nbytes: float, activation_bytes: int) -> float:
    """The real payload (bytes) of a collective the program counts at `nbytes` over `axis`, on a device whose
    activations are `activation_bytes` wide: a gradient all-reduce (data, edata) as counted (fp32 both
    ways), any other collective scaled from the program's ACT_BYTES per element."""
    from twin.program.program import ACT_BYTES
    return nbytes if axis in GRADIENT_AXES else nbytes * activation_bytes / ACT_BYTES


@dataclass(frozen=True)
class CollectiveTable:
    """Measured collective costs (the `[[collective_table]]` rows of a profile) for one rank count.

    Payloads are counted as the program counts them (twin.program.program: activations ACT_BYTES per element,
    gradients all-reduced over data, and an MoE block's expert gradients over edata, GRAD_AR_BYTES); on a
    device whose activations are `activation_bytes` wide (4 on CPU, fp32) the real payload of any other
    collective is bytes x activation_bytes / ACT_BYTES (payload_bytes).
    """

    points: tuple[CollectivePoint, ...]
    activation_bytes: int = 2
    training: tuple[CollectivePoint, ...] = ()  # measured inside recorded training steps: preferred
    slowdown: float = 1.0   # a point measured alone counts this many times its time inside training
    axis_slowdown: dict[str, float] = field(default_factory=dict, compare=False, hash=False)  # per axis

    def time(self, kind: str, axis: str, group_size: int, nbytes: float, stride: int = 0) -> float | None:
        """Seconds for one collective, or None when no point of this kind and group size was measured:
        the line measured inside training where there is one (of this axis first, then of another
        tensor axis; the nearest stride among them), else the line measured alone x slowdown (the
        nearest stride), of the axis' own slowdown where training steps recorded collectives of the
        axis. A data-axis collective never takes a tensor axis' training line, nor the reverse: the
        data all-reduces leave in one burst at the end of the step, where gloo overlaps them with
        each other, while a tensor axis' all-reduce blocks the op after it (an edata all-reduce, of an
        MoE block's expert gradients, is of the data kind: twin.costs.alltoall.measured_time)."""
        real = payload_bytes(axis, nbytes, self.activation_bytes)

        def role(p: CollectivePoint) -> int:
            if p.axis in ("", axis):
                return 0
            return 1 if not {p.axis, axis} & set(GRADIENT_AXES) else 2

        for points, factor in ((self.training, 1.0), (self.points, self.axis_slowdown.get(axis, self.slowdown))):
            pts = [p for p in points if p.kind == kind and p.group_size == group_size and role(p) < 2]
            if pts:
                pt = min(pts, key=lambda p: (role(p), p.stride != stride, abs(p.stride - stride)))
                return factor * (pt.latency_s + real / pt.bandwidth)
        return None

    def trained(self, kind: str, axis: str, group_size: int) -> bool:
        """Whether recorded training steps gave a line of this kind, axis (itself) and group size."""
        return any(p.kind == kind and p.axis == axis and p.group_size == group_size for p in self.training)


@dataclass(frozen=True)
class HostSharing:
    """The host part of a profile: how the ranks of a node share its cores where the host that runs
    the program is the device that computes (CPU ranks). Read by the host model (twin.host) only.
    Units: seconds; shares and factors are ratios."""

    # the executor's host runs each op in program order (twin.host.order.host_ordered), so the twin
    # issues collectives in program order too
    ordered: bool = False
    # host time per compute op between kernels (s): the executor's dispatch and bookkeeping
    op_s: float = 0.0
    # host time per collective the executor issues (the buffers it fills, the communication thread
    # taking the issuing rank's core), charged to the compute op after it (twin.host.order.host_times)
    issue_s: float = 0.0
    # a collective's rate, of its own, while its rank's compute runs (the threads share the cores)
    comm_share: float = 1.0
    # compute ops' span over their on-CPU time that the in-training op times hold (0: not measured)
    stretch: float = 0.0
    # how much an op's span varies over ranks and steps while ranks time-slice the cores, per class
    # (twin.host.spread draws the spans at it; {}: every op at its mean span)
    span_spread: dict[str, float] = field(default_factory=dict, compare=False, hash=False)
    # the node's cores, and the share of a core a collective in flight keeps busy (twin.host.cores;
    # 0: not measured, every grid at `stretch`)
    node_cores: int = 0
    collective_core_load: float = 0.0
    # host time of an MoE dispatch that exchanges its row counts first, a synchronous all-to-all of ints
    # before the rows' (twin.host.order.host_times; 0: not measured, charged as any other issue)
    exchange_s: float = 0.0


@dataclass(frozen=True)
class Profile:
    """Kernel performance of one GPU (or GCD). Units: flop/s, bytes/s, seconds; factors are ratios."""

    name: str
    gpus: tuple[str, ...]
    peak_flops: float               # advertised dense bf16 peak (flop/s)
    gemm_flops: float               # reached by large bf16 GEMMs (flop/s)
    compute_units: int              # SMs or CUs: tiles run in waves over these
    tile_m: int                     # GEMM output tile (rows)
    tile_n: int                     # GEMM output tile (columns)
    k_half: int                     # inner size at which a GEMM reaches half its large-GEMM rate
    hbm_bandwidth: float            # reached memory bandwidth, bytes read plus written (bytes/s)
    launch_s: float                 # fixed cost per kernel (s)
    attention_fwd_efficiency: float  # flash attention forward, fraction of peak_flops
    attention_bwd_efficiency: float  # flash attention backward, fraction of peak_flops
    overlap_slowdown: float         # compute runs this many times slower while communication overlaps it
    layout_large_flops: float       # GEMMs of at least this many flop get `layout_penalty` (flop)
    layout_penalty: dict[str, float]        # time factor per layout, large GEMMs
    layout_penalty_small: dict[str, float]  # time factor per layout, smaller GEMMs
    gemm_table: tuple[GemmPoint, ...] = ()
    activation_bytes: int = 2       # bytes per activation element the device computes in (4: fp32 CPU)
    node_share: tuple[NodeShare, ...] = ()           # per count of ranks sharing a node (measured)
    collective_table: tuple[CollectivePoint, ...] = ()  # measured collectives (replace the flow model)
    op_cost: tuple[OpCost, ...] = ()  # measured costs of op kinds inside training (replace the roofline)
    compute_contention: float = 1.0   # GEMM and attention times x this (measured inside training)
    collective_training: tuple[CollectivePoint, ...] = ()  # collectives measured inside training steps
    collective_slowdown: float = 1.0  # collective_table (measured alone) times x this inside training
    axis_slowdown: dict[str, float] = field(default_factory=dict, compare=False, hash=False)  # per axis
    # how the ranks of a node share their host, where the host is the device (CPU ranks); None where
    # the host only queues kernels for a device (GPU profiles): the host model (twin.host) is not used
    host: HostSharing | None = None
    ranks: int = 0                  # the rank count for_ranks() chose (0: not chosen)
    sources: dict[str, str] = field(default_factory=dict, compare=False)
    # what a fitted profile's measurements covered ([fitted_from]: ranks, benched grids, machines, ...)
    fitted_from: dict = field(default_factory=dict, compare=False, hash=False)

    def measured_ranks(self) -> list[int]:
        """The counts of ranks sharing a node that the profile's measurements were taken with (none for
        a profile of sourced figures alone)."""
        return sorted({s.ranks for s in self.node_share} | {g.ranks for g in self.gemm_table if g.ranks}
                      | {c.ranks for c in self.collective_table} | {c.ranks for c in self.op_cost}
                      | {c.ranks for c in self.collective_training})

    def coverage(self, ranks: int) -> str | None:
        """One line when `ranks` ranks sharing a node lie outside what the profile measured (it then
        extrapolates by for_ranks' rule, which the line names), else None."""
        counts = self.measured_ranks()
        if not counts or ranks in counts:
            return None
        r = min(counts, key=lambda c: (abs(math.log(c / max(ranks, 1))), -c))
        return (f"kernel profile {self.name} was measured with {', '.join(map(str, counts))} rank(s) per node, not "
                f"{ranks}: it uses the figures of {r} rank(s), the nearest measured count (extrapolated; "
                f"`backend bench --for-twin --ranks {ranks}` and `twin calibrate` cover it)")

    def grid_coverage(self, sizes: dict[str, int]) -> str | None:
        """One line when a split axis of a grid (`sizes`: axis -> group size) runs collectives of a group
        size that this profile (after for_ranks) recorded no line of inside training for that axis (or,
        for x, y and z, another tensor axis: CollectiveTable.time's rule), naming the rule it then
        falls back on; None where every axis is covered or the profile measured no collectives."""
        if not self.collective_table and not self.collective_training:
            return None
        alone, network = [], []
        for axis, p in sizes.items():
            if p < 2:
                continue
            tensor = axis != "data"
            if any(c.group_size == p and ((c.axis in ("x", "y", "z", "")) if tensor else c.axis in ("data", ""))
                   for c in self.collective_training):
                continue
            (alone if any(c.group_size == p for c in self.collective_table) else network).append(f"{axis} = {p}")
        if not alone and not network:
            return None
        where = f" with {self.ranks} rank(s) per node" if self.ranks else ""
        rules = ([f"over {' and '.join(alone)} it uses the line measured alone x the axis' slowdown"] if alone else []) \
            + ([f"over {' and '.join(network)} the system's network model"] if network else [])
        return (f"kernel profile {self.name} recorded no collective of these group sizes inside training{where}: "
                f"{'; '.join(rules)} (extrapolated; `backend bench --for-twin` on grids with them and "
                f"`twin calibrate` cover them)")

    def for_ranks(self, ranks: int) -> "Profile":
        """This profile as one rank sees it while `ranks` ranks share its node: the measured node-share
        figures and GEMM points of the nearest measured rank count (on a log scale) replace the
        defaults. Unchanged when the profile has no per-rank-count measurements."""
        counts = self.measured_ranks()
        if not counts:
            return self
        r = min(counts, key=lambda c: (abs(math.log(c / max(ranks, 1))), -c))
        kw: dict = {"ranks": r,
                    "gemm_table": tuple(g for g in self.gemm_table if g.ranks in (0, r)),
                    "collective_table": tuple(c for c in self.collective_table if c.ranks == r),
                    "op_cost": tuple(c for c in self.op_cost if c.ranks == r),
                    "collective_training": tuple(c for c in self.collective_training if c.ranks == r)}
        share = next((s for s in self.node_share if s.ranks == r), None)
        if share is not None:
            kw.update(launch_s=share.launch_s, hbm_bandwidth=share.hbm_bandwidth,
                      overlap_slowdown=share.overlap_slowdown, peak_flops=self.peak_flops * share.compute_scale,
                      gemm_flops=self.gemm_flops * share.compute_scale, compute_contention=share.compute_contention,
                      collective_slowdown=share.collective_slowdown, axis_slowdown=share.axis_slowdown,
                      host=with_host(self.host, op_s=share.host_op_s or (self.host.op_s if self.host else 0.0),
                                     comm_share=share.comm_share, stretch=share.stretch,
                                     issue_s=share.host_issue_s, span_spread=share.span_spread,
                                     exchange_s=share.host_exchange_s))
            if share.attention_fwd_efficiency and share.attention_bwd_efficiency:
                kw.update(attention_fwd_efficiency=share.attention_fwd_efficiency,
                          attention_bwd_efficiency=share.attention_bwd_efficiency)
        return replace(self, **kw)

    def collectives(self) -> CollectiveTable | None:
        """The measured collective table (after for_ranks), or None when the profile has none."""
        if not self.collective_table and not self.collective_training:
            return None
        return CollectiveTable(self.collective_table, self.activation_bytes, self.collective_training,
                               self.collective_slowdown, self.axis_slowdown)

    def op_cost_for(self, kind: str, role: str, exact: bool = False) -> OpCost | None:
        """The measured cost line of an op kind and role (after for_ranks), else (unless `exact`) of
        the kind, else None."""
        best = None
        for c in self.op_cost:
            if c.kind == kind and c.role == role:
                return c
            if c.kind == kind and c.role == "" and not exact:
                best = c
        return best

    @property
    def gemm_efficiency(self) -> float:
        """Ceiling of GEMM efficiency: reached large-GEMM flop/s over the advertised peak."""
        return self.gemm_flops / self.peak_flops


def with_host(host: HostSharing | None, **values) -> HostSharing | None:
    """`host` (None: no host part) with `values` replaced; None again where every figure is then at
    its default, which simulates exactly as no host part does."""
    out = replace(host or HostSharing(), **values)
    return None if out == HostSharing() and not out.span_spread else out
