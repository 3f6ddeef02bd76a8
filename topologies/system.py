"""System specs: what a machine is, loaded from the TOML data files in topologies/systems/.

Units everywhere: flop/s for compute rates, bytes for sizes, bytes/s per direction for link and NIC
rates, seconds for latencies. In the files, `hbm_gib` is in GiB (2^30 bytes) and the node link matrix
`links_gbs` in GB/s (1e9 bytes/s); the loader converts both.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from topologies.datafile import read_spec, shipped
from topologies.common import InputError
from topologies.fattree import FatTreeSpec, parse_fat_tree
from topologies.schema import SYSTEM, check

SYSTEMS_DIR = Path(__file__).parent / "systems"
GIB = 2 ** 30
SWITCH_PORTS = 64  # Rosetta switch ports (systems.md: De Sensi et al., SC'20)


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator (or, for the CPU host, one rank's share of the CPU)."""

    name: str
    peak_flops: float       # dense bf16, flop/s
    hbm_bytes: int          # device memory, bytes
    hbm_bandwidth: float    # device memory bandwidth, bytes/s
    gemm_flops: float = 0.0  # what large bf16 GEMMs reach in practice, flop/s (informational; 0 if unknown)


@dataclass(frozen=True)
class DragonflySpec:
    """A Slingshot dragonfly: groups of switches joined all-to-all inside a group, global links between groups."""

    groups: int
    switches_per_group: int
    endpoints_per_switch: int   # NIC ports per switch
    nodes_per_group: int
    global_links_per_pair: int  # links between every pair of groups
    link_bandwidth: float       # bytes/s per direction of a switch port (local and global links, NIC-switch)
    switch_latency: float       # s per switch traversal
    nic_latency: float          # s per NIC injection or ejection
    local_cable_latency: float  # s, switch-switch inside a group
    global_cable_latency: float  # s, between groups


@dataclass(frozen=True)
class CollectiveSpec:
    """How the collective library behaves on this system."""

    library: str
    ring_only: tuple[str, ...]           # collective kinds the library runs only as rings
    intra_node_efficiency: float         # fraction of a GPU-GPU link a ring step reaches (0..1]
    inter_node_channel_efficiency: float  # fraction of the NIC rate one ring channel reaches across nodes (0..1]
    step_latency: float                  # software latency per algorithm step, s
    inter_node_step_floor: float = 0.0   # least time of one step of a ring that leaves its node, s
    step_floor_per_rank: float = 0.0     # added to that floor per member of the ring, s
    node_ring_directions: int = 2        # directions a ring inside one node runs in (1 or 2)
    name: str = "default"                # the name of this set of figures (variants: `load_system("sys:name")`)
    source: str = ""                     # where a variant's figures come from


@dataclass(frozen=True)
class FileSystemSpec:
    """The parallel file system checkpoints go to: bandwidths in bytes/s, 0 where the file gives none
    (the whole file system's, and one node's share), and where the figures come from."""

    name: str
    source: str
    write_bandwidth: float = 0.0
    read_bandwidth: float = 0.0
    write_bandwidth_per_node: float = 0.0
    read_bandwidth_per_node: float = 0.0

    def rate(self, direction: str, nodes: int) -> float:
        """Bytes/s that `nodes` nodes reach writing or reading ('write', 'read'): the least of the
        whole file system's figure and nodes x the per-node one (each where given); 0 if neither."""
        total, per_node = getattr(self, f"{direction}_bandwidth"), getattr(self, f"{direction}_bandwidth_per_node")
        rates = [r for r in (total, nodes * per_node) if r > 0]
        return min(rates) if rates else 0.0


