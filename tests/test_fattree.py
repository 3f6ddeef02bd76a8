"""Fat trees (topologies/fattree.py): the graph of a small tree, its ECMP paths, a contention case worked
by hand in the max-min flow model, refused system files, and Selene end to end."""

import re

import numpy as np
import pytest
from typer.testing import CliRunner

from topologies.common import TwinError
from topologies.network import DOWN, DOWN_TRUNK, GPU_PORT, NIC_SW, PORT_GPU, UP, UP_TRUNK, Network, build_network
from topologies.routing import route
from topologies.system import load_system
from twin.cli.main import app
from twin.costs.flows import max_min_rates

runner = CliRunner()
GB = 1e9


def tree_toml(levels: list[dict], nodes: int, gpn: int, nics: int, rail: bool = True, ecmp: str = "destination",
              nic_gbs: float = 25, nvswitch: float = 0) -> str:
    """A small system on a fat tree: `levels` as [[fattree.levels]] tables (name, radix, oversubscription
    but at the top, link_gbs)."""
    mesh = [[0 if i == j else 100 for j in range(gpn)] for i in range(gpn)]
    text = f"""name = "tree"
[gpu]
name = "test GPU"
peak_flops = 1e14
hbm_gib = 16
hbm_bandwidth = 1e12
[node]
nodes = {nodes}
gpus_per_node = {gpn}
nics_per_node = {nics}
nic_bandwidth = {nic_gbs}e9
gpu_nic = {[i % nics for i in range(gpn)]}
gpu_nic_bandwidth = 100e9
link_latency = 1e-6
links_gbs = {mesh}
{f"nvswitch_gbs = {nvswitch}" if nvswitch else ""}
[fattree]
rail_optimized = {str(rail).lower()}
ecmp = "{ecmp}"
nic_latency = 1e-6
cable_latency = 1e-7
"""
    for lv in levels:
        text += (f'[[fattree.levels]]\nname = "{lv["name"]}"\nradix = {lv["radix"]}\n'
                 f'link_bandwidth = {lv.get("link_gbs", 25)}e9\nswitch_latency = 1e-7\n')
        if "over" in lv:
            text += f'oversubscription = {lv["over"]}\n'
    return text + """[collectives]
library = "NCCL"
intra_node_efficiency = 1.0
inter_node_channel_efficiency = 1.0
step_latency = 1e-6
[default]
model = "gpt-tiny"
gpus = 2
"""


def load_tree(tmp_path, *args, **kwargs):
    p = tmp_path / "tree.toml"
    p.write_text(tree_toml(*args, **kwargs))
    return load_system(str(p))


THREE = [dict(name="leaf", radix=4, over=1), dict(name="spine", radix=4, over=1), dict(name="core", radix=4)]


