"""What an executor whose host is its device does between ops: it runs them in program order.

On a CPU the rank that computes is also the host that issues the collectives, so (unlike a GPU's
host, which only queues kernels ahead of the device) it walks the program op by op: `host_ordered`
adds those waits to a program, and `host_times` charges the host's own time between ops (its
dispatch and bookkeeping, and the buffers it fills for each collective it issues) to the compute op
after it. A GPU study never calls these: its profile has no host part (`Profile.host is None`).
"""

from __future__ import annotations

from dataclasses import replace

from twin.program.ops import Op, Program, changed


def host_ordered(program: Program) -> Program:
    """The program as an executor whose host runs the compute ops runs it (CPU: the host is the
    device): the host walks the ops in program order, so a collective is issued only after the
    compute op before it finished, and a compute op starts only after the host waited for what the
    collectives issued before it depend on. Returns a copy with those waits added to `deps`."""
    ops, last, waited = [], None, set()
    for op in program.ops:
        if op.is_collective:
            waited.update(op.deps)
            deps = op.deps if last is None or last in op.deps else op.deps + (last,)
        else:
            deps = op.deps + tuple(sorted(waited - set(op.deps)))
            waited, last = set(), op.index
        ops.append(op if deps == op.deps else changed(op, deps=deps))
    return replace(program, ops=ops)


def charged_issues(ops: list[Op]) -> dict[int, list[Op]]:
    """Per compute op of a program (by index; ops in the order the host runs them), the collectives
    issued since the compute op before it that it does not wait for (not in its deps): the issues
    whose host time delays it (host_times). A compute op that waits for a collective starts after its
    completion anyway, the issue inside that wait."""
    out, issued = {}, []
    for op in ops:
        if op.is_collective:
            issued.append(op)
        else:
            out[op.index] = [c for c in issued if c.index not in op.deps]
            issued = []
    return out


def count_exchange(op: Op) -> bool:
    """Whether collective `op` is an MoE dispatch that exchanges its row counts before its rows: the
    all-to-all of a block's routed rows toward the experts in a pass that routes (forward, recompute;
    it reads the block's `.moe.send` buffer). The executor (backend/runtime/executor.py) runs a
    synchronous all-to-all of ints first, on the host, inside the dispatch's issue."""
    return op.kind == "all_to_all" and any(r.endswith(".moe.send") and not r.startswith("d:") for r in op.reads)


def host_times(ops: list[Op], op_s: float, issue_s: float, exchange_s: float = 0.0) -> list[float]:
    """Per op of a program (in the order the host runs them), the host time charged before it
    (seconds; 0 for a collective): for a compute op, `op_s` (HostSharing.op_s) plus `issue_s`
    (HostSharing.issue_s) for each of its charged_issues. On a CPU the host that issues a collective
    is the device that computes: it fills the collective's buffers (a zeroed output, a copy to
    reduce) and, on a busy node, the communication library's thread takes the issuing rank's core as
    it wakes to the transfer; the compute op after the issue starts that much later. Where
    `exchange_s` (HostSharing.exchange_s) is measured, each count_exchange issued since the compute
    op before costs that instead, waited for or not: the host exchanges the counts (a round trip over
    the expert group) before the rows' all-to-all starts, and the op waiting for the rows after it."""
    charged = charged_issues(ops)
    if exchange_s <= 0:
        return [0.0 if op.is_collective else op_s + issue_s * len(charged[op.index]) for op in ops]
    out, exchanges = [], 0
    for op in ops:
        if op.is_collective:
            exchanges += count_exchange(op)
            out.append(0.0)
            continue
        plain = sum(not count_exchange(c) for c in charged[op.index])
        out.append(op_s + issue_s * plain + exchange_s * exchanges)
        exchanges = 0
    return out