@dataclass(frozen=True)
class SystemSpec:
    """A whole machine. `node_links[i, j]` is the GPU i -> GPU j bandwidth inside a node, bytes/s
    (0 on the diagonal); `gpu_nic[i]` is the NIC that local GPU i uses."""

    name: str
    description: str
    gpu: GPUSpec
    gpus_per_node: int
    nodes: int
    nics_per_node: int
    nic_bandwidth: float        # bytes/s per direction per NIC
    gpu_nic_bandwidth: float    # bytes/s per direction of a GPU's attachment to its NIC
    link_latency: float         # s per GPU-GPU or GPU-NIC hop
    node_links: np.ndarray      # (gpus_per_node, gpus_per_node) bytes/s
    gpu_nic: tuple[int, ...]
    dragonfly: DragonflySpec | None
    collectives: CollectiveSpec
    default_model: str
    default_gpus: int
    default_batch: int = 0      # global batch of the default study, sequences (0: the model's)
    sources: tuple[str, ...] = field(default=())
    collective_sets: tuple[CollectiveSpec, ...] = field(default=())  # every named set of the file, the default first
    node_mtbf_h: float = 0.0    # a node's mean time between job-stopping failures, hours (0: not given)
    path: str = ""
    fattree: FatTreeSpec | None = None  # the network when it is a fat tree (then `dragonfly` is None)
    node_port_bandwidth: float = 0.0  # bytes/s per direction of a GPU's port into a node switch (NVSwitch); 0: none
    profile: str = ""           # the kernel profile the file names (twin/profiles), "" to pick one by GPU name
    filesystem: FileSystemSpec | None = None  # where checkpoints go (None: the file gives no figures)

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def groups(self) -> int:
        return self.dragonfly.groups if self.dragonfly else 1

    @property
    def nodes_per_group(self) -> int:
        return self.dragonfly.nodes_per_group if self.dragonfly else self.nodes

    def group_of_node(self, node):
        """Dragonfly group of a node index (works on numpy arrays)."""
        return node // self.nodes_per_group


def list_systems() -> list[str]:
    """Names of the systems that ship with the twin."""
    return shipped(SYSTEMS_DIR)


def _get(table: dict, key: str, where: str, kind=float):
    if key not in table:
        raise InputError(f"system file {where}: missing key {key!r}")
    v = table[key]
    if kind is float and isinstance(v, int) and not isinstance(v, bool):
        v = float(v)
    if not isinstance(v, kind) or isinstance(v, bool):
        raise InputError(f"system file {where}: {key} must be a {kind.__name__}, got {v!r}")
    if kind in (int, float) and v < 0:
        raise InputError(f"system file {where}: {key} must be >= 0, got {v!r}")
    return v


def _table(data: dict, key: str, path: Path) -> dict:
    t = data.get(key)
    if not isinstance(t, dict):
        raise InputError(f"system file {path}: missing table [{key}]")
    return t


def load_system(name_or_path: str) -> SystemSpec:
    """Load a system by name (a shipped spec, see `list_systems()`) or from the path of a .toml file.
    `NAME:VARIANT` takes the system with one of its named collective variants (its file's
    [[collectives.variants]]) in place of the default [collectives], e.g. "frontier:axonn-table"."""
    base, sep, variant = name_or_path.rpartition(":")
    if not sep or "/" in variant or "\\" in variant:
        base, variant = name_or_path, ""
    path, data = read_spec(base, SYSTEMS_DIR, "system")
    check(data, SYSTEM, path, "system")  # types, ranges and known keys; _parse checks the relations
    spec = _parse(data, path)
    return with_collectives(spec, variant) if variant else spec


def with_collectives(system: SystemSpec, name: str) -> SystemSpec:
    """`system` with its collective variant `name` (or its default set, by its name) in place of
    [collectives]; InputError naming the variants there are if it has none of that name."""
    sets = system.collective_sets or (system.collectives,)
    for c in sets:
        if c.name == name:
            return replace(system, collectives=c)
    raise InputError(f"system {system.name} has no collective variant {name!r}: choose one of "
                     f"{', '.join(c.name for c in sets)}")