def test_small_tree_switches_and_links(tmp_path):
    """4 nodes x 2 GPUs x 2 NICs on 3 levels of 4-port switches (2 down, 2 up), rail-optimized: a pod
    (under the core) is 2 x 2 = 4 NIC ports, one per rail here; 4 leaves, 4 spines (2 per pod), 4 cores
    (one per path from a pod's leaf to the top: 2 x 2), each core with one link to each of the 2 pods."""
    net = build_network(load_tree(tmp_path, THREE, nodes=4, gpn=2, nics=2))
    ft = net.fattree
    assert (ft.pods, ft.pod_size, ft.switches) == (2, 4, [4, 4, 4])
    assert net.n_switches == 12
    counts = net.summary()["links_by_kind"]
    # GPU-GPU 4 x 2; GPU<->NIC 2 x 8; NIC<->leaf 2 x 8; leaf-spine 4 x 2 and spine-core 4 x 2 cables, 2 ways
    assert (counts["up"], counts["down"], counts["nic-switch"], net.n_links) == (16, 16, 8, 8 + 16 + 16 + 32)
    assert counts["local"] == counts["global"] == 0
    name = net.vertex_name
    up = np.flatnonzero(net.kind == UP)
    cables = {(name(int(net.src[i])), name(int(net.dst[i]))) for i in up}
    # leaf b of pod b // 2 reaches that pod's 2 spines; spine (pod q, replica r) reaches cores 2r, 2r+1
    assert cables == {("leaf0", "spine0"), ("leaf0", "spine1"), ("leaf1", "spine0"), ("leaf1", "spine1"),
                      ("leaf2", "spine2"), ("leaf2", "spine3"), ("leaf3", "spine2"), ("leaf3", "spine3"),
                      ("spine0", "core0"), ("spine0", "core1"), ("spine1", "core2"), ("spine1", "core3"),
                      ("spine2", "core0"), ("spine2", "core1"), ("spine3", "core2"), ("spine3", "core3")}
    # every down link is an up link reversed
    down = np.flatnonzero(net.kind == DOWN)
    assert {(name(int(net.dst[i])), name(int(net.src[i]))) for i in down} == cables
    # rail-optimized: NIC 0 of nodes 0 and 1 on leaf 0, of nodes 2 and 3 on leaf 1; NIC 1 on leaves 2, 3
    nic_leaf = {name(int(net.src[i])): name(int(net.dst[i])) for i in np.flatnonzero(net.kind == NIC_SW)}
    assert [nic_leaf[f"nic{n}.{k}"] for k in (0, 1) for n in range(4)] == \
        ["leaf0", "leaf0", "leaf1", "leaf1", "leaf2", "leaf2", "leaf3", "leaf3"]


def test_not_rail_optimized_a_node_fills_a_leaf(tmp_path):
    net = build_network(load_tree(tmp_path, THREE, nodes=4, gpn=2, nics=2, rail=False))
    assert net.fattree.leaf(np.arange(8)).tolist() == [0, 0, 1, 1, 2, 2, 3, 3]


def _switch_path(net, links) -> list[str]:
    return [net.vertex_name(int(net.src[i])) for i in links] + [net.vertex_name(int(net.dst[links[-1]]))]


def test_ecmp_paths_are_the_shortest_paths_and_destination_picks_one(tmp_path):
    """Every equal-cost path of the model is a shortest leaf-to-leaf path of the graph (networkx), and
    there are as many; the destination rule takes the up port (destination endpoint // W) mod up."""
    import networkx as nx
    net = build_network(load_tree(tmp_path, THREE, nodes=4, gpn=2, nics=2))
    ft, g = net.fattree, net.switch_graph()
    for (na, ka), (nb, kb), count in [((0, 0), (2, 0), 2),    # rail 0, leaf 0 -> leaf 1: via 2 spines
                                      ((0, 0), (3, 1), 4),    # rail 0 -> rail 1: via the 4 cores
                                      ((0, 0), (1, 0), 1)]:   # one leaf
        ea, eb = ft.endpoint([na * 2 + ka]), ft.endpoint([nb * 2 + kb])
        assert ft.path_count(ea, eb).tolist() == [count]
        la, lb = f"leaf{int(ea[0] // 2)}", f"leaf{int(eb[0] // 2)}"
        ours = set()
        for r in range(count):
            p = ft.paths(ea, eb, replica=r)[0]
            p = p[p >= 0] + net.b_up
            ours.add(tuple(_switch_path(net, p)) if len(p) else (la,))
        assert ours == {tuple(x) for x in nx.all_shortest_paths(g, la, lb)}
    # destination-mod-k: node 0 -> node 2 on rail 0: endpoint 2, up port 2 mod 2 = 0 at the leaf: spine0
    r = route(net, [0], [4])     # GPU 0 of node 0 to GPU 0 of node 2 (both on NIC 0, rail 0)
    assert _switch_path(net, r.path(0)) == ["gpu0.0", "nic0.0", "leaf0", "spine0", "leaf1", "nic2.0", "gpu2.0"]
    r = route(net, [0], [6])     # to node 3: endpoint 3, up port 1: spine1
    assert _switch_path(net, r.path(0))[3] == "spine1"
    # across rails: GPU 0 of node 0 (rail 0) to GPU 1 of node 3 (rail 1): endpoint 7, ports 7 mod 2 = 1
    # at the leaf (spine1), (7 // 2) mod 2 = 1 at the spine (core3), down to pod 1's spine 1, leaf 3
    r = route(net, [0], [7])
    assert _switch_path(net, r.path(0)) == ["gpu0.0", "nic0.0", "leaf0", "spine1", "core3", "spine3", "leaf3",
                                            "nic3.1", "gpu3.1"]
    # 2 GPU-NIC hops and 2 NIC latencies of 1 us, 5 switches and 4 cables of 0.1 us
    assert net.latency[r.path(0)].sum() == pytest.approx(2e-6 + 2e-6 + 5e-7 + 4e-7)


