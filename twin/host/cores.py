"""How the ranks of a CPU node share its cores: the stretch of their compute ops.

With more ranks than cores, a rank's compute op takes longer than its on-CPU time: the scheduler
shares the node's `cores` among whatever is runnable at the instant, the computing ranks and gloo's
threads moving the data of the collectives in flight. A rank blocked in a collective sleeps and
leaves its core to the others, so a grid whose ranks spend long waiting on collectives sees less
stretch on its compute than one whose collectives run beside its compute (the z all-gathers that
are prefetched): on 8 ranks of 2 cores, each grid's own stretch (summed span over summed on-CPU time
of its compute ops) ranges 1.8-3.3 (cpu-2026-12-01c and -01d, 30 runs of 8 ranks).

The model is the mean number of threads runnable beside a computing rank, shared among the cores as
a fluid (processor sharing, averaged over the iteration):

    stretch = max(1, (1 + (R - 1) x (c + load x comm)) / cores)

- R ranks share the node; c: the share of the iteration a rank's compute stream runs a kernel (its
  host time between ops left out); comm: the share during which it has a collective in flight;
- `load`: the share of a core a collective in flight keeps busy (gloo's threads), fitted by
  calibration from the recorded training steps of `backend bench`.

The shares come from the twin's own timeline, which itself depends on the stretch: the twin solves
the fixed point (twin.predict.simulate). Checked against the runs' traces (their measured shares, cores 2):
the 52 runs of 4 and 8 ranks of cpu-2026-12-01c and -01d have their measured stretch reproduced
within 4 % (median), 15 % at worst, at load 0.40 (fitted to them); a stretch pooled per rank count
misses them by up to 30 %. Other forms fitted worse: a term for the rank's own collectives beside
its compute (4 %, 16 %), the collectives' time measured alone in place of their time in flight (a
collective's CPU work scaling with its transfer, not its span: 7 %, 28 %), their bytes (9 %, 36 %);
the ranks' host time between ops fitted no weight (it is mostly waiting for a wake-up).

Where the ranks do not outnumber the cores, the fluid demand stays under the cores and the formula
says 1; yet bench's recorded steps with 2 ranks on 2 cores ran at a stretch of 1.04 (cpu-2026-12-01e,
pooled; 1.01-1.06 per grid) and the runs of the 2-rank grids at 1.01-1.07: other threads (gloo's, the
interpreter's, the system's) take their slices whatever the mean demand. There the floor is the
stretch bench measured with that many ranks (the profile's pooled `stretch`): offline over the loops
01d, 01e and 01f (benchmarks/cpu_bias.py, each against the profile fitted from its own bench), the
2-rank grids' iteration error, mean over the three loops, moved from -7.5 to -4.3 % (1x1x1x2), -3.0
to -0.6 % (2x1x1x1) and -18.2 to -15.9 % (1x2x1x1), closer in each loop but one (2x1x1x1 in 01d,
+7.4 -> +10.2 %); no grid of 4 or 8 ranks moved.

Where it misses (benchmarks/cpu_stretch.py on a loop's committed runs): the form holds on each
rank's own traced shares (within 10 % of the measured stretch on every grid of 8 ranks), but the
twin's shares come from a lockstep timeline, every op at its mean over the ranks, and that timeline
overlaps compute with collectives more than the ranks, which drift apart under time-slicing, do.
Where z = 4 on 8 ranks the step then hardly lengthens when the compute does (it hides more of the z
all-gathers), the fixed point amplifies any error in its inputs about twofold, and the predicted
stretch ran 10-36 % over the measured one: the grids that miss the CPU loop's per-op target. Where
the profile has the spread of the ops' spans (bench records it since cpu-2026-12-02d), the shares are
the mean over spans drawn at it (twin.host.spread: a collective beside compute is exposed by more than its
mean span implies), which takes part of that excess (1x1x4x2: 1.28-1.31 -> 1.21-1.26 times the
measured stretch). What the lockstep timeline cannot carry either: the scheduler takes a rank's
core at its op boundaries more than inside its ops, and the more so the less the rank sleeps on its
collectives (with 8 ranks the host gaps hold 14-32 % of its CPU time and 34-65 % of its wait for a
core, benchmarks/cpu_sched_split.py), so that the ops' stretch is the fluid sharing less a grid's own
share moved to the gaps. The models tried beside this one, each with the figures that decided against it
(two loads, collectives stretched with the grid, one round of the map in place of its fixed point, a
time-sliced scheduler, ranks replayed apart, spans drawn at random at one spread for all), are in
the notebook, calibration/README.md ("How CPU ranks share their cores: what was tried").
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
    seconds, or `host_s(op)` per op, as twin.costs.kernels.host_times charges it), and during which it has
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
    between 0 and 2/3, as the stretch map's is: twin.predict.simulate.shared_core_stretch); else the plain
    step. With the stretch map (slope 0.1-0.3 on cpu-2026-12-02j's 4- and 8-rank grids) that takes
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
