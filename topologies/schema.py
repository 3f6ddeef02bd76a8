"""The typed schema of every spec file (systems, models, kernel profiles, measurements), in one place.

A spec file is parsed (TOML or JSON) into plain dicts and lists; `check(data, SCHEMA, path, what)`
walks it against a schema built from a few rules and raises InputError with one line that names the
file, the key and the rule, e.g.

    system file my.toml: gpu.hbm_gib must be a finite number in (0, 1e+06], got nan

Measurement files (JSON of `backend bench`, calibration/measurements.py) and the files of a run that
`twin validate` reads (log.jsonl records, summary.json; calibration/validate.py) are checked here too.

Rules: Number (finite, optionally an integer, in a range; booleans are not numbers), Text (optionally
one of a few choices), Flag (a boolean), ListOf (a list whose items all follow one rule, of a bounded
length), Table (a dict with known keys, each required or optional; unknown keys are refused, since a
misspelt key would otherwise be silently ignored) and Sourced (the `{ value = ..., source = "..." }`
of profile files). Loaders check a file first and then build their dataclasses from data that is
known to be well-typed, so they only check what relates keys to each other (a matrix of the right
shape, a NIC index below the NIC count). The ranges are wide sanity bounds, not physics: they keep a
typo (1e300, a negative latency, 10^12 layers) from reaching a loop that would spin or overflow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from topologies.common import InputError


class Invalid(Exception):
    """A value breaks a rule: `key` is its dotted path, `rule` says what was expected."""

    def __init__(self, key: str, rule: str, value: Any = ..., shown: bool = True):
        super().__init__(key, rule)
        self.key, self.rule, self.value, self.shown = key, rule, value, shown


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e6 else f"{x:g}"


@dataclass(frozen=True)
class Number:
    """A finite number (an integer when `integer`) with lo <= value <= hi (lo < value when lo_open)."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    integer: bool = False

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a finite number"
        if self.lo is not None and self.hi is not None:
            return f"{kind} in {'(' if self.lo_open else '['}{_num(self.lo)}, {_num(self.hi)}]"
        if self.lo is not None:
            return f"{kind} {'>' if self.lo_open else '>='} {_num(self.lo)}"
        if self.hi is not None:
            return f"{kind} <= {_num(self.hi)}"
        return kind

    def check(self, value: Any, key: str) -> Any:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ok and self.integer:
            ok = isinstance(value, int)
        if ok and isinstance(value, float):
            ok = math.isfinite(value)
        if ok and self.lo is not None:
            ok = value > self.lo if self.lo_open else value >= self.lo
        if ok and self.hi is not None:
            ok = value <= self.hi
        if not ok:
            raise Invalid(key, f"must be {self.describe()}", value)
        return value


def Int(lo: int | None = None, hi: int | None = None) -> Number:
    return Number(lo, hi, integer=True)


def Positive(hi: float) -> Number:
    return Number(0, hi, lo_open=True)


@dataclass(frozen=True)
class ZeroOr:
    """0 (meaning "none"), or a number that follows `rule`."""

    rule: Number

    def check(self, value: Any, key: str) -> Any:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0:
            return value
        try:
            return self.rule.check(value, key)
        except Invalid:
            raise Invalid(key, f"must be {self.rule.describe()}, or 0", value) from None


@dataclass(frozen=True)
class Text:
    """A string; with `choices`, one of them; with `nonempty`, not blank."""

    choices: tuple[str, ...] = ()
    nonempty: bool = False

    def check(self, value: Any, key: str) -> Any:
        if not isinstance(value, str):
            raise Invalid(key, "must be a string", value)
        if self.choices and value not in self.choices:
            raise Invalid(key, f"must be one of {', '.join(self.choices)}", value)
        if self.nonempty and not value.strip():
            raise Invalid(key, "must not be empty", value)
        return value


@dataclass(frozen=True)
class Flag:
    """true or false."""

    def check(self, value: Any, key: str) -> Any:
        if not isinstance(value, bool):
            raise Invalid(key, "must be true or false", value)
        return value


@dataclass(frozen=True)
class ListOf:
    """A list of items that all follow `item`, with min_len <= length <= max_len."""

    item: Any
    min_len: int = 0
    max_len: int = 1_000_000

    def check(self, value: Any, key: str) -> Any:
        if not isinstance(value, list):
            raise Invalid(key, "must be a list", value)
        if not self.min_len <= len(value) <= self.max_len:
            raise Invalid(key, f"must have {self.min_len} to {self.max_len} items, has {len(value)}", shown=False)
        for i, v in enumerate(value):
            self.item.check(v, f"{key}[{i}]")
        return value


