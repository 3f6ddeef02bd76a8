"""The sweep file: every list is an axis, the points are their product.

    systems = ["frontier", "alps"]            # names (frontier:axonn-table) or system .toml files
    models = ["gpt-5b", "gpt-20b"]
    gpus = [512, 2048]
    batches = [1024]                          # optional: global batch, sequences (default: the model's)
    seq_lens = [2048]                         # optional: tokens per sequence (default: the model's)
    grids = ["auto"]                          # optional: XxYxZxD or auto (the default)
    simulate_top = 2                          # optional: grid auto's simulated top (twin simulate's)

    [overrides]                               # optional: a system-file key by its dotted path, or
    "node.nic_bandwidth" = [25e9, 50e9]       # profile.KEY of the kernel profile, in the file's units

    [switches]                                # optional, each a list: oar, ors, oag, recompute,
    micro_batches = [1, 2]                    # cache_layers, micro_batches, placement

    [train]                                   # optional: time to train and GPU-hours per point
    tokens = 1e12
    checkpoint_every_min = 120                # with restart_min, and a system file's [failures]:
    checkpoint_write_min = 1                  # goodput and wall time under node failures (default:
                                              # the system's file system, twin simulate's time)
    restart_min = 10

`load_sweep(path)` checks the file against SWEEP (topologies.schema's rules: one line naming the key
and the rule) and returns a Sweep; `Sweep.points()` lists the points in order, each with a key that
names it in the results file (a digest of its axis values and of the settings its row depends on).
"""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from topologies.common import InputError
from topologies.datafile import parse_spec
from topologies.schema import COUNT, Flag, Int, ListOf, Number, Table, Text, check
from twin.sweep.overrides import check_path

AXES = ("systems", "models", "gpus", "batches", "seq_lens", "grids")
COLUMN = {"systems": "system", "models": "model", "gpus": "gpus", "batches": "batch", "seq_lens": "seq_len",
          "grids": "grid_asked"}  # axis -> its column in the results
SWITCHES = {"oar": Flag(), "ors": Flag(), "oag": Flag(), "recompute": Flag(), "cache_layers": Int(0, 100_000),
            "micro_batches": Int(1, 1 << 20), "placement": Text(("contiguous", "scattered"))}
MINUTES = Number(0, 1e7)
MAX_POINTS = 1_000_000

SWEEP = Table(
    required={"systems": ListOf(Text(nonempty=True), 1, 1000), "models": ListOf(Text(nonempty=True), 1, 1000),
              "gpus": ListOf(COUNT, 1, 1000)},
    optional={"batches": ListOf(Int(1, 1 << 30), 1, 1000), "seq_lens": ListOf(Int(1, 1 << 24), 1, 1000),
              "grids": ListOf(Text(nonempty=True), 1, 1000), "simulate_top": Int(1, 1000),
              "name": Text(), "description": Text(),
              "overrides": Table(extra=True),  # each key a dotted path, each value a list (checked below)
              "switches": Table(optional={k: ListOf(rule, 1, 100) for k, rule in SWITCHES.items()}),
              "train": Table(required={"tokens": Number(1, 1e18)},
                             optional={"checkpoint_every_min": Number(0, 1e7, lo_open=True),
                                       "checkpoint_write_min": MINUTES, "restart_min": MINUTES})})
OVERRIDE_VALUES = ListOf(Number(), 1, 1000)


@dataclass(frozen=True)
class Train:
    """Time to train: `tokens` to train on; checkpoints every `checkpoint_every_min` minutes of work,
    each written in `checkpoint_write_min` (None: the time twin simulate reports for the point, from
    the system file's [filesystem], or 0 without one), and `restart_min` to restart after a failure
    (minutes)."""

    tokens: float
    checkpoint_every_min: float | None = None
    checkpoint_write_min: float | None = None
    restart_min: float | None = None

    @property
    def failures(self) -> bool:
        """Whether the sweep says enough for the failure model (the system file gives the rate)."""
        return self.checkpoint_every_min is not None and self.restart_min is not None


@dataclass(frozen=True)
class Point:
    """One point: a value of every axis. `overrides` and `switches` are (name, value) pairs in the
    file's order; `key` names the point in the results file."""

    system: str
    model: str
    gpus: int
    batch: int | None
    seq_len: int | None
    grid: str
    overrides: tuple[tuple[str, float], ...]
    switches: tuple[tuple[str, object], ...]
    simulate_top: int
    train: Train | None
    key: str = ""

    def columns(self) -> dict:
        """The point's axis values as results columns (blank where the sweep leaves the default)."""
        out = {"system": self.system, **{k: v for k, v in self.overrides}, "model": self.model, "gpus": self.gpus,
               "batch": "" if self.batch is None else self.batch,
               "seq_len": "" if self.seq_len is None else self.seq_len}
        out.update(self.switches)
        out["grid_asked"] = self.grid
        return out


