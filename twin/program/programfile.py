"""Program files: what you simulate is what you run.

    twin program --json-out prog.json ...   # write the program (model, grid, batch, switches, every op)
    twin simulate --system frontier --program prog.json
    backend run --program prog.json

`save_program` writes a program as JSON; `load_program` reads one back and `validate_program` checks
it, so that a user may edit the order of the ops and their dependencies (issue an all-gather earlier,
turn an overlap off) and nothing else breaks silently. Checks, each failing with one line that says
what is wrong and how to fix it:
- every key has the type the schema gives it (`PROGRAM_FILE` and `OP`, built from the dataclasses of the
  model spec, the switches and the op: an integer is an integer, `deps` a list of them), so nothing
  untyped reaches the checks below; JSON nested too deeply to be a program is refused;
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
import math
from dataclasses import MISSING, asdict, fields
from pathlib import Path
from typing import Callable

from topologies.common import InputError, finite_json, write_atomic
from topologies.schema import MODEL, Flag, Int, Invalid, ListOf, Nullable, Number, Table, Text, ZeroOr, check
from twin.program.grid import Grid
from twin.program.model import ModelSpec
from twin.program.ops import check_dataflow
from twin.program.program import STREAMS, Op, Options, Program, build_program

FORMAT = 1


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


# -- the schema of a program file: every key and its type, checked before anything is built ------------
_INT = Int(-1, 10 ** 15)  # -1: micro_batch of the end of the step
_RULES = {"int": _INT, "float": Number(0.0, 1e30), "str": Text(), "bool": Flag(), "str | None": Nullable(Text()),
          "int | None": Nullable(_INT), "float | None": Nullable(Number(0.0, 1e30)),
          "tuple[int, ...]": ListOf(Int(0, 10 ** 15)), "tuple[str, ...]": ListOf(Text())}  # by the field's annotation
_MODEL_ZERO = {"kv_heads", "ffn_size", "rope_scaling", "experts", "top_k", "capacity_factor"}  # 0 means "none" in a spec, which model files leave out


def _table(cls, rules: dict | None = None, extra: dict | None = None) -> Table:
    """The rule of a dataclass written by asdict: each field with the rule of its type (`rules` first);
    fields without a default are required."""
    required, optional = {}, {}
    for f in fields(cls):
        rule = (rules or {}).get(f.name) or _RULES.get(str(f.type))
        if rule is None:
            raise TypeError(f"programfile: no schema rule for {cls.__name__}.{f.name}: {f.type}")
        (required if f.default is MISSING and f.default_factory is MISSING else optional)[f.name] = rule
    return Table(required=required, optional={**optional, **(extra or {})})


_MODEL_RULES = {**MODEL.required, **MODEL.optional}
OP = _table(Op, {"index": Int(0, 10 ** 15), "flops": Number(0.0, 1e30)})
PROGRAM_FILE = Table(
    required={
        "program": Table(required={
            "format": Int(0, 10 ** 6), "grid": Text(nonempty=True), "batch": Int(1, 10 ** 9), "seq_len": Int(1, 10 ** 7),
            "vocab": Int(1, 10 ** 8),
            "model": _table(ModelSpec, {k: ZeroOr(r) if k in _MODEL_ZERO else r for k, r in _MODEL_RULES.items()}),
            "options": _table(Options, {f.name: Int(0, 10 ** 6) for f in fields(Options) if f.type == "int"})}),
    },
    # the ops (each checked against OP in load_program), or a pipelined grid's stages, each with its ops
    optional={"summary": Table(extra=True), "ops": ListOf(Table(extra=True), max_len=50_000_000),
              "stages": ListOf(Table(required={"stage": Int(0, 10 ** 6),
                                                "ops": ListOf(Table(extra=True), max_len=50_000_000)}),
                               min_len=1, max_len=10 ** 6)})


def _quick(rule) -> Callable[[object], bool]:
    """A predicate that accepts what `rule` accepts, for the common case at a fraction of its cost (a
    file holds up to millions of ops); False sends the value to the rule itself, which says what is wrong."""
    if isinstance(rule, Number):
        kinds = (int,) if rule.integer else (int, float)
        lo, hi = (-math.inf if rule.lo is None else rule.lo), (math.inf if rule.hi is None else rule.hi)
        if rule.lo_open:
            return lambda v: type(v) in kinds and lo < v <= hi
        return lambda v: type(v) in kinds and lo <= v <= hi
    if isinstance(rule, Text) and not rule.choices and not rule.nonempty:
        return lambda v: type(v) is str
    if isinstance(rule, Flag):
        return lambda v: type(v) is bool
    if isinstance(rule, Nullable):
        inner = _quick(rule.rule)
        return lambda v: v is None or inner(v)
    if isinstance(rule, ListOf):
        item = _quick(rule.item)
        return lambda v: type(v) is list and rule.min_len <= len(v) <= rule.max_len and all(map(item, v))
    return lambda v: False


_OP_QUICK = {k: _quick(r) for k, r in {**OP.required, **OP.optional}.items()}
_OP_REQUIRED = frozenset(OP.required)


def _op_ok(d) -> bool:
    """Whether op `d` of a file follows OP (the quick check; OP.check says why not)."""
    return (type(d) is dict and _OP_REQUIRED <= d.keys() and d.keys() <= _OP_QUICK.keys()
            and all(_OP_QUICK[k](v) for k, v in d.items()))


def load_program(path: str | Path, progress: Callable[[float], None] | None = None) -> Program | list[Program]:
    """Read and validate a program file (raises InputError with one line); a pipelined grid's file
    gives the list of its stages' programs.

    progress: called now and then with the share of the work done (0..1), for files of many ops.
    """
    path = Path(path)
    where = f"program file {path}"
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise InputError(f"program file {path} does not exist (write one with `twin program --json-out {path}`)") from None
    except IsADirectoryError:
        raise InputError(f"program file {path} is a folder; give the file `twin program --json-out FILE` wrote") from None
    except UnicodeDecodeError as e:
        raise InputError(f"program file {path} is not valid JSON: {e}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(f"program file {path} is not valid JSON: {e}") from None
    except RecursionError:
        raise InputError(f"program file {path} is nested too deeply to be a program "
                         "(write it again with `twin program --json-out FILE`)") from None
    head = data.get("program") if isinstance(data, dict) else None
    if isinstance(head, dict) and "format" in head and head["format"] != FORMAT:
        raise InputError(f"program file {path}: format {head.get('format')!r} is not {FORMAT} "
                         "(write it again with `twin program --json-out FILE`)")
    check(data, PROGRAM_FILE, path, "program")
    try:
        grid = Grid.parse(head["grid"])
    except InputError as e:
        raise InputError(f"{where}: {e}") from None
    if grid.pipe > 1 or "stages" in data:
        if "stages" not in data:
            raise InputError(f"{where}: grid {grid} is pipelined but the file has no stages "
                             "(write it again with `twin program --json-out FILE`)")
        stages = data["stages"]
        parts = [(st["ops"], f"stages[{k}].ops", (k, len(stages))) for k, st in enumerate(stages)]
    elif "ops" not in data:
        raise InputError(f"{where}: no ops (write it again with `twin program --json-out FILE`)")
    else:
        parts = [(data["ops"], "ops", (0, 1))]
    programs = []
    for raw, key, share in parts:
        ops = _parse_ops(raw, key, where, progress, share)
        try:
            model = ModelSpec(**head["model"])
            programs.append(Program(model, grid, Options(**head["options"]), head["batch"], head["seq_len"],
                                    head["vocab"], ops, **({"stage": data["stages"][share[0]]["stage"]}
                                                           if "stages" in data else {})))
        except InputError as e:
            raise InputError(f"{where}: {e}") from None
        except (TypeError, ValueError) as e:
            raise InputError(f"{where} is malformed ({type(e).__name__}: {e}); write it again with "
                             "`twin program --json-out FILE`") from None
    if "stages" in data:
        from twin.program.stagefile import validate_stages
        validate_stages(programs, where=where)
        return programs
    validate_program(programs[0], where=where, progress=progress)
    return programs[0]


def _parse_ops(raw: list, key: str, where: str, progress, share: tuple[int, int]) -> list[Op]:
    """The ops of a file's list `raw` (at `key`), each checked against OP; `share` = (part, parts) of
    the file, for `progress` (the first half of the bar)."""
    ops, chunk = [], max(1, len(raw) // 50)
    for i, d in enumerate(raw):
        try:
            if not _op_ok(d):
                OP.check(d, f"{key}[{i}]")
        except Invalid as e:
            got = repr(e.value) if e.shown and e.value is not ... else ""
            raise InputError(f"{where}: {e.key} {e.rule}" + (f", got {got[:60]}" if got else "")) from None
        ops.append(Op(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}))
        if progress and i % chunk == 0:
            progress(0.5 * (share[0] + i / len(raw)) / share[1])
    return ops


_KEY_FIELDS = tuple(f.name for f in fields(Op) if f.name not in ("index", "deps"))


def _canonical_key(op: Op) -> tuple:
    """Everything of an op but its position and dependencies (attribute reads: asdict would copy
    every field deeply, which took most of the time on files of 10^5 ops and more)."""
    return tuple(getattr(op, name) for name in _KEY_FIELDS)


def _segment_rank(op: Op, micro_batches: int) -> int:
    if op.phase in ("grad", "opt"):
        return 2 * micro_batches + (op.phase == "opt")
    return 2 * op.micro_batch + (op.phase != "fwd")


def validate_program(program: Program, where: str = "program", progress: Callable[[float], None] | None = None) -> None:
    """Check a (possibly edited) program; see the module docstring. Raises InputError.
    progress: called now and then with the share of the work done (0.5..1: load_program did the first half)."""
    try:
        ref = build_program(program.model, program.grid, program.options, program.batch, program.seq_len)
    except InputError as e:
        raise InputError(f"{where}: {e}") from None
    if progress:
        progress(0.6)
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
        if op.stream not in STREAMS or (op.is_collective and op.stream != {"expert": "data", "edata": "data"}.get(op.axis, op.axis)):
            raise InputError(f"{where}: op {op.name} runs on stream {op.stream!r}: use compute or its axis")
        bad = [d for d in op.deps if not (isinstance(d, int) and 0 <= d < i)]
        if bad:
            raise InputError(f"{where}: op {op.name} depends on op {bad[0]}, which does not come before it "
                             "(dependencies must point to earlier ops)")
    if progress:
        progress(0.8)
    missing = [name for name in want if name not in seen]
    if missing:
        raise InputError(f"{where}: op {missing[0]} is missing ({len(missing)} ops missing): the step would not "
                         "compute every gradient")
    _check_order(program, where)
    check_dataflow(program, where)


def _check_order(program: Program, where: str) -> None:
    last = -1
    for op in program.ops:
        rank = _segment_rank(op, program.options.micro_batches)
        if rank < last:
            raise InputError(f"{where}: op {op.name} ({op.phase} of micro-batch {op.micro_batch}) comes after a later "
                             "pass: keep each pass's ops together, in pass order")
        last = rank
