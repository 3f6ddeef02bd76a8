"""The collective model: ring bandwidth against the measured table, and the time formula's properties."""

import math

import pytest

from topologies.system import load_system
from twin.costs.collectives import CollectiveModel
from topologies.common import TwinError
from twin.program.grid import Grid

# docs/reference/collective-bandwidth.md (GB/s), by stride s and group size p ("p>8" read at p=16)
MEASURED = {
    "perlmutter": {1: {2: 76, 4: 225, 8: 80, 16: 80}, 2: {2: 76, 4: 40, 8: 40, 16: 40},
                   4: {2: 20, 4: 20, 8: 20, 16: 20}, 8: {2: 20, 4: 20, 8: 20, 16: 20}},
    "frontier": {1: {2: 129, 4: 52, 8: 135, 16: 40}, 2: {2: 50, 4: 72, 8: 20, 16: 20},
                 4: {2: 36, 4: 10, 8: 10, 16: 10}, 8: {2: 5, 4: 5, 8: 5, 16: 5}},
}
CASES = [(sy, s, p, bw) for sy, t in MEASURED.items() for s, row in t.items() for p, bw in row.items()]


def model_bandwidth(system: str, stride: int, p: int, variant: str = "axonn-table") -> float:
    """Bus bandwidth (GB/s) of the axis with group size p and rank stride `stride`, all its groups at
    once, with the system's collective figures `variant` (by default those fit to this table)."""
    grid, axis = (Grid(p, 1, 1, 1), "x") if stride == 1 else (Grid(stride, p, 1, 1), "y")
    assert grid.stride(axis) == stride and grid.axis_size(axis) == p
    return CollectiveModel(load_system(f"{system}:{variant}"), grid).effective_bandwidth(axis) / 1e9


def test_ring_bandwidth_matches_the_measured_table():
    """Model vs measured ring bandwidth for Perlmutter and Frontier groups, with the figures each
    system file fits to this table (its "axonn-table" collective variant).

    Each system has two calibrated numbers (its system file says "fit to the measured table"): the
    fraction of a GPU-GPU link a ring step reaches (one entry: p=2, s=1) and the fraction of the NIC
    rate one ring channel reaches across nodes (Perlmutter 0.8: 20 GB/s per ring member per node;
    Frontier 0.2: RCCL's ring over Slingshot reaches only 5 GB/s per member per node). Everything else
    follows from the node fabric, the NIC map and the channel layout, so we accept a factor of 1.6:
    the worst entries are Perlmutter p=4 s=1 (225 measured: NCCL drives all three NVLinks of each
    GPU with more channels than our two-direction ring; model 152) and Frontier p=2 s=2 (50 measured,
    model 32.5: the table suggests that pair has 2 Infinity Fabric links where our per-pair map,
    chosen so that RCCL's 8-GCD ring sees 2 links on every cross-package hop, gives it one).
    Most entries (all inter-node ones) must be within 10%.
    """
    ratios = {(sy, s, p): model_bandwidth(sy, s, p) / bw for sy, s, p, bw in CASES}
    bad = {k: round(r, 2) for k, r in ratios.items() if not 1 / 1.6 <= r <= 1.6}
    assert not bad, bad
    close = sum(0.9 <= r <= 1.1 for r in ratios.values())
    assert close >= 0.85 * len(ratios), ratios


def test_alps_two_node_all_reduce():
    """NCCL all-reduce on 2 Alps nodes (systems.md: 122.6, 107.7, 85.5 GB/s bus bandwidth at 128, 64,
    32 MiB). Alps' channel efficiency and step latency are fitted to exactly these three points (the
    system file says so); the model takes the hierarchical all-reduce (NVLink inside the node, 4 NICs
    across, stages pipelined), which beats the 100 GB/s a flat ring over 4 NICs can reach."""
    m = CollectiveModel(load_system("alps"), Grid(8, 1, 1, 1))
    bus = [2 * 7 / 8 * mib * 2**20 / m.time("all_reduce", "x", mib * 2**20) / 1e9 for mib in (128, 64, 32)]
    for b, measured in zip(bus, (122.6, 107.7, 85.5)):
        assert abs(b / measured - 1) < 0.03, bus
    assert bus[0] > 100 > bus[2]  # above the flat ring's bound at 128 MiB; latency-bound at 32 MiB