def test_two_flows_share_one_up_link_by_hand(tmp_path):
    """A 2-level tree whose leaves have 2 ports down and 1 up (oversubscription 2) at 10 GB/s: flows
    node 0 -> 2 and node 1 -> 3 share leaf 0's up-link (5 GB/s each); flow 1 -> 0 stays on leaf 0 and
    shares node 1's NIC link (25 GB/s) with the second flow, so it gets the 20 GB/s that flow leaves."""
    levels = [dict(name="leaf", radix=3, over=2, link_gbs=25), dict(name="spine", radix=2, link_gbs=10)]
    net = build_network(load_tree(tmp_path, levels, nodes=4, gpn=1, nics=1, rail=False))
    assert (net.fattree.down, net.fattree.up, net.fattree.switches) == ([2, 2], [1, 0], [2, 1])
    r = route(net, [0, 1, 1], [2, 3, 0])
    assert _switch_path(net, r.path(0))[2:5] == ["leaf0", "spine0", "leaf1"]
    rates = max_min_rates(r, net.capacity)
    assert rates / GB == pytest.approx([5, 5, 20])


def test_spread_flows_share_trunks_by_hand(tmp_path):
    """"spread" on the small 3-level tree (links 10 GB/s above the leaves): the 2 up-links of leaf 0
    are one 20 GB/s trunk, so 3 flows from leaf 0 (nodes 0, 1) to leaf 1 (nodes 2, 3) share 20 GB/s:
    node 1's two flows (to nodes 2 and 3 on rail 0) and node 0's one; node 0's NIC link alone would give
    it 25, the trunk gives every flow 20 / 3."""
    levels = [dict(THREE[0]), dict(THREE[1], link_gbs=10), dict(THREE[2], link_gbs=10)]
    net = build_network(load_tree(tmp_path, levels, nodes=4, gpn=2, nics=2, ecmp="spread"))
    ft = net.fattree
    assert (ft.n_trunks, net.summary()["links_by_kind"]["up-trunk"]) == (4 + 2, 6)   # 4 leaves, 2 pods
    trunk = net.capacity[net.kind == UP_TRUNK]
    assert trunk / GB == pytest.approx([20, 20, 20, 20, 40, 40])     # a leaf's 2 cables of 10; a pod's 2 x 2
    r = route(net, [0, 2, 2], [4, 4, 6])     # GPU 0 of node 0 -> node 2, GPU 0 of node 1 -> nodes 2 and 3
    kinds = [net.kind[r.path(f)].tolist() for f in range(3)]
    assert all(k.count(UP_TRUNK) == 1 and k.count(DOWN_TRUNK) == 1 and UP not in k for k in kinds)
    assert max_min_rates(r, net.capacity) / GB == pytest.approx([20 / 3] * 3)