@dataclass
class Sweep:
    """A checked sweep file: its axes (each a list), the overrides and switches (name -> list), the
    grid auto setting and the time-to-train settings."""

    path: str
    axes: dict[str, list]
    overrides: dict[str, list] = field(default_factory=dict)
    switches: dict[str, list] = field(default_factory=dict)
    simulate_top: int = 2
    train: Train | None = None
    name: str = ""

    def axis_columns(self) -> list[str]:
        """The results columns that hold the points' axis values, in order."""
        return ["system", *self.overrides, "model", "gpus", "batch", "seq_len", *self.switches, "grid_asked"]

    def varied(self) -> list[str]:
        """The axis columns with more than one value (what the page's heat maps choose from)."""
        sizes = {COLUMN[a]: len(v) for a, v in self.axes.items()}
        sizes.update({k: len(v) for k, v in {**self.overrides, **self.switches}.items()})
        return [c for c in self.axis_columns() if sizes.get(c, 1) > 1]

    def size(self) -> int:
        n = 1
        for values in [*self.axes.values(), *self.overrides.values(), *self.switches.values()]:
            n *= len(values)
        return n

    def points(self) -> list[Point]:
        """Every point, in the order of the product (systems outermost, grids innermost)."""
        a = self.axes
        names_o, names_s = list(self.overrides), list(self.switches)
        out = []
        for system, ovals, model, gpus, batch, seq, svals, grid in itertools.product(
                a["systems"], itertools.product(*self.overrides.values()), a["models"], a["gpus"],
                a["batches"], a["seq_lens"], itertools.product(*self.switches.values()), a["grids"]):
            p = Point(system, model, gpus, batch, seq, grid, tuple(zip(names_o, ovals)), tuple(zip(names_s, svals)),
                      self.simulate_top, self.train)
            out.append(_keyed(p))
        return out


def _keyed(p: Point) -> Point:
    """The point with its key: a digest of its values and of the settings its row depends on."""
    text = json.dumps([p.system, p.model, p.gpus, p.batch, p.seq_len, p.grid, p.overrides, p.switches,
                       p.simulate_top, None if p.train is None else vars(p.train)], default=str)
    return replace(p, key=hashlib.sha1(text.encode()).hexdigest()[:16])


def load_sweep(path: str | Path) -> Sweep:
    """Read and check a sweep file; InputError (one line) when it is missing, malformed or breaks a rule."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"sweep file {path} does not exist (give a .toml file; docs/sweeps.md shows one)")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"sweep file {path}: cannot read it ({e})") from None
    data = parse_spec(path, text, "sweep")
    check(data, SWEEP, path, "sweep")
    overrides = data.get("overrides", {})
    for key, values in overrides.items():
        check({"overrides": {key: values}}, Table(optional={"overrides": Table(optional={key: OVERRIDE_VALUES})}),
              path, "sweep")
        check_path(key, values, f"sweep file {path}: overrides")
    axes = {"systems": data["systems"], "models": data["models"], "gpus": data["gpus"],
            "batches": data.get("batches", [None]), "seq_lens": data.get("seq_lens", [None]),
            "grids": data.get("grids", ["auto"])}
    lists = {**axes, **{f"overrides.{k}": v for k, v in overrides.items()},
             **{f"switches.{k}": v for k, v in data.get("switches", {}).items()}}
    for name, values in lists.items():
        if len(set(map(str, values))) != len(values):
            raise InputError(f"sweep file {path}: {name} lists a value twice")
    t = data.get("train")
    train = None
    if t is not None:
        train = Train(float(t["tokens"]), t.get("checkpoint_every_min"), t.get("checkpoint_write_min"),
                      t.get("restart_min"))
        if (train.checkpoint_every_min is None) != (train.restart_min is None):
            raise InputError(f"sweep file {path}: train.checkpoint_every_min and train.restart_min go together "
                             "(both, for goodput under failures, or neither)")
    sweep = Sweep(str(path), axes, dict(overrides), dict(data.get("switches", {})), data.get("simulate_top", 2), train,
                  data.get("name", path.stem))
    if sweep.size() > MAX_POINTS:
        raise InputError(f"sweep file {path}: {sweep.size():,} points is more than {MAX_POINTS:,}; split the sweep")
    return sweep
