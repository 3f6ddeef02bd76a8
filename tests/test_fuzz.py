"""Property-based fuzz of both command lines and of the spec files: whatever the input, a command
exits 0 or prints exactly one line and exits 2 -- never a traceback, never a hang -- and its JSON is
standard JSON (no NaN or Infinity).

In CI each test runs a few dozen cases (well under a minute together). The long run is the same tests
with more cases: `FUZZ_EXAMPLES=2500 python -m pytest tests/test_fuzz.py` (4 tests: 10,000 cases);
benchmarks/fuzz_long.sh runs it and prints the count.
"""

from __future__ import annotations

import copy
import json
import math
import os
import signal
import tomllib
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from topologies.common import InputError

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "0"))
FUZZ = settings(max_examples=EXAMPLES or 25, deadline=None, database=None, derandomize=not EXAMPLES,
                suppress_health_check=list(HealthCheck))
CASE_TIMEOUT_S = 60  # a case that runs longer counts as a hang

runner = CliRunner()


@contextmanager
def no_hang(what):
    def alarm(*_):
        raise TimeoutError(f"hang: {what}")
    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(CASE_TIMEOUT_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def strict_json(text: str):
    def refuse(name):
        raise AssertionError(f"non-standard JSON constant {name}")
    return json.loads(text, parse_constant=refuse)


def check_outcome(result, argv) -> None:
    """Exit 0, or exit 2 with exactly one line on stderr; never an exception."""
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        import traceback
        raise AssertionError(f"{argv}: {type(result.exception).__name__}: {result.exception}\n"
                             + "".join(traceback.format_exception(result.exception)))
    assert "Traceback" not in result.output, (argv, result.output)
    if result.exit_code == 0:
        return
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error:"), \
        (argv, result.exit_code, result.stderr)


# ---- values: mostly plausible, often absurd -------------------------------------------------------
NUMBERS = st.sampled_from(["0", "1", "2", "4", "8", "16", "-1", "-5", "1e308", "nan", "inf", "-inf", "abc", "",
                           " ", "1.5", "0x10", "999999999999", str(2 ** 63), "1e-300", "٣"])
GRIDS = st.one_of(st.sampled_from(["1x1x1x1", "2x2x2x1", "1x1x2x2", "1x2x1x1", "2x1x1x1", "1x1x1x8", "8x1x1x1",
                                   "1x1x1x2", "0x1x1x1", "2x2x2", "axbxcxd", "", "auto", "1x1x1x1x1",
                                   "99999x1x1x1", "-1x1x1x1"]),
                  st.text(alphabet="0123456789x-", max_size=12))
SLOWDOWNS = st.one_of(st.sampled_from(["3:2", "0:1.5", "3:nan", "3:inf", "3:1e308", "3:0", "-1:2", "99:2", "3",
                                       ":", "", "1:2,1:3", "a:b"]), st.text(max_size=8))
PATHS = st.sampled_from(["", "OUT/x.json", "OUT/deep/er/x.html", "OUT", "/dev/null/x", "OUT/file.txt/x"])


def materialize(argv: list[str], tmp: Path) -> list[str]:
    (tmp / "file.txt").write_text("a file")
    return [a.replace("OUT", str(tmp)) for a in argv]


def options(table: dict) -> st.SearchStrategy:
    """A list of (flag, value) pairs drawn from `table` (flag -> strategy of values, or None for a switch)."""
    if not table:
        return st.just([])
    pairs = st.sampled_from(sorted(table)).flatmap(
        lambda f: st.just([f]) if table[f] is None else table[f].map(lambda v: [f, v]))
    return st.lists(pairs, max_size=5).map(lambda xs: [a for x in xs for a in x])


TWIN = {
    "program": {"--model": st.sampled_from(["gpt-tiny", "gpt-small", "nope", "", "OUT/file.txt"]), "--grid": GRIDS,
                "--gpus": NUMBERS, "--batch": NUMBERS, "--seq": NUMBERS, "--micro-batches": NUMBERS,
                "--cache-layers": NUMBERS, "--hbm-gib": NUMBERS, "--json-out": PATHS, "--json": None, "--no-oar": None,
                "--no-recompute": None, "--bogus": None},
    "simulate": {"--grid": GRIDS, "--gpus": NUMBERS, "--batch": NUMBERS, "--seq": NUMBERS, "--micro-batches": NUMBERS,
                 "--placement": st.sampled_from(["contiguous", "scattered", "x"]), "--full": None,
                 "--slowdown": SLOWDOWNS, "--simulate-top": NUMBERS, "--json": None, "--trace": PATHS,
                 "--html": PATHS, "--profile": st.sampled_from(["cpu", "a100", "nope"]), "--no-gemm-tuning": None,
                 "--cache-layers": NUMBERS},
    "search": {"--gpus": NUMBERS, "--top": NUMBERS, "--simulate-top": NUMBERS, "--batch": NUMBERS, "--json": None,
               "--placement": st.sampled_from(["contiguous", "scattered", ""])},
    "topology": {"--gpus": NUMBERS, "--placement": st.sampled_from(["contiguous", "scattered"]), "--seed": NUMBERS,
                 "--grid": GRIDS, "--html": PATHS},
}


@st.composite
def twin_argv(draw):
    cmd = draw(st.sampled_from(sorted(TWIN) + ["models", "systems", "nope"]))
    argv = [cmd]
    if cmd in ("simulate", "search", "topology"):
        # the small systems keep a valid case fast; the model is always small
        argv += ["--system", draw(st.sampled_from(["cpu", "cpu", "cpu", "nowhere", "OUT/file.txt"]))]
        if cmd != "topology":
            argv += ["--model", "gpt-tiny"]
        # a valid case stays fast: a given grid (not the search) unless the drawn options say otherwise
        argv += {"simulate": ["--grid", "2x2x2x1"], "search": ["--simulate-top", "0"]}.get(cmd, [])
    return argv + draw(options(TWIN.get(cmd, {})))


@FUZZ
@given(argv=twin_argv())
def test_twin_command_line(argv, tmp_path_factory, monkeypatch):
    from twin.cli.main import app

    tmp = tmp_path_factory.mktemp("twin")
    monkeypatch.chdir(tmp)  # a relative output path lands in a temporary folder, never in the checkout
    argv = materialize(argv, tmp)
    with no_hang(argv):
        result = runner.invoke(app, argv)
    check_outcome(result, argv)
    if result.exit_code == 0 and "--json" in argv and argv[0] in ("simulate", "search"):
        strict_json(result.stdout)


BACKEND = {
    "run": {"--model": st.sampled_from(["gpt-tiny", "nope"]), "--grid": GRIDS, "--steps": NUMBERS,
            "--batch": NUMBERS, "--micro-batches": NUMBERS, "--lr": NUMBERS, "--min-lr": NUMBERS, "--warmup": NUMBERS,
            "--weight-decay": NUMBERS, "--grad-clip": NUMBERS, "--cache-layers": NUMBERS,
            "--data": st.sampled_from(["synthetic", "synthetic:-5", "synthetic:100", "synthetic:x", "OUT/file.txt",
                                       "nope.bin", ""]),
            "--out": PATHS, "--ckpt-dir": PATHS, "--ckpt-every": NUMBERS, "--log-every": NUMBERS,
            "--trace-step": NUMBERS, "--seed": NUMBERS, "--device": st.sampled_from(["cpu", "cuda", "tpu"]),
            "--progress-timeout": NUMBERS},
    "replay": {"--grid": GRIDS, "--steps": NUMBERS, "--batch": NUMBERS, "--out": PATHS,
               "--dtype": st.sampled_from(["auto", "fp32", "bf16", "int8"]), "--device": st.sampled_from(["cpu", "x"])},
    "bench": {"--grid": GRIDS, "--squares": st.sampled_from(["1024", "-5", "0", "a", "", "64,128", "1e9"]),
              "--sizes-mib": st.sampled_from(["1", "-1", "nan", "inf", "0", "", "1,2", "x"]),
              "--min-time": NUMBERS, "--out": PATHS, "--dtype": st.sampled_from(["fp32", "fp64"]),
              "--model": st.sampled_from(["gpt-tiny", "nope"])},
}


@st.composite
def backend_argv(draw):
    cmd = draw(st.sampled_from(sorted(BACKEND) + ["nope"]))
    return [cmd] + draw(options(BACKEND.get(cmd, {})))


@FUZZ
@given(argv=backend_argv())
def test_backend_command_line(argv, tmp_path_factory, monkeypatch):
    """Everything up to starting the ranks (which is stubbed: training is tested elsewhere)."""
    pytest.importorskip("torch")
    import backend.launch.launcher
    from backend.cli.main import app

    monkeypatch.setattr(backend.launch.launcher, "launch", lambda *a, **k: 0)
    tmp = tmp_path_factory.mktemp("backend")
    monkeypatch.chdir(tmp)
    argv = materialize(argv, tmp)
    with no_hang(argv):
        result = runner.invoke(app, argv)
    check_outcome(result, argv)


# ---- spec files -----------------------------------------------------------------------------------
WEIRD = st.one_of(st.sampled_from([0, -1, 1, 2, 10 ** 12, 1e300, -1e300, math.nan, math.inf, -math.inf, 0.5, True,
                                   False, "", "abc", [], [1], ["bogus"], {}, {"value": 1}]),
                  st.integers(), st.floats(), st.text(max_size=5), st.lists(st.integers(-2, 9), max_size=9))


def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(x)}" for k, x in v.items()) + "}"


