"""Kernel profiles: what one GPU's kernels reach, loaded from twin/profiles/<name>.toml.

Every number in a profile file is written `{ value = ..., source = "..." }`, so each one says where
it comes from (a document, a measurement, or "assumed: <why>"). `load_profile` turns a file into a
`Profile` dataclass (twin.costs.profile_types, with the points and tables it holds); `profile_for_gpu` picks
the profile of a GPU by name (the `gpus` list of each file).
"""

from __future__ import annotations

import functools
from pathlib import Path

import tomllib

from topologies import caches
from topologies.datafile import parse_spec, shipped, spec_text
from topologies.common import TwinError
from twin.costs.profile_types import LAYOUTS, CollectivePoint, GemmPoint, NodeShare, OpCost, Profile, with_host
from topologies.schema import PROFILE, PROFILE_COLLECTIVES, SPREAD_KEYS, check

# The shipped profiles are package data of the twin; `twin calibrate` writes new ones from measurements.
PROFILES_DIR = Path(__file__).resolve().parent.parent / "profiles"


_SCALARS = ("peak_flops", "gemm_flops", "compute_units", "tile_m", "tile_n", "k_half", "hbm_bandwidth",
            "launch_s", "attention_fwd_efficiency", "attention_bwd_efficiency", "overlap_slowdown",
            "layout_large_flops")
_INTS = ("compute_units", "tile_m", "tile_n", "k_half")


def _value(path: Path, key: str, entry, sources: dict[str, str]) -> float:
    if not isinstance(entry, dict) or "value" not in entry or not entry.get("source"):
        raise TwinError(f"profile {path}: {key} must be {{ value = ..., source = \"...\" }}")
    sources[key] = entry["source"]
    v = entry["value"]
    if not isinstance(v, (int, float)) or v <= 0:
        raise TwinError(f"profile {path}: {key} must be a positive number, got {v!r}")
    return v


def _penalties(path: Path, key: str, entry, sources: dict[str, str]) -> dict[str, float]:
    if not isinstance(entry, dict) or not entry.get("source"):
        raise TwinError(f"profile {path}: {key} must be {{ NN = ..., NT = ..., TN = ..., source = \"...\" }}")
    sources[key] = entry["source"]
    out = {}
    for layout in LAYOUTS:
        v = entry.get(layout)
        if not isinstance(v, (int, float)) or v < 1:
            raise TwinError(f"profile {path}: {key}.{layout} must be a factor >= 1, got {v!r}")
        out[layout] = float(v)
    return out


def load_profile(name_or_path: str) -> Profile:
    """Load a profile by name (twin/profiles/<name>.toml) or from a TOML file path. A file read
    again with the same text gives the Profile already made (frozen; a fitted CPU profile takes
    about 0.1 s to parse, and a study of many grids prepares one per grid)."""
    path, text = spec_text(name_or_path, PROFILES_DIR, "kernel profile")
    return _parsed(path, text)


