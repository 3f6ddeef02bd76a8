"""Which assumptions a prediction hangs on: the change of the predicted iteration time when each
system and kernel-profile parameter moves by +-10% (or to its documented alternative), sorted by
the larger of the two changes. The Python API behind `twin sensitivity`.

The grid stays the one the base prediction uses (`--grid auto` picks it once): the table says how
the prediction of that run moves, not which grid would win instead. Parameters:
- system: NIC rate, GPU-NIC attachment, node-fabric links (all of them scaled), dragonfly link rate,
  global links per group pair (rounded, at least +-1), the collective library's intra-node and
  per-channel inter-node efficiencies (capped at 1), its software latency per step and least time of
  a step across nodes, the hardware
  latencies (link, switch and NIC together);
- profile: reached GEMM rate, HBM bandwidth, launch cost, attention efficiencies, k_half, and the
  slowdown of compute under overlapping communication (its excess over 1 moves by +-10%);
- alternatives: the system's other sets of collective figures (`[[collectives.variants]]`: older
  measurements, AxoNN's table), minimal or non-minimal routing instead of adaptive, scattered nodes
  instead of contiguous ones, and the rules that extrapolate the measured collectives: all-reduce as
  a flat ring only (no tree or hierarchical algorithm), the measured cross-node rate read as a cap
  per NIC shared by its channels instead of per channel, concurrent axes timed as if each ran alone.
"""

from __future__ import annotations

import dataclasses as dc
from dataclasses import dataclass, field

from topologies.common import TwinError, finite_json
from twin.program.grid import Grid
from twin.costs.kernels import KernelModel
from twin.program.program import Options
from twin.predict.study import Study, prepare


@dataclass
class Row:
    """One parameter: its base value and the two moved values (as text), the predicted iteration
    times (s) with each, and the changes against the base in percent (None where not applicable)."""

    parameter: str
    kind: str            # system | profile | alternative
    base: str
    low: str
    high: str
    low_s: float | None
    high_s: float | None
    low_pct: float | None = None
    high_pct: float | None = None

    @property
    def swing(self) -> float:
        return max(abs(v) for v in (self.low_pct, self.high_pct, 0.0) if v is not None)


@dataclass
class SensitivityResult:
    system: str
    model: str
    gpus: int
    grid: str
    batch: int
    base_s: float
    step: float          # relative move, e.g. 0.1
    rows: list[Row] = field(default_factory=list)

    def as_dict(self) -> dict:
        d = dc.asdict(self)
        for r, row in zip(d["rows"], self.rows):
            r["swing_pct"] = row.swing
        return d

    def to_json(self) -> str:
        return finite_json(self.as_dict(), indent=1)


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _system_variants(study: Study, step: float):
    """(name, base, low, high, make(value) -> Study) for each system parameter."""
    s = study.system
    c = s.collectives

    def sys_(**kw):
        return lambda v: dc.replace(study, system=dc.replace(s, **{k: f(v) for k, f in kw.items()}))

    def coll(key):
        return lambda v: dc.replace(study, system=dc.replace(s, collectives=dc.replace(c, **{key: v})))

    out = []
    if s.dragonfly is not None and s.nodes > 1:
        df = s.dragonfly

        def net(key):
            return lambda v: dc.replace(study, system=dc.replace(s, dragonfly=dc.replace(df, **{key: v})))

        out += [("node.nic_bandwidth", s.nic_bandwidth, sys_(nic_bandwidth=lambda v: v)),
                ("node.gpu_nic_bandwidth", s.gpu_nic_bandwidth, sys_(gpu_nic_bandwidth=lambda v: v)),
                ("network.link_bandwidth", df.link_bandwidth, net("link_bandwidth"))]
        L = df.global_links_per_pair
        if df.groups > 1:
            lo, hi = max(1, min(L - 1, round(L * (1 - step)))), min(df.switches_per_group, max(L + 1, round(L * (1 + step))))
            out.append(("network.global_links_per_pair", L, net("global_links_per_pair"), lo, hi))
        out.append(("collectives.inter_node_channel_efficiency", c.inter_node_channel_efficiency,
                    coll("inter_node_channel_efficiency")))
        if c.inter_node_step_floor > 0:
            out.append(("collectives.inter_node_step_floor", c.inter_node_step_floor, coll("inter_node_step_floor")))
        lat = (s.link_latency, df.switch_latency, df.nic_latency)

        def latencies(f):
            return dc.replace(study, system=dc.replace(
                s, link_latency=lat[0] * f, dragonfly=dc.replace(df, switch_latency=lat[1] * f, nic_latency=lat[2] * f)))
        out.append(("link, switch and NIC latencies (x)", 1.0, latencies))
    if s.gpus_per_node > 1:
        out += [("node.links_gbs (all, x)", 1.0, lambda f: dc.replace(study, system=dc.replace(s, node_links=s.node_links * f))),
                ("collectives.intra_node_efficiency", c.intra_node_efficiency, coll("intra_node_efficiency"))]
    out.append(("collectives.step_latency", c.step_latency, coll("step_latency")))
    return out