@dataclass(frozen=True)
class Table:
    """A table (dict) of known keys: `required` maps a key to its rule, `optional` likewise. With
    `extra`, keys it does not know are let through unread (files a program writes carry figures that
    nothing reads back, such as a benchmark's derived flop/s)."""

    required: dict = field(default_factory=dict)
    optional: dict = field(default_factory=dict)
    extra: bool = False

    def check(self, value: Any, key: str) -> Any:
        where = key or "the top level"
        if not isinstance(value, dict):
            raise Invalid(key, "must be a table", value)
        known = {**self.required, **self.optional}
        unknown = sorted(set(value) - set(known))
        if unknown and not self.extra:
            raise Invalid(_join(key, unknown[0]), f"is not a known key of {where} (known: {', '.join(sorted(known))})",
                          shown=False)
        for k, rule in known.items():
            if k in value:
                rule.check(value[k], _join(key, k))
            elif k in self.required:
                raise Invalid(_join(key, k), "is missing", shown=False)
        return value


@dataclass(frozen=True)
class Sourced:
    """`{ value = <rule>, source = "where it comes from" }`, the form of every number in a profile."""

    rule: Any

    def check(self, value: Any, key: str) -> Any:
        if not isinstance(value, dict) or "value" not in value or set(value) - {"value", "source"}:
            raise Invalid(key, 'must be { value = ..., source = "..." }', value)
        if not isinstance(value.get("source"), str) or not value["source"].strip():
            raise Invalid(f"{key}.source", "must say where the value comes from (a non-empty string)",
                          value.get("source"))
        self.rule.check(value["value"], f"{key}.value")
        return value


@dataclass(frozen=True)
class Penalties:
    """`{ NN = f, NT = f, TN = f, source = "..." }`: a time factor >= 1 per GEMM layout."""

    def check(self, value: Any, key: str) -> Any:
        Table(required={"NN": FACTOR, "NT": FACTOR, "TN": FACTOR, "source": Text(nonempty=True)}).check(value, key)
        return value


@dataclass(frozen=True)
class Nullable:
    """null, or a value that follows `rule`."""

    rule: Any

    def check(self, value: Any, key: str) -> Any:
        return value if value is None else self.rule.check(value, key)


def _join(key: str, sub: str) -> str:
    return f"{key}.{sub}" if key else sub


def check(data: Any, schema: Any, path: str | Path, what: str) -> Any:
    """Check parsed `data` against `schema`; raise InputError naming `what` file `path`, the key and the rule."""
    try:
        return schema.check(data, "")
    except Invalid as e:
        got = f", got {_show(e.value)}" if e.shown and e.value is not ... else ""
        raise InputError(f"{what} file {path}: {e.key or 'the file'} {e.rule}{got}") from None


# ---- the spec files -------------------------------------------------------------------------------

# Lower bounds keep a quotient finite: 1e-311 flop/s is positive, yet any time divided by it is infinite.
RATE = Number(1, 1e18)        # flop/s or bytes/s: at least one per second, below an exa-unit per device
RATE0 = ZeroOr(RATE)          # the same where 0 means "none" (no NICs, unknown)
SCALE = Number(1e-6, 1e6)     # a dimensionless factor or efficiency (a divisor somewhere)
LATENCY = Number(0, 1.0)      # seconds per hop or step
FRACTION = Number(1e-6, 1.0)  # an efficiency: (0, 1], and not vanishingly small
FACTOR = Number(1, 1e6)       # a slowdown factor >= 1
COUNT = Int(1, 10_000_000)
COLLECTIVE_KINDS = ("all_gather", "reduce_scatter", "all_reduce")
# a node_share's span_spread keys (twin.host.spread): compute ops, every collective, a collective kind over an axis
# the axes a profile's measured collectives name: the grid's four and a mixture of experts' expert and
# expert-data groups (twin.program.moe.EXPERT_AXES)
PROFILE_AXES = ("x", "y", "z", "data", "expert", "edata")
PROFILE_COLLECTIVES = COLLECTIVE_KINDS + ("all_to_all",)  # the kinds a profile measures (MoE: all_to_all)
SPREAD_KEYS = ("compute", "collective") + tuple(f"{k}_{a}" for k in PROFILE_COLLECTIVES for a in PROFILE_AXES)