@functools.lru_cache(maxsize=16)  # registered below
def _parsed(path: Path, text: str) -> Profile:
    data = parse_spec(path, text, "kernel profile")
    check(data, PROFILE, path, "kernel profile")  # types, ranges and known keys
    sources: dict[str, str] = {}
    missing = [k for k in _SCALARS + ("layout_penalty", "layout_penalty_small") if k not in data]
    if missing:
        raise TwinError(f"profile {path}: missing keys {', '.join(missing)}")
    kw = {k: _value(path, k, data[k], sources) for k in _SCALARS}
    host = {}  # the host part, where the host is the device (CPU profiles only)
    if "host_op_s" in data:
        host["op_s"] = _value(path, "host_op_s", data["host_op_s"], sources)
    if "host_ordered" in data:  # what the executor does (true for a CPU executor)
        host["ordered"] = data["host_ordered"]["value"]
        sources["host_ordered"] = data["host_ordered"]["source"]
    if "node_cores" in data and "collective_core_load" in data:
        host["node_cores"] = int(_value(path, "node_cores", data["node_cores"], sources))
        entry = data["collective_core_load"]  # the schema checked it: a number >= 0 with its source
        host["collective_core_load"] = float(entry["value"])
        sources["collective_core_load"] = entry["source"]
    kw["host"] = with_host(None, **host)
    for k in _INTS:
        kw[k] = int(kw[k])
    for k in ("layout_penalty", "layout_penalty_small"):
        kw[k] = _penalties(path, k, data[k], sources)
    table = []
    for i, row in enumerate(_rows(path, data, "gemm_table")):
        flops = _value(path, f"gemm_table[{i}].flops", row.get("flops"), sources)
        if row.get("layout") not in LAYOUTS:
            raise TwinError(f"profile {path}: gemm_table[{i}].layout must be one of {', '.join(LAYOUTS)}")
        m, n, k, ranks = (_int(path, f"gemm_table[{i}].{key}", row.get(key, 0 if key == "ranks" else None),
                               0 if key == "ranks" else 1) for key in ("m", "n", "k", "ranks"))
        table.append(GemmPoint(m, n, k, row["layout"], float(flops), ranks, bool(row.get("training", False))))
    shares = []
    for i, row in enumerate(_rows(path, data, "node_share")):
        where = f"node_share[{i}]"
        shares.append(NodeShare(_int(path, f"{where}.ranks", row.get("ranks"), 1),
                                *(_value(path, f"{where}.{key}", row.get(key), sources)
                                  for key in ("launch_s", "hbm_bandwidth", "overlap_slowdown")),
                                _value(path, f"{where}.compute_scale", row.get("compute_scale",
                                       {"value": 1.0, "source": "not measured: 1"}), sources),
                                *(_value(path, f"{where}.{key}", row[key], sources) if key in row else 0.0
                                  for key in ("attention_fwd_efficiency", "attention_bwd_efficiency",
                                              "host_op_s")),
                                *(_value(path, f"{where}.{key}", row[key], sources) if key in row else default
                                  for key, default in (("compute_contention", 1.0), ("collective_slowdown", 1.0))),
                                _keyed(path, where, "axis_slowdown", row.get("axis_slowdown"), sources, AXIS_KEYS, True),
                                _value(path, f"{where}.comm_share", row["comm_share"], sources)
                                if "comm_share" in row else 1.0,
                                _value(path, f"{where}.stretch", row["stretch"], sources)
                                if "stretch" in row else 0.0,
                                _value(path, f"{where}.host_issue_s", row["host_issue_s"], sources)
                                if "host_issue_s" in row else 0.0,
                                _keyed(path, where, "span_spread", row.get("span_spread"), sources, SPREAD_KEYS,
                                       False),
                                _value(path, f"{where}.host_exchange_s", row["host_exchange_s"], sources)
                                if "host_exchange_s" in row else 0.0))
    costs = []
    for i, row in enumerate(_rows(path, data, "op_cost")):
        where = f"op_cost[{i}]"
        if not isinstance(row.get("kind"), str) or not isinstance(row.get("role", ""), str):
            raise TwinError(f"profile {path}: {where}.kind and .role must be strings")
        costs.append(OpCost(row["kind"], row.get("role", ""), _int(path, f"{where}.ranks", row.get("ranks"), 1),
                            _value(path, f"{where}.latency_s", row.get("latency_s"), sources),
                            _value(path, f"{where}.bandwidth", row.get("bandwidth"), sources)))
    colls: dict[str, list[CollectivePoint]] = {"collective_table": [], "collective_training": []}
    for key, out in colls.items():
        for i, row in enumerate(_rows(path, data, key)):
            where = f"{key}[{i}]"
            if row.get("kind") not in PROFILE_COLLECTIVES:
                raise TwinError(f"profile {path}: {where}.kind must be one of {', '.join(PROFILE_COLLECTIVES)}")
            out.append(CollectivePoint(row["kind"], _int(path, f"{where}.group_size", row.get("group_size"), 2),
                                       _int(path, f"{where}.ranks", row.get("ranks"), 1),
                                       _value(path, f"{where}.latency_s", row.get("latency_s"), sources),
                                       _value(path, f"{where}.bandwidth", row.get("bandwidth"), sources),
                                       _int(path, f"{where}.stride", row.get("stride", 0), 0), row.get("axis", "")))
    act = data.get("activation_bytes", 2)
    if act not in (1, 2, 4, 8):
        raise TwinError(f"profile {path}: activation_bytes must be 1, 2, 4 or 8, got {act!r}")
    return Profile(name=data.get("name", path.stem), gpus=tuple(g.lower() for g in data.get("gpus", [])),
                   gemm_table=tuple(table), activation_bytes=act, node_share=tuple(shares),
                   collective_table=tuple(colls["collective_table"]),
                   collective_training=tuple(colls["collective_training"]), op_cost=tuple(costs), sources=sources,
                   fitted_from=data.get("fitted_from", {}), **kw)



