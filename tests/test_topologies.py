"""System specs, the dragonfly graph, routing, placement, and the `twin systems` / `twin topology` commands."""

import copy
import re

import numpy as np
import pytest
from typer.testing import CliRunner

from topologies.network import GLOBAL, GPU_GPU, LOCAL, NIC_SW, Network, build_network
from topologies.placement import place
from topologies.routing import MODES, minimal, route, valiant
from topologies.system import list_systems, load_system
from twin.cli.main import app
from topologies.common import TwinError
from twin.program.grid import Grid

runner = CliRunner()
GB = 1e9


@pytest.fixture(scope="module")
def frontier():
    return build_network(load_system("frontier"))


def test_every_system_loads_with_its_default_study():
    assert set(list_systems()) >= {"frontier", "perlmutter", "alps", "h200", "cpu"}
    expect = {"frontier": ("gpt-320b", 32768), "perlmutter": ("gpt-40b", 4096), "alps": ("gpt-60b", 6144),
              "h200": ("gpt-1b", 1), "cpu": ("gpt-tiny", 8)}
    for name, (model, gpus) in expect.items():
        s = load_system(name)
        assert (s.default_model, s.default_gpus) == (model, gpus)
        assert s.gpu.peak_flops > 0 and s.gpu.hbm_bytes > 0 and s.gpu.hbm_bandwidth > 0
    assert load_system("frontier").gpu.hbm_bytes == 64 * 2**30
    assert load_system("frontier").total_gpus == 9408 * 8