def _collectives(c: dict, w: str) -> tuple[CollectiveSpec, ...]:
    """The default [collectives], then its named variants (each the default with its keys replaced)."""
    keys = ("intra_node_efficiency", "inter_node_channel_efficiency", "step_latency")
    coll = CollectiveSpec(library=_get(c, "library", w, str), ring_only=tuple(c.get("ring_only", [])),
                          **{k: _get(c, k, w) for k in keys},
                          inter_node_step_floor=float(c.get("inter_node_step_floor", 0.0)),
                          step_floor_per_rank=float(c.get("step_floor_per_rank", 0.0)),
                          node_ring_directions=int(c.get("node_ring_directions", 2)),
                          name=str(c.get("name", "default")))
    variants = []
    for v in c.get("variants", []):
        if v["name"] in [coll.name] + [x.name for x in variants]:
            raise InputError(f"system file {w}: two collective variants are named {v['name']!r}")
        kw = {k: (tuple(x) if k == "ring_only" else x) for k, x in v.items()}
        variants.append(replace(coll, **kw))
    return (coll, *variants)


def _parse(data: dict, path: Path) -> SystemSpec:
    g, n, c, d = (_table(data, k, path) for k in ("gpu", "node", "collectives", "default"))
    w = f"{path} [gpu]"
    gpu = GPUSpec(name=_get(g, "name", w, str), peak_flops=_get(g, "peak_flops", w),
                  hbm_bytes=int(_get(g, "hbm_gib", w) * GIB), hbm_bandwidth=_get(g, "hbm_bandwidth", w),
                  gemm_flops=float(g.get("gemm_flops", 0.0)))
    if gpu.peak_flops <= 0 or gpu.hbm_bytes <= 0 or gpu.hbm_bandwidth <= 0:
        raise InputError(f"system file {w}: peak_flops, hbm_gib and hbm_bandwidth must be positive")
    w = f"{path} [node]"
    gpn, nodes, nics = _get(n, "gpus_per_node", w, int), _get(n, "nodes", w, int), _get(n, "nics_per_node", w, int)
    if gpn < 1 or nodes < 1:
        raise InputError(f"system file {w}: gpus_per_node and nodes must be at least 1")
    links = n.get("links_gbs")
    try:
        mat = np.array(links, dtype=float) * 1e9
    except (TypeError, ValueError):
        mat = None
    if mat is None or mat.shape != (gpn, gpn):
        raise InputError(f"system file {w}: links_gbs must be a {gpn}x{gpn} matrix of GB/s (one row per GPU)")
    off = ~np.eye(gpn, dtype=bool)
    if (mat[off] <= 0).any() or (mat != mat.T).any():
        raise InputError(f"system file {w}: links_gbs must be symmetric with a positive bandwidth for every "
                        "pair of GPUs (full mesh; give a slow pair its routed bandwidth)")
    gpu_nic = n.get("gpu_nic", [])
    if nics and (len(gpu_nic) != gpn or any(not isinstance(x, int) or not 0 <= x < nics for x in gpu_nic)):
        raise InputError(f"system file {w}: gpu_nic must list, for each of the {gpn} GPUs, a NIC in 0..{nics - 1}")
    dragonfly = fattree = None
    if "network" in data and "fattree" in data:
        raise InputError(f"system file {path}: a network is a dragonfly ([network]) or a fat tree ([fattree]), "
                         "not both: remove one table")
    if "network" in data:
        dragonfly = _dragonfly(data["network"], f"{path} [network]", nodes, nics)
    elif "fattree" in data:
        if nodes > 1 and nics < 1:
            raise InputError(f"system file {path} [node]: a fat tree needs NICs (nics_per_node >= 1)")
        fattree = parse_fat_tree(data["fattree"], f"{path} [fattree]", nodes, nics)
    elif nodes > 1:
        raise InputError(f"system file {path}: {nodes} nodes need a [network] table (the dragonfly) "
                         "or a [fattree] table")
    w = f"{path} [collectives]"
    sets = _collectives(c, w)
    coll = sets[0]
    for k in ("intra_node_efficiency", "inter_node_channel_efficiency"):
        if not 0 < getattr(coll, k) <= 1:
            raise InputError(f"system file {w}: {k} must be in (0, 1], got {getattr(coll, k)}")
    w = f"{path} [default]"
    spec = SystemSpec(
        name=str(data.get("name", path.stem)), description=str(data.get("description", "")), gpu=gpu,
        gpus_per_node=gpn, nodes=nodes, nics_per_node=nics,
        nic_bandwidth=_get(n, "nic_bandwidth", f"{path} [node]"),
        gpu_nic_bandwidth=_get(n, "gpu_nic_bandwidth", f"{path} [node]"),
        link_latency=_get(n, "link_latency", f"{path} [node]"), node_links=mat, gpu_nic=tuple(gpu_nic),
        dragonfly=dragonfly, collectives=coll, collective_sets=sets, default_model=_get(d, "model", w, str),
        default_gpus=_get(d, "gpus", w, int), default_batch=int(d.get("batch", 0)), sources=tuple(data.get("sources", ())), path=str(path),
        node_mtbf_h=float(data.get("failures", {}).get("node_mtbf_h", 0.0)), fattree=fattree,
        profile=str(data.get("profile", "")), node_port_bandwidth=float(n.get("nvswitch_gbs", 0.0)) * 1e9,
        filesystem=_filesystem(data, path))
    if nodes > 1 and (spec.nic_bandwidth <= 0 or spec.gpu_nic_bandwidth <= 0 or nics < 1):
        raise InputError(f"system file {path} [node]: a multi-node system needs NICs with positive bandwidth")
    if not 1 <= spec.default_gpus <= spec.total_gpus:
        raise InputError(f"system file {w}: gpus {spec.default_gpus} must be between 1 and {spec.total_gpus}")
    return spec