caches.register("twin.costs.profile.parsed", _parsed)  # profiles parsed in this process, the last 16

AXIS_KEYS = ("x", "y", "z", "data", "expert", "edata")  # MoE collectives: twin.program.moe.EXPERT_AXES


def _keyed(path: Path, where: str, name: str, entry, sources: dict[str, str], keys: tuple[str, ...],
           positive: bool) -> dict[str, float]:
    """A node_share's table of numbers by key with its source, `name = { KEY = ..., source = "..." }`
    (absent: {}): each key one of `keys`, each number > 0 (positive) or >= 0."""
    if entry is None:
        return {}
    if not isinstance(entry, dict) or not entry.get("source"):
        raise TwinError(f"profile {path}: {where}.{name} must be {{ {keys[0]} = ..., source = \"...\" }}")
    sources[f"{where}.{name}"] = entry["source"]
    out = {}
    for key, v in entry.items():
        if key == "source":
            continue
        bad = isinstance(v, bool) or not isinstance(v, (int, float)) or (v <= 0 if positive else v < 0)
        if key not in keys or bad:
            raise TwinError(f"profile {path}: {where}.{name}.{key} must be a number {'> 0' if positive else '>= 0'} "
                            f"keyed by one of {', '.join(keys)}, got {v!r}")
        out[key] = float(v)
    return out


def _rows(path: Path, data: dict, key: str) -> list[dict]:
    rows = data.get(key, [])
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise TwinError(f"profile {path}: {key} must be a list of tables ([[{key}]])")
    return rows


def _int(path: Path, key: str, v, least: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < least:
        raise TwinError(f"profile {path}: {key} must be an integer >= {least}, got {v!r}")
    return v


def list_profiles() -> list[str]:
    """Names of the profiles that ship."""
    return shipped(PROFILES_DIR)


def profile_for_gpu(gpu_name: str) -> Profile:
    """The profile whose `gpus` list names this GPU (case-insensitive; also matched as a substring)."""
    key = gpu_name.lower().strip()
    aliases = {n: _names_of(n) for n in list_profiles()}
    for n, (name, gpus) in aliases.items():
        if key == name or key in gpus:
            return load_profile(n)
    # longest alias contained in the name wins ("AMD Instinct MI250X GCD" -> mi250x)
    best = max(((len(a), n) for n, (_, gpus) in aliases.items() for a in gpus if a in key), default=None,
               key=lambda t: t[0])
    if best is None:
        raise TwinError(f"no kernel profile for GPU {gpu_name!r}: add a `profile` key to the system file "
                        f"or a profile under twin/profiles/ (have: {', '.join(list_profiles())})")
    return load_profile(best[1])


def _names_of(file: str) -> tuple[str, tuple[str, ...]]:
    """The `name` and `gpus` of a shipped profile, read from its top-level keys only (the text before
    its first table), so that choosing a profile does not parse every fitted table (cpu.toml: ~190 kB).
    A file whose head does not parse is loaded whole, which says what is wrong with it."""
    text = (PROFILES_DIR / f"{file}.toml").read_text()
    cut = text.find("\n[")
    try:
        head = tomllib.loads(text if cut < 0 else text[:cut + 1])
        gpus = head.get("gpus", [])
        return str(head.get("name", file)), tuple(str(g).lower() for g in gpus)
    except (tomllib.TOMLDecodeError, TypeError):
        p = load_profile(file)
        return p.name, p.gpus