def _profile_variants(study: Study, step: float):
    p = study.profile

    def prof(key, f=lambda v: v):
        def make(v):
            q = dc.replace(p, **{key: f(v)})
            return dc.replace(study, profile=q, kernels=KernelModel(q, tuning=study.kernels.tuning))
        return make

    out = [(f"profile.{k}", getattr(p, k), prof(k)) for k in
           ("gemm_flops", "hbm_bandwidth", "launch_s", "attention_fwd_efficiency", "attention_bwd_efficiency")]
    k = p.k_half
    out.append(("profile.k_half", k, prof("k_half"), max(1, min(k - 1, round(k * (1 - step)))), max(k + 1, round(k * (1 + step)))))
    out.append(("profile.overlap_slowdown - 1", p.overlap_slowdown - 1, prof("overlap_slowdown", lambda v: 1 + v)))
    return out


def _moe_variants(study: Study, step: float):
    """A mixture-of-experts model's routing imbalance (the busiest expert's tokens over balanced,
    Options.moe_imbalance, docs/moe.md), moved by +-step within [1, experts / top_k]."""
    m = study.model
    if not m.is_moe or m.capacity_factor > 0:  # with a capacity the buffers are padded: no effect
        return []
    v = study.options.moe_imbalance
    lo, hi = max(1.0, v * (1 - step)), min(m.experts / m.top_k, v * (1 + step))
    return [("moe.imbalance", v, lambda f: dc.replace(study, options=dc.replace(study.options, moe_imbalance=f)), lo, hi)]


def _alternatives(study: Study, g: Grid) -> list[tuple]:
    """(parameter, base, alternative, make() -> (Study, collective model or None)) of each documented
    alternative that applies to the study: routing, placement, the rules that extrapolate the
    measured collectives (docs/fidelity.md) and the system's other sets of collective figures."""
    from twin.costs.collectives import CollectiveModel

    s, pl = study.system, study.placement
    out = []
    for c in s.collective_sets:
        if c.name == s.collectives.name:
            continue
        out.append(("collective figures", s.collectives.name, c.name,
                    lambda c=c: (dc.replace(study, system=dc.replace(s, collectives=c)), None)))
    if s.nodes == 1:
        return out
    for mode in ("minimal", "nonminimal"):
        out.append(("routing", "adaptive", mode, lambda mode=mode: (study, CollectiveModel(s, g, placement=pl, routing=mode))))
    other = "scattered" if pl == "contiguous" else "contiguous"
    out.append(("placement", pl, other, lambda: (study, CollectiveModel(s, g, placement=other))))
    out.append(("inter-node cap", "per ring channel", "per NIC (shared)",
                lambda: (study, CollectiveModel(s, g, placement=pl, inter_node_cap="nic"))))
    if "all_reduce" not in s.collectives.ring_only:
        ring = dc.replace(s, collectives=dc.replace(s.collectives, ring_only=s.collectives.ring_only + ("all_reduce",)))
        out.append(("all-reduce algorithm", "fastest of ring/hierarchical/tree", "flat ring only",
                    lambda: (dc.replace(study, system=ring), None)))
    out.append(("concurrent axes", "share NICs and links", "each as if alone",
                lambda: (study, CollectiveModel(s, g, placement=pl, contention=False))))
    return out


def sensitivity(system, model=None, gpus: int | None = None, grid: str | Grid = "auto", batch: int | None = None,
                seq_len: int | None = None, options: Options | None = None, placement: str = "contiguous",
                step: float = 0.1, simulate_top: int = 2, alternatives: bool = True,
                progress=None) -> SensitivityResult:
    """Predict the study, then again with each parameter moved by -step and +step (relative), or set
    to its alternative; rows sorted by the larger change of the iteration time, largest first.
    `progress(what, done, total)` is called before each simulation."""
    from twin.predict.auto import choose_grid
    from twin.predict.run import simulate_grid

    if not 0 < step < 1:
        raise TwinError(f"--step must be between 0 and 1 (a relative move), got {step}")
    study = prepare(system, model, gpus, batch, seq_len, options, placement)
    if isinstance(grid, str) and grid.strip().lower() == "auto":
        g = choose_grid(study, simulate_top=simulate_top)[0].grid
    else:
        g = Grid.parse(grid) if isinstance(grid, str) else grid
    variants = _system_variants(study, step) + _profile_variants(study, step) + _moe_variants(study, step)
    total = 1 + 2 * len(variants) + (len(_alternatives(study, g)) if alternatives else 0)
    done = 0

    def run(st: Study, collectives=None, what: str = "the study") -> float:
        nonlocal done
        if progress is not None:
            progress(f"simulating {what}", min(done, total - 1), total)
        done += 1
        return simulate_grid(st, g, collectives=collectives).iteration_time_s

    base = run(study)
    rows = []
    for item in variants:
        name, v, make = item[:3]
        lo, hi = item[3:] if len(item) == 5 else (v * (1 - step), v * (1 + step))
        if "efficiency" in name:
            hi = min(hi, 1.0)
        kind = "profile" if name.startswith("profile.") else "model" if name.startswith("moe.") else "system"
        rows.append(Row(name, kind, _fmt(v), _fmt(lo), _fmt(hi),
                        run(make(lo), what=name) if lo != v else None, run(make(hi), what=name) if hi != v else None))
    if alternatives:
        for name, base_text, alt_text, make in _alternatives(study, g):
            st, cm = make()
            rows.append(Row(name, "alternative", base_text, alt_text, "", run(st, cm, what=name), None))
    for r in rows:
        r.low_pct = None if r.low_s is None else 100.0 * (r.low_s / base - 1)
        r.high_pct = None if r.high_s is None else 100.0 * (r.high_s / base - 1)
    rows.sort(key=lambda r: (-r.swing, r.parameter))
    return SensitivityResult(study.system.name, study.model.name, study.gpus, str(g), study.batch, base, step, rows)