def _filesystem(data: dict, path) -> FileSystemSpec | None:
    """The optional [filesystem] table (checked by the schema): at least one bandwidth."""
    t = data.get("filesystem")
    if t is None:
        return None
    from topologies.schema import FILESYSTEM_RATES
    if not any(k in t for k in FILESYSTEM_RATES):
        raise InputError(f"system file {path} [filesystem]: give at least one of {', '.join(FILESYSTEM_RATES)} (bytes/s)")
    return FileSystemSpec(t.get("name", "file system"), t["source"], **{k: float(t.get(k, 0.0)) for k in FILESYSTEM_RATES})


def _dragonfly(t: dict, w: str, nodes: int, nics: int) -> DragonflySpec:
    ints = ("groups", "switches_per_group", "endpoints_per_switch", "nodes_per_group", "global_links_per_pair")
    floats = ("link_bandwidth", "switch_latency", "nic_latency", "local_cable_latency", "global_cable_latency")
    if not isinstance(t, dict):
        raise InputError(f"system file {w}: [network] must be a table")
    df = DragonflySpec(**{k: _get(t, k, w, int) for k in ints}, **{k: _get(t, k, w) for k in floats})
    if min(getattr(df, k) for k in ints[:4]) < 1 or df.link_bandwidth <= 0:
        raise InputError(f"system file {w}: groups, switches, endpoints, nodes per group and link_bandwidth must be positive")
    if df.groups * df.nodes_per_group < nodes:
        raise InputError(f"system file {w}: {df.groups} groups x {df.nodes_per_group} nodes hold fewer than the "
                        f"{nodes} nodes of the machine")
    if df.nodes_per_group * nics > df.switches_per_group * df.endpoints_per_switch:
        raise InputError(f"system file {w}: {df.nodes_per_group} nodes x {nics} NICs do not fit on "
                        f"{df.switches_per_group} switches x {df.endpoints_per_switch} endpoint ports")
    if df.groups > 1 and not 1 <= df.global_links_per_pair <= df.switches_per_group:
        raise InputError(f"system file {w}: global_links_per_pair must be between 1 and switches_per_group "
                        f"({df.switches_per_group}) with {df.groups} groups")
    ports = -(-(df.groups - 1) * df.global_links_per_pair // df.switches_per_group)
    used = df.endpoints_per_switch + df.switches_per_group - 1 + ports
    if used > SWITCH_PORTS:
        raise InputError(f"system file {w}: a switch would need {used} ports ({df.endpoints_per_switch} endpoints, "
                        f"{df.switches_per_group - 1} local, {ports} global) but a Rosetta switch has {SWITCH_PORTS}")
    return df
