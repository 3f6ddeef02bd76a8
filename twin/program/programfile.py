"""Program files: what you simulate is what you run.

    twin program --json prog.json ...       # write the program (model, grid, batch, switches, every op)
    twin simulate --system frontier --program prog.json
    backend run --program prog.json

`save_program` writes a program as JSON; `load_program` reads one back and `validate_program` checks
it, so that a user may edit the order of the ops and their dependencies (issue an all-gather earlier,
turn an overlap off) and nothing else breaks silently. Checks, each failing with one line that says
what is wrong and how to fix it:
- the header (model spec, grid, switches, batch, sequence length) builds a valid program;
- every op is one of that program's ops, unchanged but for its position and its dependencies, and
  none is missing: so the shapes fit the model and grid, and the step computes every gradient (each
  weight gets its weight-gradient GEMM, its reduce-scatter and its data all-reduce);
- indices are positions, dependencies point backwards (so they are acyclic);
- the passes come in order (forward and backward of each micro-batch, then the gradient
  reductions, then the optimizer);
- the dataflow holds: every buffer an op reads was written by an earlier op, and a buffer written by
  a collective is read only after the reader has waited for that collective (a dependency on it, or on
  a later op of its stream).
"""

from __future__ import annotations

import json
from dataclasses import asdict, fields
from pathlib import Path

from topologies.common import InputError, finite_json, write_atomic
from twin.program.grid import Grid
from twin.program.model import ModelSpec
from twin.program.program import STREAMS, Op, Options, Program, build_program

FORMAT = 1
INPUTS = ("tokens", "targets")


def program_json(program: Program | list[Program]) -> str:
    """The program as JSON: a header to rebuild it, its summary, and every op (a pipelined grid's: the
    list of its stages' programs, each stage's ops; twin/program/stagefile.py)."""
    stages = program if isinstance(program, list) else None
    program = stages[0] if stages else program
    header = {"format": FORMAT, "model": asdict(program.model), "grid": str(program.grid),
              "options": asdict(program.options), "batch": program.batch, "seq_len": program.seq_len,
              "vocab": program.vocab}
    if stages:
        from twin.program.stagefile import stages_json
        return finite_json({"program": header, "summary": program.summary(), **stages_json(stages)}, indent=1)
    return finite_json({"program": header, "summary": program.summary(),
                        "ops": [asdict(op) for op in program.ops]}, indent=1)


def save_program(program: Program | list[Program], path: str | Path) -> None:
    write_atomic(path, program_json(program))