def test_hash_collides_where_destination_does_not():
    """20 flows from the 20 nodes of one Selene leaf (rail 0) to the 20 of the next pod's... next leaf:
    destination-mod-k sends them up 20 different up-links; a (src, dst) hash piles some onto one."""
    import dataclasses
    s = load_system("selene")
    src = np.arange(20) * 8                  # GPU 0 of nodes 0..19: leaf 0
    dst = (np.arange(20) + 20) * 8           # GPU 0 of nodes 20..39: leaf 1
    for ecmp, most in (("destination", 1), ("hash", None)):
        sys_ = dataclasses.replace(s, fattree=dataclasses.replace(s.fattree, ecmp=ecmp))
        net = Network(sys_, 1)
        r = route(net, src, dst)
        ups = np.concatenate([p[net.kind[p] == UP] for p in (r.path(f) for f in range(20))])
        load = np.bincount(ups).max()
        rates = max_min_rates(r, net.capacity)
        if most is not None:
            assert load == most and rates / GB == pytest.approx(np.full(20, 25))
        else:
            assert load > 1 and rates.min() < 25 * GB


@pytest.mark.parametrize("old,new,text", [
    ('name = "core"\nradix = 40', 'name = "core"\nradix = 8', "need 16 pods of 400 NIC ports but a core switch has 8 ports"),
    ("oversubscription = 1           # non-blocking (selene.md)", "oversubscription = 0.5", "fattree.levels[0].oversubscription must be"),
    ('link_bandwidth = 25e9          # bytes/s per direction, leaf-spine', '# no rate', "fattree.levels[1].link_bandwidth is missing"),
    ('name = "spine"\nradix = 40\noversubscription = 1', 'name = "spine"\nradix = 40', "level 'spine': oversubscription is missing"),
    ('name = "core"\nradix = 40', 'name = "core"\nradix = 40\noversubscription = 1', "has no up-links, so no oversubscription"),
    ("oversubscription = 1           # non-blocking (selene.md)", "oversubscription = 2", "do not split into whole down and up ports"),
    ('ecmp = "spread"', 'ecmp = "random"', "fattree.ecmp must be one of destination, hash, spread"),
    ('[fattree]', '[network]\ngroups = 1\n[fattree]', "not both"),
    ('name = "spine"', 'name = "leaf"', "two levels share a name"),
])
def test_a_bad_fat_tree_is_refused_in_one_line(tmp_path, old, new, text):
    src = open(load_system("selene").path).read()
    assert old in src
    bad = tmp_path / "bad.toml"
    bad.write_text(src.replace(old, new, 1))
    if "[network]" in new:  # a whole dragonfly table from another file
        perl = open(load_system("perlmutter").path).read()
        net = perl[perl.index("[network]"):perl.index("[collectives]")]
        bad.write_text(src.replace("[fattree]", net + "\n[fattree]", 1))
    with pytest.raises(TwinError, match=re.escape(text)):
        load_system(str(bad))
    r = runner.invoke(app, ["topology", "--system", str(bad)])
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and text in lines[0], r.output


def test_selene_loads_and_its_rings_get_the_channel_rate():
    """Selene: 560 nodes, 16 pods, the A100 80 GB profile; a data ring of one GPU per node on one rail
    gets one channel's rate (0.65 x 25 GB/s), on one leaf or across leaves (spread evenly, the flows
    of a non-blocking tree contend only at the NICs), and the x ring the NVSwitch port's 0.76 x 300 GB/s."""
    from twin.costs.collectives import CollectiveModel
    from twin.predict.study import prepare
    from twin.program.grid import Grid
    s = load_system("selene")
    assert (s.nodes, s.gpus_per_node, s.nics_per_node, s.profile) == (560, 8, 8, "a100-80gb")
    assert build_network(s).fattree.pods == 16
    for grid in (Grid(8, 1, 1, 8), Grid(8, 1, 8, 8)):   # 8 nodes (one leaf); 64 nodes (4 leaves)
        cm = CollectiveModel(s, grid)
        assert cm.effective_bandwidth("data") == pytest.approx(0.65 * 25 * GB, rel=1e-6)
        assert cm.effective_bandwidth("x") == pytest.approx(0.76 * 300 * GB, rel=1e-6)
    # destination-mod-k: with rings over every 8th node, leaf 2 (nodes 40-59) sends to node 0 and to
    # node 60, the first nodes of leaves 0 and 3, over the same up-link: half a NIC's rate each
    import dataclasses
    static = dataclasses.replace(s, fattree=dataclasses.replace(s.fattree, ecmp="destination"))
    assert CollectiveModel(static, Grid(8, 1, 1, 8)).effective_bandwidth("data") == pytest.approx(16.25 * GB)
    assert CollectiveModel(static, Grid(8, 1, 8, 8)).effective_bandwidth("data") == pytest.approx(12.5 * GB)
    study = prepare("selene")
    assert study.profile.name == "a100-80gb" and study.profile.hbm_bandwidth == pytest.approx(1.71e12)


