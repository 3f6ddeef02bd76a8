"""How the ranks of a CPU node share its cores: the stretch of their compute ops.

With more ranks than cores, a rank's compute op takes longer than its on-CPU time: the scheduler
shares the node's `cores` among whatever is runnable at the instant, the computing ranks and the
communication library's threads moving the data of the collectives in flight. A rank blocked in a
collective sleeps and leaves its core to the others, so a grid whose ranks spend long waiting on
collectives sees less stretch on its compute than one whose collectives run beside its compute.

The model is the mean number of threads runnable beside a computing rank, shared among the cores as
a fluid (processor sharing, averaged over the iteration):

    stretch = max(1, (1 + (R - 1) x (c + load x comm)) / cores)

- R ranks share the node; c: the share of the iteration a rank's compute stream runs a kernel (its
  host time between ops left out); comm: the share during which it has a collective in flight;
- `load`: the share of a core a collective in flight keeps busy, fitted by `twin calibrate` from the
  recorded training steps of `backend bench`.

The shares come from the twin's own timeline, which itself depends on the stretch: the host model
solves the fixed point (twin.host.sharing). Where the ranks do not outnumber the cores the formula
says 1, yet other threads take their slices whatever the mean demand: there the floor is the stretch
bench measured with that many ranks (the profile's pooled `stretch`). What was measured to choose
this form, and where it misses, is in the CPU loop's dated record in docs/ (the page on fitting
profiles).
"""

from __future__ import annotations

from typing import Callable


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        elif b > a:
            out.append([a, b])
    return [(a, b) for a, b in out]


def busy_shares(spans, is_collective, host_s: float | Callable = 0.0) -> tuple[float, float]:
    """(c, comm), means over the ranks of `spans` ((rank, op, start s, duration s) with
    `is_collective(op)`): the share of a rank's iteration (its first start to its last end) during
    which its compute stream runs a kernel (each compute span less the host time before it: `host_s`
    seconds, or `host_s(op)` per op, as twin.host.order.host_times charges it), and during which it has
    a collective in flight."""
    host = host_s if callable(host_s) else (lambda _op: host_s)
    by_rank: dict[int, list[tuple]] = {}
    for s in spans:
        by_rank.setdefault(s[0], []).append(s)
    shares = []
    for mine in by_rank.values():
        begin = min(s[2] for s in mine)
        length = max(s[2] + s[3] for s in mine) - begin
        if length <= 0:
            continue
        comp = _union([(s[2] + min(host(s[1]), s[3]), s[2] + s[3]) for s in mine if not is_collective(s[1])])
        comm = _union([(s[2], s[2] + s[3]) for s in mine if is_collective(s[1])])
        shares.append((sum(b - a for a, b in comp) / length, sum(b - a for a, b in comm) / length))
    if not shares:
        return 0.0, 0.0
    import statistics  # here: 5 ms of imports (fractions, decimal) that GPU systems never need
    return statistics.fmean(c for c, _ in shares), statistics.fmean(m for _, m in shares)


def core_stretch(ranks: int, cores: int, load: float, c: float, comm: float, floor: float = 1.0) -> float:
    """How many times its on-CPU time a compute op takes while `ranks` ranks share `cores` cores, with
    the busy shares of busy_shares and a collective in flight keeping `load` of a core busy; at least
    `floor` (1, or where the ranks do not outnumber the cores the stretch measured: stretch_floor)."""
    return max(floor, (1.0 + (ranks - 1) * (c + load * comm)) / cores)


def stretch_floor(ranks: int, cores: int, measured: float) -> float:
    """The least stretch of a grid of `ranks` ranks on `cores` cores: where they do not outnumber the
    cores, the stretch measured with that many ranks (`measured`: bench's recorded steps), else 1."""
    return max(1.0, measured) if ranks <= cores else 1.0


def fixed_point(g: Callable[[float], float], x: float, rel: float = 1e-4, rounds: int = 20) -> float:
    """A fixed point of `g` (x = g(x)) from `x`: the x last evaluated once |g(x) - x| <= rel * x (so a
    caller's g may keep what it computed at x), else the next guess after `rounds` evaluations of g.
    After the first step each guess is where the secant of g(x) - x through the last two guesses
    meets 0, if that lies beyond the plain step y = g(x) by at most 3 times its length (g's slope
    between 0 and 2/3, as the stretch map's is: twin.host.sharing.shared_core_stretch); else the plain
    step. With the stretch map (slope 0.1-0.3 on the measured 4- and 8-rank CPU grids) that takes
    3-4 evaluations where plain steps took 4-6."""
    prev = None
    for _ in range(rounds):
        y = g(x)
        if abs(y - x) <= rel * x:
            return x
        guess = y
        if prev is not None:
            (x0, y0), step = prev, y - x
            slope = (y - y0) / (x - x0) if x != x0 else 1.0  # g's slope between the last two guesses
            if 0.0 < slope < 1.0:
                to_root = step / (1.0 - slope)  # from x to where the secant of g(x) - x meets 0
                if abs(step) <= abs(to_root) <= 3.0 * abs(step):
                    guess = x + to_root
        prev, x = (x, y), guess
    return x