# the keys of a system's [collectives] that a named variant ([[collectives.variants]]) may set too
COLLECTIVE_TUNING = {"ring_only": ListOf(Text(COLLECTIVE_KINDS), max_len=3), "intra_node_efficiency": FRACTION,
                     "inter_node_channel_efficiency": FRACTION, "step_latency": LATENCY,
                     "inter_node_step_floor": LATENCY, "step_floor_per_rank": Number(0, 1e-3),
                     "node_ring_directions": Int(1, 2)}

FILESYSTEM_RATES = ("write_bandwidth", "read_bandwidth", "write_bandwidth_per_node", "read_bandwidth_per_node")

SYSTEM = Table(
    required={
        "gpu": Table(required={"name": Text(nonempty=True), "peak_flops": RATE, "hbm_gib": Positive(1e6),
                               "hbm_bandwidth": RATE},
                     optional={"gemm_flops": RATE0}),
        "node": Table(required={"nodes": COUNT, "gpus_per_node": Int(1, 4096), "nics_per_node": Int(0, 4096),
                                "nic_bandwidth": RATE0, "gpu_nic_bandwidth": RATE0, "link_latency": LATENCY,
                                "links_gbs": ListOf(ListOf(Number(0, 1e9), max_len=4096), min_len=1, max_len=4096)},
                      optional={"gpu_nic": ListOf(Int(0, 4095), max_len=4096),
                                # GB/s per direction of each GPU's port into the node's switch (NVSwitch)
                                "nvswitch_gbs": Number(1e-3, 1e6)}),
        "collectives": Table(required={"library": Text(nonempty=True), "intra_node_efficiency": FRACTION,
                                       "inter_node_channel_efficiency": FRACTION, "step_latency": LATENCY},
                             optional={**COLLECTIVE_TUNING, "name": Text(nonempty=True),
                                       "variants": ListOf(Table(required={"name": Text(nonempty=True),
                                                                          "source": Text(nonempty=True)},
                                                                optional=COLLECTIVE_TUNING), max_len=16)}),
        "default": Table(required={"model": Text(nonempty=True), "gpus": COUNT}, optional={"batch": COUNT}),
    },
    optional={
        "name": Text(nonempty=True), "description": Text(), "sources": ListOf(Text()), "profile": Text(nonempty=True),
        "network": Table(required={"groups": Int(1, 100_000), "switches_per_group": Int(1, 4096),
                                   "endpoints_per_switch": Int(1, 4096), "nodes_per_group": COUNT,
                                   "global_links_per_pair": Int(0, 4096), "link_bandwidth": RATE,
                                   "switch_latency": LATENCY, "nic_latency": LATENCY,
                                   "local_cable_latency": LATENCY, "global_cable_latency": LATENCY}),
        # a fat tree instead of the dragonfly (topologies.fattree): levels leaf first, each with its radix,
        # down : up ports (all but the top) and the rate of the links that come up into it
        "fattree": Table(required={"levels": ListOf(Table(required={"name": Text(nonempty=True), "radix": Int(2, 4096),
                                                                    "link_bandwidth": RATE, "switch_latency": LATENCY},
                                                          optional={"oversubscription": Number(1, 64)}),
                                                    min_len=1, max_len=4),
                                   "nic_latency": LATENCY, "cable_latency": LATENCY},
                         optional={"rail_optimized": Flag(), "ecmp": Text(("destination", "hash", "spread"))}),
        # node failures (twin sweep's goodput): a node's mean time between failures that stop a job, hours
        "failures": Table(required={"node_mtbf_h": Number(1e-3, 1e9), "source": Text(nonempty=True)}),
        # the parallel file system checkpoints go to (twin simulate's checkpoint time), bytes/s: the
        # whole file system's and/or one node's share, each direction (at least one figure)
        "filesystem": Table(required={"source": Text(nonempty=True)},
                            optional={"name": Text(nonempty=True),
                                      **{k: Number(1.0, 1e16) for k in FILESYSTEM_RATES}}),
    })

