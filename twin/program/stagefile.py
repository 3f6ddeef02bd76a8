"""Program files of pipelined grids (twin/program/programfile.py for the format): the file holds the
program of every stage, `"stages": [{"stage": k, "ops": [...]}, ...]`, under one header.

`validate_stages` checks each stage's program as validate_program checks one rank's (every op one of
the stage's own, unchanged but for its position and deps, none missing, deps backwards, buffers
written before they are read; micro-batches in flight together keep their buffers apart), and that
the stages talk to each other: every send has its receive, of the same name and bytes, on the stage
it names, and every receive its send.
"""

from __future__ import annotations

from dataclasses import asdict

from topologies.common import InputError
from twin.program.ops import Op, Program, STREAMS, check_dataflow
from twin.program.pipeline import PIPE, build_stage_program



def stages_json(programs: list[Program]) -> dict:
    """The part of a program file that holds the stages' ops."""
    return {"stages": [{"stage": p.stage, "ops": [asdict(op) for op in p.ops]} for p in programs]}


def _key(op: Op) -> tuple:
    d = asdict(op)
    d.pop("index")
    d.pop("deps")
    return tuple(d.values())


def validate_stages(programs: list[Program], where: str = "program") -> None:
    """Check the stage programs of a pipelined grid (module docstring); raises InputError (one line)."""
    first = programs[0]
    grid = first.grid
    if len(programs) != grid.pipe:
        raise InputError(f"{where}: grid {grid} has {grid.pipe} pipeline stages but the file holds {len(programs)}")
    for k, prog in enumerate(programs):
        if prog.stage != k:
            raise InputError(f"{where}: stage {prog.stage} is at position {k}: list the stages in order")
        ref = build_stage_program(prog.model, grid, prog.options, prog.batch, prog.seq_len, k)
        want = {op.name: _key(op) for op in ref.ops}
        seen: set[str] = set()
        here = f"{where}, stage {k}"
        for i, op in enumerate(prog.ops):
            if op.index != i:
                raise InputError(f"{here}: op {op.name} at position {i} has index {op.index}: "
                                 "indices must be positions")
            if op.name in seen:
                raise InputError(f"{here}: op {op.name} appears twice")
            seen.add(op.name)
            if op.name not in want:
                raise InputError(f"{here}: op {op.name} is not an op of this stage of {prog.model.name} on grid {grid}")
            if _key(op) != want[op.name]:
                raise InputError(f"{here}: op {op.name} differs from the stage's program "
                                 "(only the order of the ops and their deps may be edited)")
            if op.stream not in STREAMS + (PIPE,):
                raise InputError(f"{here}: op {op.name} runs on stream {op.stream!r}: use compute, its axis or pipe")
            bad = [d for d in op.deps if not (isinstance(d, int) and 0 <= d < i)]
            if bad:
                raise InputError(f"{here}: op {op.name} depends on op {bad[0]}, which does not come before it "
                                 "(dependencies must point to earlier ops)")
        missing = [name for name in want if name not in seen]
        if missing:
            raise InputError(f"{here}: op {missing[0]} is missing ({len(missing)} ops missing)")
        check_dataflow(prog, here, by_micro_batch=True)
    check_pairs(programs, where)


def check_pairs(programs: list[Program], where: str = "program") -> None:
    """Every send has its receive on the stage it names (same name but send/recv, same bytes), and
    every receive its send; raises InputError."""
    recvs = [{op.name[: -len(".recv")]: op for op in p.ops if op.kind == "recv"} for p in programs]
    sends = [{op.name[: -len(".send")]: op for op in p.ops if op.kind == "send"} for p in programs]
    for k, p in enumerate(programs):
        for base, op in sends[k].items():
            if not 0 <= op.peer < len(programs):
                raise InputError(f"{where}: send {op.name} of stage {k} names stage {op.peer}, which does not exist")
            r = recvs[op.peer].get(base)
            if r is None or r.peer != k:
                raise InputError(f"{where}: send {op.name} of stage {k} has no receive {base}.recv on stage {op.peer}")
            if r.bytes != op.bytes:
                raise InputError(f"{where}: send {op.name} of stage {k} carries {op.bytes} bytes but its receive on "
                                 f"stage {op.peer} expects {r.bytes}")
        for base, op in recvs[k].items():
            s = sends[op.peer].get(base) if 0 <= op.peer < len(programs) else None
            if s is None or s.peer != k:
                raise InputError(f"{where}: receive {op.name} of stage {k} has no send {base}.send on stage {op.peer}")