def test_hierarchical_phases_are_pipelined():
    """A hierarchical all-reduce takes the slowest phase's transfer plus every phase's latency, not
    the sum of the transfers (NCCL's tree and hierarchical algorithms stream their stages)."""
    m = CollectiveModel(load_system("frontier"), Grid(2, 8, 1, 1))   # y: 4 GCDs per node on 2 nodes
    axes = frozenset({"y"})
    rates = m._bus_rates(axes, "hierarchical")["y"]
    alphas, sizes, floors = m._phases("y", "hierarchical")[1:]
    assert floors == [0.0, m.system.collectives.inter_node_step_floor]  # inside nodes, then across
    big = 2**30
    t = m._ring_time("all_reduce", "y", big, axes, "hierarchical")
    transfers = [2 * (q - 1) / q * d / r for r, q, d in zip(rates, sizes, (big, big / sizes[0]))]
    latency = sum(2 * (q - 1) * a for a, q in zip(alphas, sizes))
    assert t == pytest.approx(latency + max(transfers))
    assert t < latency + sum(transfers)


def test_strided_groups_get_fewer_nics():
    # Perlmutter: 4, 2, 1 ring members per node -> 80, 40, 20 GB/s (the NICs a ring can use)
    assert [round(model_bandwidth("perlmutter", s, 16)) for s in (1, 2, 4)] == [76, 40, 20]