def load_program(path: str | Path) -> Program | list[Program]:
    """Read and validate a program file (raises InputError with one line); a pipelined grid's file
    gives the list of its stages' programs."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
        head = data["program"]
        if head.get("format") != FORMAT:
            raise InputError(f"program file {path}: format {head.get('format')!r} is not {FORMAT} "
                             "(write it again with `twin program --json`)")
        model = ModelSpec(**head["model"])
        options = Options(**head["options"])
        grid = Grid.parse(head["grid"])
        known = {f.name for f in fields(Op)}

        def parse_ops(items) -> list[Op]:
            ops = []
            for i, d in enumerate(items):
                unknown = set(d) - known
                if unknown:
                    raise InputError(f"program file {path}: op {i} has unknown fields {', '.join(sorted(unknown))}")
                ops.append(Op(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}))
            return ops

        if grid.pipe > 1 or "stages" in data:
            from twin.program.stagefile import validate_stages
            if "stages" not in data:
                raise InputError(f"program file {path}: grid {grid} is pipelined but the file has no stages "
                                 "(write it again with `twin program --json`)")
            stages = [Program(model, grid, options, int(head["batch"]), int(head["seq_len"]), int(head["vocab"]),
                              parse_ops(st["ops"]), stage=int(st["stage"])) for st in data["stages"]]
            validate_stages(stages, where=f"program file {path}")
            return stages
        program = Program(model, grid, options, int(head["batch"]), int(head["seq_len"]), int(head["vocab"]),
                          parse_ops(data["ops"]))
    except InputError:
        raise
    except FileNotFoundError:
        raise InputError(f"program file {path} does not exist (write one with `twin program --json {path}`)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"program file {path} is not valid JSON: {e}") from None
    except (KeyError, TypeError, ValueError) as e:
        raise InputError(f"program file {path} is malformed ({type(e).__name__}: {e}); "
                         "write it again with `twin program --json`") from None
    validate_program(program, where=f"program file {path}")
    return program


def _canonical_key(op: Op) -> tuple:
    """Everything of an op but its position and dependencies."""
    d = asdict(op)
    d.pop("index")
    d.pop("deps")
    return tuple(d.values())


def _segment_rank(op: Op, micro_batches: int) -> int:
    if op.phase in ("grad", "opt"):
        return 2 * micro_batches + (op.phase == "opt")
    return 2 * op.micro_batch + (op.phase != "fwd")


def validate_program(program: Program, where: str = "program") -> None:
    """Check a (possibly edited) program; see the module docstring. Raises InputError."""
    ref = build_program(program.model, program.grid, program.options, program.batch, program.seq_len)
    if program.vocab != ref.vocab:
        raise InputError(f"{where}: vocabulary {program.vocab} is not the padded vocabulary {ref.vocab} of the model")
    want = {op.name: _canonical_key(op) for op in ref.ops}
    seen = set()
    for i, op in enumerate(program.ops):
        if op.index != i:
            raise InputError(f"{where}: op {op.name} at position {i} has index {op.index}: indices must be positions")
        if op.name in seen:
            raise InputError(f"{where}: op {op.name} appears twice")
        seen.add(op.name)
        if op.name not in want:
            raise InputError(f"{where}: op {op.name} is not an op of {program.model.name} on grid {program.grid} "
                             "with these switches")
        if _canonical_key(op) != want[op.name]:
            raise InputError(f"{where}: op {op.name} differs from the program of its model, grid and switches "
                             "(only the order of the ops and their deps may be edited)")
        if op.stream not in STREAMS or (op.is_collective and op.stream != op.axis):
            raise InputError(f"{where}: op {op.name} runs on stream {op.stream!r}: use compute or its axis")
        bad = [d for d in op.deps if not (isinstance(d, int) and 0 <= d < i)]
        if bad:
            raise InputError(f"{where}: op {op.name} depends on op {bad[0]}, which does not come before it "
                             "(dependencies must point to earlier ops)")
    missing = [name for name in want if name not in seen]
    if missing:
        raise InputError(f"{where}: op {missing[0]} is missing ({len(missing)} ops missing): the step would not "
                         "compute every gradient")
    _check_order(program, where)
    _check_dataflow(program, where)


def _check_order(program: Program, where: str) -> None:
    last = -1
    for op in program.ops:
        rank = _segment_rank(op, program.options.micro_batches)
        if rank < last:
            raise InputError(f"{where}: op {op.name} ({op.phase} of micro-batch {op.micro_batch}) comes after a later "
                             "pass: keep each pass's ops together, in pass order")
        last = rank


def _check_dataflow(program: Program, where: str) -> None:
    """Walk the ops as the executor does: complete[stream] is the last op of the stream known done."""
    ops = program.ops
    writer: dict[str, int] = {}
    complete: dict[str, int] = {}
    local_weights = program.grid.z == 1
    for op in ops:
        for d in op.deps:
            complete[ops[d].stream] = max(complete.get(ops[d].stream, -1), d)
        for name in op.reads + ((op.add,) if op.add else ()):
            w = writer.get(name)
            if w is None:
                if name in INPUTS or (local_weights and name.startswith("w:")):
                    continue
                raise InputError(f"{where}: op {op.name} reads {name!r} before any op writes it")
            if ops[w].is_collective and complete.get(ops[w].stream, -1) < w:
                raise InputError(f"{where}: op {op.name} reads {name!r} without waiting for {ops[w].name}, "
                                 f"which writes it: add {w} to its deps")
        for name in op.writes:
            writer[name] = op.index
        if not op.is_collective:
            complete["compute"] = op.index