def test_node_internal_bandwidths_match_the_facts():
    f = load_system("frontier").node_links / GB
    for p in range(4):  # the two GCDs of a package: 200 GB/s
        assert f[2 * p, 2 * p + 1] == 200
    cross = f[np.array([[i // 2 != j // 2 for j in range(8)] for i in range(8)])]
    assert cross.min() == 50 and cross.max() == 100      # 1 or 2 Infinity Fabric links
    assert (load_system("perlmutter").node_links / GB)[~np.eye(4, dtype=bool)].tolist() == [100] * 12
    assert (load_system("alps").node_links / GB)[~np.eye(4, dtype=bool)].tolist() == [150] * 12
    assert load_system("frontier").gpu_nic == (0, 0, 1, 1, 2, 2, 3, 3)
    assert load_system("perlmutter").nic_bandwidth == 25 * GB


def test_network_link_arrays_agree_with_formulas(frontier):
    net = frontier
    assert net.groups == 74 and net.nodes == 9408 and net.n_switches == 74 * 32
    i = net.gpu_link(8 * 5 + 0, 8 * 5 + 1)
    assert (net.src[i], net.dst[i], net.kind[i]) == (40, 41, GPU_GPU) and net.capacity[i] == 200 * GB
    j = net.global_link(3, 70, 2)
    assert net.kind[j] == GLOBAL and net.src[j] - net.sw0 == net.global_switch(3, 70, 2)
    assert net.dst[j] - net.sw0 == net.global_switch(70, 3, 2)
    assert net.link_index(net.src[j], net.dst[j]) == j
    assert net.link_index(40, 41) == i
    with pytest.raises(KeyError):
        net.link_index(40, 40)


def test_per_group_switch_and_endpoint_counts(frontier):
    net = frontier
    sw = net.dst[net.kind == NIC_SW] - net.sw0
    per_switch = np.bincount(sw, minlength=net.n_switches)
    full_groups = per_switch[: 73 * 32]
    assert full_groups.max() == 16 and full_groups.min() == 16     # 128 nodes x 4 NICs on 32 switches
    assert np.bincount(sw // 32).tolist()[:73] == [512] * 73 and np.bincount(sw // 32)[73] == 256  # 64 nodes left
    loc = net.kind == LOCAL
    grp = (net.src[loc] - net.sw0) // 32
    assert (grp == (net.dst[loc] - net.sw0) // 32).all()
    assert np.bincount(grp).tolist() == [32 * 31] * 74                # all-to-all inside a group


def test_global_links_between_every_pair_of_groups(frontier):
    net = frontier
    g = net.kind == GLOBAL
    a, b = (net.src[g] - net.sw0) // 32, (net.dst[g] - net.sw0) // 32
    counts = np.zeros((74, 74), dtype=int)
    np.add.at(counts, (a, b), 1)
    off = ~np.eye(74, dtype=bool)
    assert (counts[off] == 4).all() and (counts.diagonal() == 0).all()
    ports = np.bincount(net.src[g] - net.sw0, minlength=net.n_switches)
    assert ports.max() <= 16                                           # global ports per switch


def test_minimal_paths_have_at_most_three_switch_hops(frontier):
    net = frontier
    rng = np.random.default_rng(1)
    s, d = rng.integers(0, net.n_switches, 5000), rng.integers(0, net.n_switches, 5000)
    m = minimal(net, s, d)
    hops = (m >= 0).sum(1)
    assert hops.max() == 3 and (hops[s == d] == 0).all()
    assert (net.kind[m[m >= 0]] >= LOCAL).all()
    for row, a, b in zip(m[:200], s[:200], d[:200]):   # consecutive links form a path from a to b
        links = row[row >= 0]
        if len(links):
            assert net.src[links[0]] == net.sw0 + a and net.dst[links[-1]] == net.sw0 + b
            assert (net.dst[links[:-1]] == net.src[links[1:]]).all()
    v = valiant(net, s, d, seed=3)
    assert ((v >= 0).sum(1) <= 5).all()
    for row, a, b in zip(v[:200], s[:200], d[:200]):
        links = row[row >= 0]
        if len(links):
            assert net.src[links[0]] == net.sw0 + a and net.dst[links[-1]] == net.sw0 + b
            assert (net.dst[links[:-1]] == net.src[links[1:]]).all()


@pytest.mark.parametrize("mode", MODES)
def test_gpu_routes_are_connected_paths(frontier, mode):
    net = frontier
    rng = np.random.default_rng(2)
    src, dst = rng.integers(0, net.n_gpus, 3000), rng.integers(0, net.n_gpus, 3000)
    r = route(net, src, dst, mode=mode)
    for f in range(0, 3000, 97):
        p = r.path(f)
        if src[f] == dst[f]:
            assert len(p) == 0
            continue
        assert net.src[p[0]] == src[f] and net.dst[p[-1]] == dst[f]
        assert (net.dst[p[:-1]] == net.src[p[1:]]).all()
    same_node = (src // 8) == (dst // 8)
    assert (np.diff(r.ptr)[same_node & (src != dst)] == 1).all()


def test_partial_network_builds_only_the_groups_a_job_touches():
    s = load_system("frontier")
    net = build_network(s, nodes=300)
    assert net.groups == 3 and net.nodes == 384
    assert build_network(s, nodes=1).groups == 1
    assert build_network(load_system("h200")).n_links == 0


def test_placement_fills_nodes_and_keeps_x_groups_inside_a_node():
    s = load_system("frontier")
    g = Grid(8, 8, 4, 128)
    p = place(s, g.size)
    assert len(p.nodes) == 4096 and (p.local == np.arange(g.size) % 8).all()
    for grp in g.groups("x")[:50] + g.groups("x")[-50:]:
        assert len(set(p.node[grp].tolist())) == 1
    perl = place(load_system("perlmutter"), 64)
    assert all(len(set(perl.node[grp].tolist())) == 1 for grp in Grid(4, 2, 2, 4).groups("x"))
    sc = place(s, g.size, "scattered", seed=5)
    assert len(set(sc.nodes.tolist())) == 4096 and len(sc.groups_used()) > 32
    assert (sc.nodes == place(s, g.size, "scattered", seed=5).nodes).all()
    for grp in g.groups("x")[:50]:
        assert len(set(sc.node[grp].tolist())) == 1


def test_a_job_larger_than_the_machine_is_refused():
    with pytest.raises(TwinError, match="needs 9409 nodes"):
        place(load_system("frontier"), 9408 * 8 + 1)
    with pytest.raises(TwinError, match="unknown placement"):
        place(load_system("frontier"), 8, "random")


def _one_line_error(result, text):
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and result.exception is None or isinstance(result.exception, SystemExit)
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and text in lines[0], result.output


def test_cli_systems_and_topology(tmp_path):
    r = runner.invoke(app, ["systems"])
    assert r.exit_code == 0 and "frontier" in r.output and "perlmutter" in r.output and "gpt-320b" in r.output
    out = tmp_path / "f.html"
    r = runner.invoke(app, ["topology", "--system", "perlmutter", "--html", str(out)])
    assert r.exit_code == 0, r.output
    assert "14 groups" in r.output and out.exists() and "plotly" in out.read_text()[:20000].lower()


def test_cli_topology_with_a_grid():
    r = runner.invoke(app, ["topology", "--system", "perlmutter", "--grid", "4x2x2x4"])
    assert r.exit_code == 0, r.output
    assert "ring bandwidth per axis" in r.output and "152.0" in r.output  # x: 2-direction NVLink ring in a node
    assert "8.3" in r.output   # y, z, data each take one of 3 channels sharing a 25 GB/s NIC
    _one_line_error(runner.invoke(app, ["topology", "--system", "perlmutter", "--grid", "4x2x2"]), "not of the form")


def test_cli_unknown_system_and_too_large_a_job():
    _one_line_error(runner.invoke(app, ["topology", "--system", "summit"]), "unknown system 'summit'")
    _one_line_error(runner.invoke(app, ["topology", "--system", "nowhere/x.toml"]), "does not exist")
    _one_line_error(runner.invoke(app, ["topology", "--system", "frontier", "--gpus", "100000"]),
                    "needs 12500 nodes")


@pytest.mark.parametrize("edit,text", [
    (lambda t: t + "\n[[[", "malformed system file"),
    (lambda t: t[:t.index("[network]")] + t[t.index("[collectives]"):], "need a [network] table"),
    (lambda t: t.replace("[network]", "[netw]"), "netw is not a known key of the top level"),
    (lambda t: t.replace("nic_bandwidth = 25e9", "nic_bandwidth = \"fast\""), "node.nic_bandwidth must be a finite number"),
    (lambda t: t.replace("[  0, 100, 100, 100],", "[  0, 100, 100],"), "links_gbs must be a 4x4 matrix"),
    (lambda t: t.replace("groups = 14 ", "groups = 2 "), "hold fewer than"),
    (lambda t: t.replace("nic_bandwidth = 25e9", "nic_bandwith = 25e9"), "node.nic_bandwith is not a known key of node"),
    (lambda t: t.replace("global_links_per_pair = 12", "global_links_per_pair = 40"), "between 1 and switches_per_group"),
    (lambda t: t.replace("endpoints_per_switch = 16", "endpoints_per_switch = 30"), "a Rosetta switch has 64"),
])
def test_cli_malformed_system_file(tmp_path, edit, text):
    src = load_system("perlmutter").path
    bad = tmp_path / "bad.toml"
    bad.write_text(edit(open(src).read()))
    with pytest.raises(TwinError, match=re.escape(text)):
        load_system(str(bad))
    _one_line_error(runner.invoke(app, ["topology", "--system", str(bad)]), text)


def test_networkx_views_agree_with_the_arrays():
    import networkx as nx
    net = build_network(load_system("perlmutter"))
    sw = net.switch_graph()
    assert sw.number_of_nodes() == 14 * 32
    assert nx.diameter(sw) == 3                     # local, global, local
    alps = build_network(load_system("alps"), nodes=200)
    g = alps.graph
    assert g.number_of_edges() == alps.n_links                    # no parallel links
    for u, v, data in list(g.edges(data=True))[::997]:
        i = data["link"]
        assert (alps.src[i], alps.dst[i]) == (u, v) and data["capacity"] == alps.capacity[i]
        assert data["latency"] == alps.latency[i] > 0
    # networkx agrees with the routing: the lowest-latency path between GPUs of two groups has the
    # latency of our minimal route (GPU, NIC, 3 switch hops, NIC, GPU)
    a, b = 0, 150 * 4 + 3                                          # node 0 (group 0) to node 150 (group 1)
    nx_lat = nx.shortest_path_length(g, a, b, weight="latency")
    r = route(alps, [a], [b], mode="minimal")
    assert nx_lat <= alps.latency[r.path(0)].sum() + 1e-12
    assert len(nx.shortest_path(g, a, b)) - 1 <= len(r.path(0))


def _adaptive_by_definition(net, s, d, demand, seed, batch=128, detours=4, hop_weight=0.1):
    """adaptive() as first written (one numpy pass per batch over padded candidates): the fast one must
    choose exactly the same paths."""
    n = len(s)
    cap_ext = np.append(net.capacity, np.inf)
    dem = np.broadcast_to(np.asarray(net.capacity.max() if demand is None else demand, dtype=float), (n,))
    cand = np.concatenate([np.pad(minimal(net, s, d, j), ((0, 0), (0, 2)), constant_values=-1)[:, :, None]
                           for j in range(max(net.L, 1))]
                          + [valiant(net, s, d, seed + 7919 * k)[:, :, None] for k in range(detours)], axis=2)
    load = np.zeros(net.n_links + 1)
    out = np.empty((n, 5), dtype=np.int64)
    for idx in np.array_split(np.random.default_rng(seed + 1).permutation(n), max(1, -(-n // batch))):
        c = cand[idx]
        cost = (1 + hop_weight * (c >= 0).sum(1)) * ((load[c] + dem[idx, None, None]) / cap_ext[c]).max(1)
        out[idx] = c[np.arange(len(idx)), :, cost.argmin(1)]
        np.add.at(load, out[idx].ravel(), np.repeat(dem[idx], 5))
    return out


@pytest.mark.parametrize("name", ["frontier", "alps", "perlmutter", "two-groups"])
def test_candidate_tables_give_the_paths_of_the_formulas(name):
    """adaptive()'s candidates, read from the cable tables, are minimal(j) for every cable j and the
    Valiant paths of its draws, as the link formulas give them."""
    from topologies.adaptive import _candidates
    from topologies.routing import _valiant_draws
    system = load_system("frontier" if name == "two-groups" else name)
    net = Network(system, 2) if name == "two-groups" else build_network(system)
    rng = np.random.default_rng(3)
    s, d = rng.integers(0, net.n_switches, 4000), rng.integers(0, net.n_switches, 4000)
    d[:300] = s[:300] - s[:300] % net.S + rng.integers(0, net.S, 300)   # same group
    s, d = s[s != d], d[s != d]
    L = max(net.L, 1)
    for part in (slice(None), slice(300, None)):   # with and without flows inside one group
        ss, dd = s[part], d[part]
        draws = [_valiant_draws(net, ss, dd, seed) for seed in (0, 5)]
        every = _candidates(net, ss, dd, draws, L)
        for j in range(L):
            assert np.array_equal(every[:3, :, j].T, minimal(net, ss, dd, j))
            assert (every[3:, :, j] == -1).all()
        for k, seed in enumerate((0, 5)):
            assert np.array_equal(every[:, :, L + k].T, valiant(net, ss, dd, seed))


def test_live_draws_are_the_valiant_draws_of_those_flows():
    from topologies.adaptive import _live_draws
    from topologies.routing import _valiant_draws
    system = load_system("frontier")
    rng = np.random.default_rng(5)
    for net in (build_network(system), Network(system, 2)):
        s, d = rng.integers(0, net.n_switches, 3000), rng.integers(0, net.n_switches, 3000)
        s[:500] = d[:500]
        d[500:1000] = s[500:1000] - s[500:1000] % net.S + rng.integers(0, net.S, 500)   # same group
        live = rng.permutation(3000)[:2000]
        for seed, got in zip((3, 11), _live_draws(net, s, d, live, [3, 11])):
            for x, y in zip(got, _valiant_draws(net, s, d, seed)):
                assert np.array_equal(x, y[live])


@pytest.mark.parametrize("name", ["frontier", "alps", "perlmutter"])
def test_adaptive_routing_chooses_as_its_definition(name):
    from topologies.adaptive import adaptive
    net = build_network(load_system(name))
    rng = np.random.default_rng(4)
    # 40000 flows take several chunks of laid-out candidates (one demand for all: added as a scalar);
    # 500 all stay on their switch
    for n, uneven in [(1, False), (300, False), (6000, False), (40000, False), (500, False), (3000, True)]:
        s, d = rng.integers(0, net.n_switches, n), rng.integers(0, net.n_switches, n)
        s[:n // 10 if n != 500 else n] = d[:n // 10 if n != 500 else n]   # some flows stay on their switch
        demand = None if n == 1 else 1.25e9 if n == 40000 else rng.choice([1.25e9, 3e9, 0.7e9], n)
        if uneven:  # switch links of unequal capacity take the general path
            net = copy.copy(net)
            net.capacity = net.capacity * rng.choice([1.0, 0.5, 2.0], net.n_links)
        assert np.array_equal(adaptive(net, s, d, demand, seed=n), _adaptive_by_definition(net, s, d, demand, n))


def test_adaptive_routing_chooses_as_its_definition_where_a_link_holds_hundreds_of_flows():
    """adaptive() looks a path's cost up by its busiest link's flow count in a table of a few hundred
    counts that grows on demand: 12,000 flows from one switch to another of its group share the
    direct link and 30 detours, several hundred on each, and choose as the definition does."""
    from topologies.adaptive import adaptive
    net = Network(load_system("frontier"), 2)
    s, d = np.zeros(12000, dtype=np.int64), np.ones(12000, dtype=np.int64)
    got = adaptive(net, s, d, 1.25e9, seed=3)
    assert np.bincount(got[got >= 0]).max() > 300
    assert np.array_equal(got, _adaptive_by_definition(net, s, d, 1.25e9, 3))
    # one demand on switch links of unequal capacity (the general path, demands read per flow)
    uneven = copy.copy(net)
    uneven.capacity = net.capacity * np.random.default_rng(2).choice([1.0, 0.5, 2.0], net.n_links)
    s, d = np.random.default_rng(6).integers(0, net.n_switches, (2, 3000))
    assert np.array_equal(adaptive(uneven, s, d, 1.25e9, seed=4), _adaptive_by_definition(uneven, s, d, 1.25e9, 4))


def test_routes_from_matrix_is_the_rows_without_holes():
    """Routes.from_matrix compacts by blocks of rows: the same CSR as the plain definition."""
    from topologies.routing import Routes
    rng = np.random.default_rng(9)
    for n in (0, 1, 40000):
        m = rng.integers(0, 10**6, (n, 7)).astype(np.int32)
        m[rng.random((n, 7)) < 0.4] = -1
        r = Routes.from_matrix(m)
        assert r.links.dtype == np.int64 and np.array_equal(r.links, m[m >= 0])
        assert np.array_equal(r.ptr, np.concatenate([[0], np.cumsum((m >= 0).sum(1))]))


def test_same_block_is_floor_division():
    from topologies.network import same_block
    rng = np.random.default_rng(8)
    a = rng.integers(-3000, 3000, 20000)
    b = a + rng.integers(-40, 40, 20000)
    for k in (1, 2, 8, 64, 3, 12):
        assert np.array_equal(same_block(a, b, k), a // k == b // k)


def test_a_network_keeps_its_key_however_many_arrays_were_keyed_since():
    """The key a network's arrays were given at construction lasts as long as they do: keying many
    other arrays in between (a long test session, a study over many grids) left an equal network
    another key once the memo of keys was cleared (CI, 2026-12-02: the test below, run late)."""
    from topologies.memo import array_key
    from topologies.routing import network_key
    net = Network(load_system("alps"), 2)
    others = [np.arange(k, k + 3) for k in range(600)]  # live, so their keys are kept too
    keys = [array_key(a) for a in others]
    assert network_key(net) == network_key(Network(load_system("alps"), 2))
    assert keys == [array_key(a) for a in others]
    from topologies.memo import _ARRAY_KEYS
    held = len(_ARRAY_KEYS)
    del others
    assert len(_ARRAY_KEYS) <= held - 600  # an array's entry goes with it: the memo holds live arrays only


def test_network_arrays_are_read_only_and_keys_follow_a_replaced_capacity():
    """Memos key a network by its system (no hashing of its link arrays): the arrays cannot change in
    place, and a copy given other capacities (as the adaptive-routing test does) gets another key."""
    from topologies.memo import array_key
    from topologies.routing import network_key
    net = Network(load_system("alps"), 2)
    with pytest.raises(ValueError):
        net.capacity[0] = 1.0
    other = copy.copy(net)
    other.capacity = net.capacity * 0.5
    assert network_key(other) != network_key(net)
    assert array_key(net.latency) != array_key(net.capacity)
    assert network_key(Network(load_system("alps"), 2)) == network_key(net)
