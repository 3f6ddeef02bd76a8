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
    for text, message in [("{", "not valid JSON"), ("{}", "malformed"), ('{"program": {"format": 7}}', "format 7")]:
        path.write_text(text)
        with pytest.raises(InputError, match=message):
            load_program(path)
    with pytest.raises(InputError, match="does not exist"):
        load_program(tmp_path / "missing.json")
    data = json.loads(program_json(_prog()))
    data["ops"][3]["colour"] = "red"
    path.write_text(json.dumps(data))
    with pytest.raises(InputError, match="unknown fields colour"):
        load_program(path)


def test_simulate_an_edited_program(tmp_path):
    """The twin simulates the file as edited: waiting for an all-reduce cannot make the step faster."""
    from twin.predict.simulate import SimulationConfig, simulate

    prog = _prog("2x2x2x1")
    slow = wait_for(prog, "L1.mlp_up.bwd.wgrad", "L1.mlp_up.bwd.ar_y")
    base, off = (simulate(SimulationConfig("cpu", program=p)).iteration_time_s for p in (prog, slow))
    assert off >= base
    assert simulate(SimulationConfig("cpu", program=prog)).iteration_time_s == pytest.approx(
        simulate(SimulationConfig("cpu", "gpt-tiny", grid="2x2x2x1", batch=8)).iteration_time_s)