MODEL = Table(
    required={"layers": Int(1, 100_000), "hidden": Int(1, 1 << 20), "heads": Int(1, 1 << 16),
              "vocab": Int(1, 1 << 26), "seq_len": Int(1, 1 << 24), "global_batch": Int(1, 1 << 30)},
    optional={"name": Text(nonempty=True), "ffn_mult": Int(1, 64), "tied_embeddings": Flag(),
              "min_tensor_parallel": Int(1, 1 << 30), "arch": Text(("gpt", "llama")),
              "kv_heads": Int(1, 1 << 16), "ffn_size": Int(1, 1 << 24),
              "rope_theta": Number(1.0, 1e12), "norm_eps": Number(0.0, 1.0, lo_open=True),
              "rope_scaling": Number(1.0, 1e6), "rope_low_freq_factor": Number(0.0, 1e6, lo_open=True),
              "rope_high_freq_factor": Number(0.0, 1e6, lo_open=True),
              "rope_original_context": Int(1, 1 << 24),
              # mixture of experts (twin/program/moe_spec.py): a file that gives capacity_factor gives one > 0
              "experts": Int(1, 1 << 16), "top_k": Int(1, 1 << 16), "moe_every": Int(1, 100_000),
              "capacity_factor": Number(0.0, 1e3, lo_open=True), "router_aux_coef": Number(0.0, 1e3)})

GEMM_ROW = Table(required={"m": Int(1, 1 << 30), "n": Int(1, 1 << 30), "k": Int(1, 1 << 30),
                           "layout": Text(("NN", "NT", "TN")), "flops": Sourced(RATE)},
                 optional={"ranks": Int(0, 1 << 20), "training": Flag()})
NODE_SHARE_ROW = Table(required={"ranks": Int(1, 1 << 20), "launch_s": Sourced(Positive(1.0)),
                                 "hbm_bandwidth": Sourced(RATE), "overlap_slowdown": Sourced(SCALE)},
                       optional={"compute_scale": Sourced(SCALE),
                                 "attention_fwd_efficiency": Sourced(SCALE),
                                 "attention_bwd_efficiency": Sourced(SCALE),
                                 "host_op_s": Sourced(Positive(1.0)),
                                 "compute_contention": Sourced(SCALE),
                                 "collective_slowdown": Sourced(SCALE), "comm_share": Sourced(FRACTION),
                                 "stretch": Sourced(SCALE), "host_issue_s": Sourced(Number(0.0, 1.0)),
                                 "host_exchange_s": Sourced(Number(0.0, 1.0)),
                                 "axis_slowdown": Table(required={"source": Text(nonempty=True)},
                                                        optional={a: SCALE for a in PROFILE_AXES}),
                                 "span_spread": Table(required={"source": Text(nonempty=True)},
                                                      optional={k: Number(0.0, 100.0) for k in SPREAD_KEYS})})
OP_COST_ROW = Table(required={"kind": Text(nonempty=True), "ranks": Int(1, 1 << 20),
                              "latency_s": Sourced(Positive(1.0)), "bandwidth": Sourced(RATE)},
                    optional={"role": Text()})
COLLECTIVE_ROW = Table(required={"kind": Text(PROFILE_COLLECTIVES), "group_size": Int(2, 1 << 24),
                                 "ranks": Int(1, 1 << 20), "latency_s": Sourced(Positive(1.0)),
                                 "bandwidth": Sourced(RATE)},
                       optional={"stride": Int(0, 1 << 24), "axis": Text(PROFILE_AXES)})

PROFILE = Table(
    required={
        "peak_flops": Sourced(RATE), "gemm_flops": Sourced(RATE), "compute_units": Sourced(Int(1, 1 << 20)),
        "tile_m": Sourced(Int(1, 1 << 16)), "tile_n": Sourced(Int(1, 1 << 16)), "k_half": Sourced(Int(1, 1 << 30)),
        "hbm_bandwidth": Sourced(RATE), "launch_s": Sourced(Positive(1.0)),
        "attention_fwd_efficiency": Sourced(FRACTION), "attention_bwd_efficiency": Sourced(FRACTION),
        "overlap_slowdown": Sourced(SCALE), "layout_large_flops": Sourced(Positive(1e30)),
        "layout_penalty": Penalties(), "layout_penalty_small": Penalties(),
    },
    optional={"name": Text(nonempty=True), "gpus": ListOf(Text(nonempty=True)), "description": Text(),
              "gemm_table": ListOf(GEMM_ROW), "node_share": ListOf(NODE_SHARE_ROW),
              "collective_table": ListOf(COLLECTIVE_ROW), "activation_bytes": Int(1, 8),
              "op_cost": ListOf(OP_COST_ROW), "collective_training": ListOf(COLLECTIVE_ROW),
              "host_op_s": Sourced(Positive(1.0)), "host_ordered": Sourced(Flag()),
              "node_cores": Sourced(Int(1, 1 << 20)), "collective_core_load": Sourced(Number(0.0, 100.0)),
              "fitted_from": Table(  # what a fitted profile's measurements covered (calibration.fit.fitted_from)
                  required={"ranks": ListOf(Int(1, 1 << 16)), "benched": ListOf(Table(
                      required={"grid": Text(nonempty=True), "ranks": Int(1, 1 << 16)},
                      optional={"training_steps": Flag()}))},
                  optional={"source": Text(), "files": Int(1, 1 << 30), "machines": ListOf(Text()),
                            "hosts": ListOf(Text()), "device": Text(), "models": ListOf(Text()),
                            "dates": ListOf(Text()), "collective_bytes": ListOf(Int(0, 1 << 50))})})

