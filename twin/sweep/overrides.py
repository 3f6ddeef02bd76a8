"""A system or kernel-profile parameter set by its dotted path, as the sweep file's [overrides] name them.

A path is the key's place in its file, in the file's units: `node.nic_bandwidth` (bytes/s),
`network.link_bandwidth`, `collectives.inter_node_channel_efficiency`, `gpu.hbm_gib` (GiB),
`failures.node_mtbf_h` (hours), or `profile.KEY` for a scalar of the system's kernel profile
(`profile.gemm_flops`). A value is checked by the rule its file's schema gives the key
(topologies.schema), so an override can say nothing a system or profile file could not. The override
applies to the system's collective figures in use (a name such as `frontier:axonn-table` picks them).
"""

from __future__ import annotations

import dataclasses as dc

from topologies.common import InputError
from topologies.schema import PROFILE, SYSTEM, Invalid
from topologies.system import GIB, SystemSpec

# section of a system file -> (the keys a sweep may set, where the value goes)
SYSTEM_KEYS = {
    "gpu": ("gemm_flops", "hbm_gib", "hbm_bandwidth"),  # not peak_flops: the profile's must agree with it
    "node": ("nic_bandwidth", "gpu_nic_bandwidth", "link_latency"),
    "network": ("global_links_per_pair", "link_bandwidth", "switch_latency", "nic_latency", "local_cable_latency",
                "global_cable_latency"),
    "collectives": ("intra_node_efficiency", "inter_node_channel_efficiency", "step_latency",
                    "inter_node_step_floor", "step_floor_per_rank", "node_ring_directions"),
    "failures": ("node_mtbf_h",),
}
PROFILE_KEYS = ("gemm_flops", "k_half", "hbm_bandwidth", "launch_s", "attention_fwd_efficiency",
                "attention_bwd_efficiency", "overlap_slowdown")


def _rule(path: str):
    """The schema rule of a settable path, or None."""
    section, _, key = path.partition(".")
    if section == "profile":
        return PROFILE.required[key].rule if key in PROFILE_KEYS else None
    if key not in SYSTEM_KEYS.get(section, ()):
        return None
    table = SYSTEM.required.get(section) or SYSTEM.optional[section]
    return table.required.get(key) or table.optional.get(key)


def check_path(path: str, values: list, where: str) -> None:
    """InputError unless `path` names a settable parameter and every value follows its file's rule."""
    rule = _rule(path)
    if rule is None:
        known = [f"{s}.{k}" for s, keys in SYSTEM_KEYS.items() for k in keys] + [f"profile.{k}" for k in PROFILE_KEYS]
        raise InputError(f"{where}: {path!r} is not a parameter a sweep can set (one of: {', '.join(known)})")
    for v in values:
        try:
            rule.check(v, path)
        except Invalid as e:
            raise InputError(f"{where}: {path} {e.rule}, got {v!r}") from None


def apply_system(spec: SystemSpec, overrides) -> SystemSpec:
    """`spec` with each (path, value) of `overrides` that names a system parameter set."""
    for path, v in overrides:
        section, _, key = path.partition(".")
        if section == "gpu":
            field, value = ("hbm_bytes", int(v * GIB)) if key == "hbm_gib" else (key, float(v))
            spec = dc.replace(spec, gpu=dc.replace(spec.gpu, **{field: value}))
        elif section == "node":
            spec = dc.replace(spec, **{key: float(v)})
        elif section == "network":
            if spec.dragonfly is None:
                raise InputError(f"{path}: system {spec.name} has no dragonfly [network] "
                                 f"({'a [fattree]' if spec.fattree else 'one node'})")
            value = int(v) if key == "global_links_per_pair" else float(v)
            spec = dc.replace(spec, dragonfly=dc.replace(spec.dragonfly, **{key: value}))
        elif section == "collectives":
            value = int(v) if key == "node_ring_directions" else float(v)
            spec = dc.replace(spec, collectives=dc.replace(spec.collectives, **{key: value}))
        elif section == "failures":
            spec = dc.replace(spec, node_mtbf_h=float(v))
    return spec


def apply_profile(profile, overrides):
    """The kernel profile with each (profile.KEY, value) of `overrides` set."""
    for path, v in overrides:
        section, _, key = path.partition(".")
        if section == "profile":
            profile = dc.replace(profile, **{key: int(v) if key == "k_half" else float(v)})
    return profile