def test_time_formula_properties():
    m = CollectiveModel(load_system("perlmutter"), Grid(4, 2, 2, 4))
    big = 1 << 30
    for axis in ("x", "y", "z", "data"):
        ag = m.time("all_gather", axis, big)
        assert m.time("reduce_scatter", axis, big) == ag
        assert m.time("all_reduce", axis, big) == pytest.approx(2 * ag, rel=0.01)
        assert m.time("all_gather", axis, big // 2) < ag
        p = m.grid.axis_size(axis)
        assert ag >= (p - 1) / p * big / m.effective_bandwidth(axis)
    # small all-reduces take the tree: fewer than the ring's 2(p-1) steps of latency
    alpha = m.system.collectives.step_latency
    assert m.time("all_gather", "data", 4) >= 3 * alpha           # ring: p-1 = 3 steps
    assert m.time("all_reduce", "data", 4) < 0.75 * 2 * m.time("all_gather", "data", 4)  # tree: 4 of 6 steps
    assert m.time("all_reduce", "x", 0) == 0.0
    assert CollectiveModel(load_system("perlmutter"), Grid(4, 1, 1, 1)).time("all_reduce", "y", big) == 0.0


def test_concurrent_axes_contend_for_nics():
    # Perlmutter 4x2x2x1: y (stride 4) and z (stride 8) rings both leave every GPU through its own NIC:
    # alone each channel gets its 16.25 GB/s cap; together two channels share a 25 GB/s NIC
    m = CollectiveModel(load_system("perlmutter"), Grid(4, 2, 2, 1))
    assert m.effective_bandwidth("y") == pytest.approx(16.25e9)
    assert m.effective_bandwidth("y", frozenset({"z"})) == pytest.approx(12.5e9)
    alone, shared = m.time("all_gather", "y", 1 << 28), m.time("all_gather", "y", 1 << 28, frozenset({"z"}))
    assert shared > 1.25 * alone
    # the x axis (NVLink only) is not slowed by network traffic of the others
    assert m.effective_bandwidth("x", frozenset({"y", "z"})) == m.effective_bandwidth("x")


def test_hierarchical_and_scattered_variants_run():
    s = load_system("perlmutter")
    flat = CollectiveModel(s, Grid(1, 16, 1, 1))
    hier = CollectiveModel(s, Grid(1, 16, 1, 1), algorithm="hierarchical")
    t_flat, t_hier = flat.time("all_gather", "y", 1 << 30), hier.time("all_gather", "y", 1 << 30)
    assert 0.5 < t_hier / t_flat < 2.0
    sc = CollectiveModel(s, Grid(4, 4, 4, 4), placement="scattered", seed=1)
    assert 0 < sc.effective_bandwidth("data") <= 16.25e9 * 1.0001


def test_bad_input_is_a_twin_error():
    m = CollectiveModel(load_system("cpu"), Grid(2, 2, 2, 1))
    with pytest.raises(TwinError, match="unknown collective"):
        m.time("broadcast", "x", 10)
    with pytest.raises(TwinError, match="unknown axis"):
        m.time("all_gather", "w", 10)
    with pytest.raises(TwinError, match="needs 2 nodes"):
        CollectiveModel(load_system("cpu"), Grid(2, 2, 2, 2))
    with pytest.raises(TwinError, match="unknown routing"):
        CollectiveModel(load_system("cpu"), Grid(2, 2, 2, 1), routing="random")
    with pytest.raises(TwinError, match="unknown collective algorithm"):
        CollectiveModel(load_system("cpu"), Grid(2, 2, 2, 1), algorithm="butterfly")


def test_frontier_default_study_axes():
    m = CollectiveModel(load_system("frontier"), Grid(8, 8, 4, 128))
    bw = {a: m.effective_bandwidth(a) / 1e9 for a in ("x", "y", "z", "data")}
    assert bw["x"] == pytest.approx(85)           # 8 GCDs of a node, a one-direction ring
    assert bw["y"] == pytest.approx(10.5)         # one member per node: one RCCL channel
    # data: 128-member rings, one member per node, crossing 32 groups; each group boundary is crossed by
    # 256 channels (2.7 TB/s) but has only 4 global cables (100 GB/s) on the minimal path: adaptive
    # routing detours through other groups and keeps most of the channel cap; minimal routing cannot
    assert 8.0 <= bw["data"] <= 10.5001
    minimal = CollectiveModel(load_system("frontier"), Grid(8, 8, 4, 128), routing="minimal")
    assert minimal.effective_bandwidth("data") < 0.5e9
    t = m.time("all_reduce", "data", 1 << 28, frozenset({"z"}))
    assert math.isfinite(t) and t > m.time("all_reduce", "data", 1 << 28) * 0.999


def test_inter_node_cap_per_nic_reads_the_table_alike():
    """The measured cross-node rate read per NIC (shared by its channels) or per channel gives the same
    ring bandwidth where all GPUs of a node run one axis, as in the table, and never more when axes overlap."""
    frontier = load_system("frontier")
    for grid, axis in ((Grid(8, 2, 1, 1), "y"), (Grid(16, 1, 1, 1), "x"), (Grid(2, 8, 1, 1), "y")):
        a = CollectiveModel(frontier, grid).effective_bandwidth(axis)
        b = CollectiveModel(frontier, grid, inter_node_cap="nic").effective_bandwidth(axis)
        assert b == pytest.approx(a)
    grid = Grid(2, 8, 16, 1)
    a = CollectiveModel(frontier, grid).effective_bandwidth("y", frozenset({"z"}))
    b = CollectiveModel(frontier, grid, inter_node_cap="nic").effective_bandwidth("y", frozenset({"z"}))
    assert b <= a * (1 + 1e-9)
    with pytest.raises(TwinError):
        CollectiveModel(frontier, grid, inter_node_cap="link")


@pytest.mark.parametrize("name, grid", [("frontier", Grid(2, 4, 8, 16)), ("perlmutter", Grid(4, 2, 8, 8)),
                                        ("alps", Grid(4, 4, 4, 4))])
def test_axes_that_share_no_link_are_rated_apart_exactly(name, grid):
    """The rates of concurrent axes are computed per group of axes that share links; they must equal
    the max-min of all their flows together, to the bit."""
    import numpy as np

    from topologies.routing import Routes
    from twin.costs.flows import _max_min
    from twin.costs.flowsets import sharing_links

    cm = CollectiveModel(load_system(name), grid)
    axes = frozenset(a for a in ("x", "y", "z", "data") if grid.axis_size(a) > 1)
    split = 0
    for sub in [axes, axes - {"y"}, axes - {"z"}, frozenset({"x", "data"})]:
        for algorithm in ("ring", "hierarchical"):
            sets = {a: cm._phases(a, cm._algorithm(a, algorithm))[0] for a in sorted(sub)}
            for k in range(max(len(v) for v in sets.values())):
                allf = [v[min(k, len(v) - 1)] for v in sets.values()]
                split += len(sharing_links(allf, cm.net.n_links)) > 1
                routes = Routes.concat([f.routes for f in allf])
                rates = _max_min(routes.ptr, routes.links, cm.capacity, np.concatenate([f.caps for f in allf]), 1e-9)
                off = 0
                for (a, v), f in zip(sets.items(), allf):
                    if k < len(v):
                        whole = float(f.bus_rates(rates[off:off + len(f.routes)]).min())
                        assert cm._bus_rates(sub, algorithm)[a][k] == whole
                    off += len(f.routes)
    assert split  # some of these sets did split (x inside nodes, data through each GPU's own NIC)
