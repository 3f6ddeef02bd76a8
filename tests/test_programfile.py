"""Program files: written by `twin program --json`, read back and validated, simulated as edited;
a bad file gets one line saying what is wrong."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from topologies.common import InputError
from twin.program.grid import Grid
from twin.program.model import load_model
from twin.program.program import Options, Program, build_program
from twin.program.programfile import load_program, program_json, save_program, validate_program


def _prog(grid: str = "1x2x2x1", **opts) -> Program:
    return build_program(load_model("gpt-tiny"), Grid.parse(grid), Options(**opts), batch=8)


def move(program: Program, name: str, position: int, deps: tuple[int, ...] = ()) -> Program:
    """The program with op `name` moved to `position` (its deps replaced), indices renumbered."""
    ops = list(program.ops)
    i = next(j for j, op in enumerate(ops) if op.name == name)
    ops.insert(position, replace(ops.pop(i), deps=deps))
    new = {op.index: j for j, op in enumerate(ops)}
    ops = [replace(op, index=j, deps=tuple(sorted(new[d] for d in op.deps))) for j, op in enumerate(ops)]
    return replace(program, ops=ops)


def wait_for(program: Program, name: str, other: str) -> Program:
    """The program with op `name` also waiting for op `other` (an overlap turned off)."""
    by = {op.name: op for op in program.ops}
    op = by[name]
    ops = list(program.ops)
    ops[op.index] = replace(op, deps=tuple(sorted({*op.deps, by[other].index})))
    return replace(program, ops=ops)


def edited(program: Program) -> Program:
    """L1.qkv's forward all-gather issued first thing; L1.mlp_up's wgrad after its y all-reduce."""
    return wait_for(move(program, "L1.qkv.fwd.ag_z", 1), "L1.mlp_up.bwd.wgrad", "L1.mlp_up.bwd.ar_y")


def test_roundtrip_and_edits(tmp_path):
    prog = _prog()
    path = tmp_path / "p.json"
    save_program(prog, path)
    back = load_program(path)
    assert back.ops == prog.ops and back.grid == prog.grid and back.options == prog.options
    ed = edited(prog)
    validate_program(ed)
    save_program(ed, path)
    assert [op.name for op in load_program(path).ops][:3] == ["emb.fwd.ag_z", "L1.qkv.fwd.ag_z", "L0.qkv.fwd.ag_z"]


BAD = [
    (lambda p: move(p, "L0.qkv.fwd.gemm", 0), "reads 'L0.ln1.out' before any op writes it"),
    (lambda p: move(p, "L0.qkv.fwd.ag_z", 3, deps=(5,)), "does not come before it"),
    (lambda p: replace(p, ops=[replace(o, deps=()) if o.name == "L0.qkv.fwd.gemm" else o for o in p.ops]),
     "without waiting for L0.qkv.fwd.ag_z"),
    (lambda p: replace(p, ops=[replace(o, bytes=o.bytes * 2) if o.name == "L0.qkv.fwd.ag_z" else o for o in p.ops]),
     "differs from the program"),
    (lambda p: replace(p, ops=p.ops[:-1]), "is missing"),
    (lambda p: move(p, "loss.bwd", 2, deps=(1,)), "comes after a later pass"),
]


@pytest.mark.parametrize("edit,message", BAD, ids=[m for _, m in BAD])
def test_bad_edits_are_refused(edit, message):
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace("'", ".")):
        validate_program(edit(_prog()))


def test_malformed_files(tmp_path):
    path = tmp_path / "p.json"
    for text, message in [("{", "not valid JSON"), ("{}", "program is missing"), ('{"program": {"format": 7}}', "format 7"),
                          ("[]", "the file must be a table")]:
        path.write_text(text)
        with pytest.raises(InputError, match=message):
            load_program(path)
    with pytest.raises(InputError, match="does not exist"):
        load_program(tmp_path / "missing.json")
    data = json.loads(program_json(_prog()))
    data["ops"][3]["colour"] = "red"
    path.write_text(json.dumps(data))
    with pytest.raises(InputError, match=r"ops\[3\].colour is not a known key"):
        load_program(path)


def _shapes() -> list[tuple[str, callable, str]]:
    """Program files of the wrong shape (issue 48): each is refused in one line naming the key."""
    def op3(key, value):
        return lambda d: d["ops"][3].__setitem__(key, value)
    return [
        ("deps null", op3("deps", None), "ops[3].deps must be a list, got None"),
        ("deps 2", op3("deps", 2), "ops[3].deps must be a list, got 2"),
        ("index 3.0", op3("index", 3.0), "ops[3].index must be an integer"),
        ("name 7", op3("name", 7), "ops[3].name must be a string"),
        ("micro_batches text", lambda d: d["program"]["options"].__setitem__("micro_batches", "2"),
         "program.options.micro_batches must be an integer"),
        ("program 5", lambda d: d.__setitem__("program", 5), "program must be a table, got 5"),
        ("batch 8.5", lambda d: d["program"].__setitem__("batch", 8.5), "program.batch must be an integer"),
        ("ops a table", lambda d: d.__setitem__("ops", {}), "ops must be a list"),
        ("oar 1", lambda d: d["program"]["options"].__setitem__("oar", 1), "program.options.oar must be true or false"),
        ("layers huge", lambda d: d["program"]["model"].__setitem__("layers", 10 ** 9), "program.model.layers must be"),
    ]


SHAPES = _shapes()


@pytest.mark.parametrize("edit,message", [s[1:] for s in SHAPES], ids=[s[0] for s in SHAPES])
def test_files_of_the_wrong_shape_are_refused_naming_the_key(tmp_path, edit, message):
    data = json.loads(program_json(_prog()))
    edit(data)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises(InputError) as e:
        load_program(path)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_deeply_nested_json_is_refused(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text('{"program": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(InputError, match="nested too deeply"):
        load_program(path)
    path.write_text('{"program": {"format": 1}, "ops": [' + "[" * 50 + "]" * 50 + "]}")
    with pytest.raises(InputError, match="program file"):
        load_program(path)


def test_every_field_of_an_op_has_a_typed_rule():
    """The schema is built from the dataclasses: a field of a new type must get a rule (else import fails)."""
    from dataclasses import fields

    from twin.program.programfile import OP
    from twin.program.ops import Op
    assert set(OP.required) | set(OP.optional) == {f.name for f in fields(Op)}


def test_progress_is_reported_on_the_way(tmp_path):
    path = tmp_path / "p.json"
    save_program(_prog(), path)
    seen = []
    load_program(path, progress=seen.append)
    assert len(seen) >= 10 and seen == sorted(seen) and 0 <= seen[0] and seen[-1] <= 1


def test_simulate_an_edited_program(tmp_path):
    """The twin simulates the file as edited: waiting for an all-reduce cannot make the step faster."""
    from twin.predict.simulate import SimulationConfig, simulate

    prog = _prog("2x2x2x1")
    slow = wait_for(prog, "L1.mlp_up.bwd.wgrad", "L1.mlp_up.bwd.ar_y")
    base, off = (simulate(SimulationConfig("cpu", program=p)).iteration_time_s for p in (prog, slow))
    assert off >= base
    assert simulate(SimulationConfig("cpu", program=prog)).iteration_time_s == pytest.approx(
        simulate(SimulationConfig("cpu", "gpt-tiny", grid="2x2x2x1", batch=8)).iteration_time_s)


def test_both_commands_refuse_each_shape_in_one_line(tmp_path):
    """`twin simulate --program` and `backend run --program` give the same one line, exit 2, no traceback."""
    from typer.testing import CliRunner

    from backend.cli.main import app as backend_app
    from twin.cli.main import app as twin_app

    runner = CliRunner()
    good = json.loads(program_json(_prog()))
    cases = [(name, edit) for name, edit, _ in SHAPES] + [("deep", None)]
    for name, edit in cases:
        path = tmp_path / f"{name.replace(' ', '_')}.json"
        if edit is None:
            path.write_text('{"program": ' + "[" * 100_000 + "]" * 100_000 + "}")
        else:
            data = json.loads(json.dumps(good))
            edit(data)
            path.write_text(json.dumps(data))
        for app, args in ((twin_app, ["simulate", "--system", "cpu", "--program", str(path)]),
                          (backend_app, ["run", "--program", str(path), "--out", str(tmp_path / "out")])):
            r = runner.invoke(app, args)
            lines = [line for line in r.output.splitlines() if line.strip()]
            assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: program file"), (name, r.output)


def test_backend_refuses_the_flags_a_program_fixes(tmp_path):
    from typer.testing import CliRunner

    from backend.cli.main import app as backend_app

    path = tmp_path / "p.json"
    save_program(_prog(), path)
    for flags, named in ((["--grid", "1x2x2x1"], "--grid"), (["--model", "gpt-small", "--no-oar"], "--model, --no-oar"),
                         (["--micro-batches", "2"], "--micro-batches")):
        r = CliRunner().invoke(backend_app, ["run", "--program", str(path), *flags, "--out", str(tmp_path / "o")])
        assert r.exit_code == 2 and "--program fixes" in r.output and named in r.output, r.output


def test_twin_refuses_the_switches_a_program_fixes(tmp_path):
    from typer.testing import CliRunner

    from twin.cli.main import app as twin_app

    path = tmp_path / "p.json"
    save_program(_prog(), path)
    for flags in (["--no-oar"], ["--micro-batches", "2"], ["--grid", "1x2x2x1"]):
        r = CliRunner().invoke(twin_app, ["simulate", "--system", "cpu", "--program", str(path), *flags])
        assert r.exit_code == 2 and "--program fixes" in r.output, r.output