def toml_dump(data: dict) -> str:
    """A small TOML writer: scalars and inline tables first, then [tables] and [[arrays of tables]]."""
    head, tail = [], []
    for k, v in data.items():
        if isinstance(v, dict) and v and all(not isinstance(x, dict) for x in v.values()) and k not in ("gpu_nic",):
            tail.append(f"\n[{k}]\n" + "".join(f"{json.dumps(kk)} = {toml_value(x)}\n" for kk, x in v.items()))
        else:
            head.append(f"{json.dumps(k)} = {toml_value(v)}\n")
    return "".join(head) + "".join(tail)


def leaves(data, prefix=()):
    """Paths to every value of a nested dict/list."""
    if isinstance(data, dict):
        for k, v in data.items():
            yield prefix + (k,)
            yield from leaves(v, prefix + (k,))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            yield prefix + (i,)
            yield from leaves(v, prefix + (i,))


@st.composite
def mutated(draw, base: dict):
    data = json.loads(json.dumps(base))
    for _ in range(draw(st.integers(1, 3))):
        paths = list(leaves(data))
        path = draw(st.sampled_from(paths))
        parent = data
        for p in path[:-1]:
            parent = parent[p]
        action = draw(st.sampled_from(["set", "set", "set", "delete", "add"]))
        try:
            if action == "delete":
                del parent[path[-1]]
            elif action == "add" and isinstance(parent, dict):
                parent["surprise"] = copy.deepcopy(draw(WEIRD))  # never mutate WEIRD's own lists
            else:
                parent[path[-1]] = copy.deepcopy(draw(WEIRD))
        except (IndexError, KeyError, TypeError):
            pass
    return data