def test_selene_simulates():
    r = runner.invoke(app, ["simulate", "--system", "selene", "--model", "gpt-1b", "--gpus", "64", "--grid",
                            "8x1x1x8", "--batch", "64", "--json"])
    assert r.exit_code == 0, r.output
    import json
    out = json.loads(r.stdout)
    assert out["iteration_time_s"] > 0 and out["system"] == "selene"


def test_selene_draws_by_pods():
    """The drawing aggregates Selene's 1,040 switches into 16 pods per level below the top and one top
    marker; a job of 3,072 GPUs (nodes 0-383) is in the first pod of every rail."""
    from topologies.draw import topology_figure
    from topologies.placement import place
    s = load_system("selene")
    fig = topology_figure(build_network(s), place(s, 3072, "contiguous", 0))
    rows = [t for t in fig.data if t.hovertext is not None and len(t.hovertext) == 16]
    assert len(rows) == 2                                  # leaf and spine, one marker per pod
    leaf = rows[0]
    assert "rail 0 (NIC 0) of nodes 0-399; the job uses 384 of its nodes" in leaf.hovertext[0]
    assert "rail 0 (NIC 0) of nodes 400-559" in leaf.hovertext[1] and "job" not in leaf.hovertext[1]
    assert [c == "crimson" for c in leaf.marker.color] == [q % 2 == 0 for q in range(16)]
    assert any(t.text == ("400 x core",) for t in fig.data)


@pytest.mark.parametrize("levels,rail,ecmp", [
    ([dict(name="switch", radix=16)], False, "destination"),                                   # one switch
    ([dict(name="leaf", radix=6, over=2), dict(name="spine", radix=8)], True, "hash"),          # 4 down, 2 up
    ([dict(name="l0", radix=4, over=1), dict(name="l1", radix=4, over=1), dict(name="l2", radix=6, over=2),
      dict(name="l3", radix=8)], False, "destination"),                                         # four levels
    (THREE, True, "spread"),
])
def test_every_route_is_a_walk_from_gpu_to_gpu(tmp_path, levels, rail, ecmp):
    """Whatever the levels, rails and rule: every flow's links join end to end, from its GPU to the
    other, climbing no higher than the lowest common level (up links, then as many down links)."""
    net = build_network(load_tree(tmp_path, levels, nodes=8, gpn=2, nics=2, rail=rail, ecmp=ecmp))
    n = net.n_gpus
    src, dst = np.divmod(np.arange(n * n), n)
    keep = src != dst
    r = route(net, src[keep], dst[keep])
    for f, (a, b) in enumerate(zip(src[keep], dst[keep])):
        p = r.path(f)
        assert net.src[p[0]] == a and net.dst[p[-1]] == b
        assert (net.dst[p[:-1]] == net.src[p[1:]]).all()
        kinds = net.kind[p].tolist()
        ups = sum(k in (UP, UP_TRUNK) for k in kinds)
        assert ups == sum(k in (DOWN, DOWN_TRUNK) for k in kinds) <= len(levels) - 1


