"""Kernel profiles: what one GPU's kernels reach, loaded from calibration/profiles/<name>.toml.

Every number in a profile file is written `{ value = ..., source = "..." }`, so each one says where
it comes from (a document, a measurement, or "assumed: <why>"). `load_profile` turns a file into a
`Profile` dataclass; `profile_for_gpu` picks the profile of a GPU by name (the `gpus` list of each file).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from topologies.datafile import read_spec, shipped
from twin.common import TwinError
from twin.schema import PROFILE, check

# The data files live with the calibration (they are what calibration measures and fits); the loader
# lives in twin so that twin never imports calibration (imports run topologies <- twin <- calibration).
PROFILES_DIR = Path(__file__).resolve().parent.parent / "calibration" / "profiles"
LAYOUTS = ("NN", "NT", "TN")


@dataclass(frozen=True)
class GemmPoint:
    """One measured GEMM: C[m,n] = A[m,k] B[k,n] in `layout`, reaching `flops` flop/s."""

    m: int
    n: int
    k: int
    layout: str
    flops: float


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
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    @property
    def gemm_efficiency(self) -> float:
        """Ceiling of GEMM efficiency: reached large-GEMM flop/s over the advertised peak."""
        return self.gemm_flops / self.peak_flops


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
    """Load a profile by name (calibration/profiles/<name>.toml) or from a TOML file path."""
    path, data = read_spec(name_or_path, PROFILES_DIR, "kernel profile")
    check(data, PROFILE, path, "kernel profile")  # types, ranges and known keys
    sources: dict[str, str] = {}
    missing = [k for k in _SCALARS + ("layout_penalty", "layout_penalty_small") if k not in data]
    if missing:
        raise TwinError(f"profile {path}: missing keys {', '.join(missing)}")
    kw = {k: _value(path, k, data[k], sources) for k in _SCALARS}
    for k in _INTS:
        kw[k] = int(kw[k])
    for k in ("layout_penalty", "layout_penalty_small"):
        kw[k] = _penalties(path, k, data[k], sources)
    table = []
    for i, row in enumerate(data.get("gemm_table", [])):
        flops = _value(path, f"gemm_table[{i}].flops", row.get("flops"), sources)
        if row.get("layout") not in LAYOUTS:
            raise TwinError(f"profile {path}: gemm_table[{i}].layout must be one of {', '.join(LAYOUTS)}")
        table.append(GemmPoint(int(row["m"]), int(row["n"]), int(row["k"]), row["layout"], float(flops)))
    return Profile(name=data.get("name", path.stem), gpus=tuple(g.lower() for g in data.get("gpus", [])),
                   gemm_table=tuple(table), sources=sources, **kw)


def list_profiles() -> list[str]:
    """Names of the profiles that ship."""
    return shipped(PROFILES_DIR)


def profile_for_gpu(gpu_name: str) -> Profile:
    """The profile whose `gpus` list names this GPU (case-insensitive; also matched as a substring)."""
    key = gpu_name.lower().strip()
    profiles = [load_profile(n) for n in list_profiles()]
    for p in profiles:
        if key == p.name or key in p.gpus:
            return p
    # longest alias contained in the name wins ("AMD Instinct MI250X GCD" -> mi250x)
    best = max(((len(a), p) for p in profiles for a in p.gpus if a in key), default=None, key=lambda t: t[0])
    if best is None:
        raise TwinError(f"no kernel profile for GPU {gpu_name!r}: add a `profile` key to the system file "
                        f"or a profile under calibration/profiles/ (have: {', '.join(list_profiles())})")
    return best[1]