# ---- measurement files (`backend bench`, read by `twin calibrate`) and run files (read by `twin validate`)

SECONDS = Number(1e-12, 1e6)  # a measured time: a picosecond to 11 days
BYTES = Int(0, 1 << 50)
DIM = Int(1, 1 << 30)         # a GEMM dimension
AXES = ("x", "y", "z", "data")
MEASUREMENT_FORMAT = "backend-bench/2"

MEASUREMENT = Table(
    required={
        "format": Text((MEASUREMENT_FORMAT,)),
        "machine": Table(required={k: Text(nonempty=True) for k in ("host", "date", "torch", "commit", "device")},
                         optional={"cores": Nullable(Int(1, 1 << 16))}, extra=True),
        "grid": Text(nonempty=True), "ranks": Int(1, 1 << 24), "ranks_per_node": Int(1, 1 << 16),
        "dtype_bytes": Int(1, 8),
        "gemm": ListOf(Table(required={"m": DIM, "n": DIM, "k": DIM, "layout": Text(("NN", "NT", "TN")),
                                       "seconds": SECONDS}, extra=True)),
        "ops": ListOf(Table(required={"op": Text(nonempty=True), "numel": BYTES, "bytes": BYTES, "seconds": SECONDS},
                            optional={"free_mean_s": SECONDS, "step_s": SECONDS, "free_step_s": SECONDS},
                            extra=True)),
        "collectives": ListOf(Table(required={"axis": Text(AXES), "kind": Text(COLLECTIVE_KINDS),
                                              "group_size": Int(2, 1 << 24), "bytes": Int(1, 1 << 50),
                                              "seconds": SECONDS},
                                    optional={"stride": Int(0, 1 << 24)}, extra=True)),
        "overlap": ListOf(Table(required={"m": DIM, "n": DIM, "k": DIM, "axis": Text(AXES), "alone_s": SECONDS,
                                          "overlapped_s": SECONDS}, extra=True)),
    },
    optional={  # absent in files written before attention and training steps were measured
        "attention": ListOf(Table(required={"m": DIM, "n": DIM, "k": DIM, "fwd_flops": Number(1, 1e30),
                                            "bwd_flops": Number(1, 1e30), "fwd_s": SECONDS, "bwd_s": SECONDS},
                                  extra=True)),
        "steps": ListOf(Table(required={"name": Text(nonempty=True), "kind": Text(nonempty=True),
                                        "stream": Text(nonempty=True), "bytes": BYTES, "flops": Number(0, 1e30),
                                        # 0: a collective that completed with the one before it (a compute
                                        # op's must be > 0: calibration.measurements)
                                        "seconds": Number(0, 1e6), "covered": Number(0, 1)},
                              optional={"role": Text(), "axis": Text(PROFILE_AXES + ("",)), "wake_s": Number(0, 1e6),
                                        "cpu_s": Number(0, 1e6), "issue_s": Number(0, 1e6), "spread": Number(0, 1e6),
                                        "m": Int(0, 1 << 30),
                                        "n": Int(0, 1 << 30), "k": Int(0, 1 << 30),
                                        "layout": Text(("NN", "NT", "TN", ""))}, extra=True)),
    },
    extra=True)

RUN_LOG_RECORD = Table(required={"step": Int(1, 1 << 40), "step_time_s": SECONDS, "tokens_per_s": RATE},
                       extra=True)
RUN_SUMMARY = Table(optional={"memory_peak_bytes": ListOf(BYTES, min_len=1)}, extra=True)