def load_base(path: str) -> dict:
    return tomllib.loads((ROOT / path).read_text())


def small_measurement() -> dict:
    """A real `backend bench` file of 2 ranks (the test fixture's), cut to a few rows of each table (so
    that a mutation often lands on a row), that still fits a whole profile."""
    data = json.loads((ROOT / "tests/fixtures/cpu-2026-12-03a/bench-2x1x1x1.json").read_text())
    data["gemm"] = data["gemm"][:4]
    data["collectives"] = data["collectives"][:6]
    data["steps"] = data["steps"][:8]
    return data


def small_program() -> dict:
    """A program file (`twin program --json`) of gpt-tiny on one rank: a mutation lands on an op's field."""
    from twin.program.grid import Grid
    from twin.program.model import load_model
    from twin.program.program import build_program
    from twin.program.programfile import program_json
    return json.loads(program_json(build_program(load_model("gpt-tiny"), Grid(1, 1, 1, 1))))


SPECS = {"system": load_base("topologies/systems/perlmutter.toml"), "model": load_base("twin/models/gpt-tiny.toml"),
         "profile": load_base("twin/profiles/a100.toml"), "measurement": small_measurement(),
         "program": small_program()}
JSON_KINDS = ("measurement", "program")


def load(kind: str, path: str):
    """Read a spec file the way a command does: a bad file is one line naming it."""
    if kind == "measurement":
        from calibration.measurements import load_measurement
        return load_measurement(path)
    if kind == "program":
        from twin.program.programfile import load_program
        return load_program(path)
    if kind == "system":
        from topologies.system import load_system
        return load_system(path)
    if kind == "model":
        from twin.program.model import load_model
        return load_model(path)
    from twin.costs.profile import load_profile
    return load_profile(path)