def test_solo_bound_holds_on_a_fat_tree():
    """The search's routing-free bound stays below the routed time of every collective on Selene, nodes
    scattered over leaves and pods (its links are those every path crosses: GPU, NIC and leaf ports)."""
    from twin.costs.solobound import SoloBound
    from twin.predict.search import rank_grids
    from twin.predict.study import prepare
    from twin.predict.study_cache import model_for, program_for
    study = prepare("selene", "gpt-1b", 64, batch=64, placement="scattered")
    for g in [c.grid for c in rank_grids(study)][:4]:
        cm = model_for(study, g)
        sb = SoloBound(cm)
        for op in {(op.kind, op.axis, op.bytes) for op in program_for(study, g).ops if op.is_collective}:
            assert sb.time(*op) <= cm.time(*op), (g, op)


def test_the_80_gb_a100_has_its_profile():
    from twin.costs.profile import profile_for_gpu
    assert profile_for_gpu("NVIDIA A100 80GB").name == "a100-80gb"
    assert profile_for_gpu("NVIDIA A100 40GB").name == "a100"
    assert profile_for_gpu("a100-80gb").hbm_bandwidth > profile_for_gpu("a100").hbm_bandwidth


def test_a_tree_far_larger_than_its_nics_is_refused(tmp_path):
    """Pods are built whole: two levels of 4,096 ports under a top make pods of 4 M NIC ports, 8 of them
    for 32 NICs (33 M cables), which the loader refuses before building anything."""
    big = [dict(name="leaf", radix=4096, over=1), dict(name="spine", radix=4096, over=1), dict(name="core", radix=8)]
    with pytest.raises(TwinError, match="use fewer levels or a smaller radix"):
        load_tree(tmp_path, big, nodes=4, gpn=8, nics=8)


def test_a_gpu_shares_its_nvswitch_port_among_its_peers(tmp_path):
    """With `nvswitch_gbs` a GPU-GPU hop crosses the sender's port out and the receiver's port in (a walk
    through the node's switch): GPU 0 sending to GPUs 1 and 2 of its node at once gets 60 / 2 GB/s
    each (the 100 GB/s pair links no longer bind), and GPU 3 -> 1 shares GPU 1's port in with 0 -> 1."""
    net = build_network(load_tree(tmp_path, THREE, nodes=4, gpn=4, nics=2, nvswitch=60))
    assert net.summary()["links_by_kind"]["gpu-nvswitch"] == 16 and net.n_vertices == net.nvs0 + 4
    r = route(net, [0, 0, 3], [1, 2, 1])
    assert _switch_path(net, r.path(0)) == ["gpu0.0", "nvswitch0", "gpu0.1"]
    assert [net.kind[r.path(f)].tolist() for f in range(3)] == [[GPU_PORT, PORT_GPU]] * 3
    assert max_min_rates(r, net.capacity) / GB == pytest.approx([30, 30, 30])
    # across nodes the hop to the NIC's GPU crosses the ports too: GPU 0 -> GPU 5 (node 1) through the
    # NIC of GPU 1 (on rail 1): 0 -> switch -> 1, then the NIC path
    r = route(net, [0], [5], src_nic_gpu=[1], dst_nic_gpu=[5])
    assert _switch_path(net, r.path(0))[:4] == ["gpu0.0", "nvswitch0", "gpu0.1", "nic0.1"]


def test_selene_axes_inside_a_node_share_the_ports():
    """Selene's tensor-parallel ring alone gets 0.76 x 300 GB/s; two axes inside the node at once (x = 2,
    y = 4) share every GPU's port: half each."""
    from twin.costs.collectives import CollectiveModel
    from twin.program.grid import Grid
    cm = CollectiveModel(load_system("selene"), Grid(2, 4, 1, 8))
    for a, b in (("x", "y"), ("y", "x")):
        assert cm.effective_bandwidth(a) == pytest.approx(228 * GB)
        assert cm.effective_bandwidth(a, frozenset({b})) == pytest.approx(114 * GB)