def use(kind: str, spec, path: str) -> None:
    """Use a loaded spec the way a command would (cheaply): whatever it finds is one line."""
    from twin.program.grid import Grid
    from twin.predict.memory import memory_per_gpu
    from twin.program.program import build_program

    if kind == "measurement":
        from calibration.fit import fit_profile
        fit_profile([path], "fuzz")
    elif kind == "system":
        from topologies.network import build_network
        from topologies.placement import place
        place(spec, min(spec.total_gpus, 16), "scattered", 1)
        if spec.total_gpus <= 100_000:
            build_network(spec).summary()
    elif kind == "program":
        from twin.predict.simulate import SimulationConfig, simulate
        simulate(SimulationConfig("cpu", program=spec))
    elif kind == "model":
        build_program(spec, Grid(1, 1, 1, 1))
        memory_per_gpu(spec, Grid(1, 1, 1, 1))
        spec.parameters(), spec.reference_flops()
    else:
        from twin.costs.kernels import KernelModel
        from twin.program.model import load_model
        km = KernelModel(spec)
        for op in build_program(load_model("gpt-tiny"), Grid(1, 1, 1, 1)).ops:
            t = 0.0 if op.is_collective else km.kernel_time(op)
            assert math.isfinite(t) and t >= 0, (op.name, t)


@FUZZ
@given(kind=st.sampled_from(sorted(SPECS)), data=st.data())
def test_spec_files(kind, data, tmp_path_factory):
    spec = data.draw(mutated(SPECS[kind]))
    path = tmp_path_factory.mktemp("spec") / f"fuzz-{kind}.{'json' if kind in JSON_KINDS else 'toml'}"
    text = json.dumps(spec) if kind in JSON_KINDS else toml_dump(spec)
    path.write_text(text)
    with no_hang(text):
        try:
            spec = load(kind, str(path))
        except InputError as e:
            assert "\n" not in str(e) and str(path) in str(e), str(e)
            return
        try:
            use(kind, spec, str(path))
        except InputError as e:
            assert "\n" not in str(e), str(e)


@FUZZ
@given(data=st.data())
def test_system_file_through_the_command_line(data, tmp_path_factory):
    """A mutated system through `twin simulate --json`: one line or standard JSON."""
    from twin.cli.main import app

    spec = data.draw(mutated(load_base("topologies/systems/cpu.toml")))
    path = tmp_path_factory.mktemp("sys") / "fuzz.toml"
    path.write_text(toml_dump(spec))
    argv = ["simulate", "--system", str(path), "--model", "gpt-tiny", "--gpus", "8", "--grid", "2x2x2x1", "--json"]
    with no_hang(argv):
        result = runner.invoke(app, argv)
    check_outcome(result, argv)
    if result.exit_code == 0:
        out = strict_json(result.stdout)
        assert out["iteration_time_s"] > 0
