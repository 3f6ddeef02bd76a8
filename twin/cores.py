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
the fixed point (twin.simulate). Checked against the runs' traces (their measured shares, cores 2):
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

Tried and not kept: a load of its own for a collective in flight beside its rank's compute (the
rest of `comm` being its rank waiting on it). Fitted on bench's steps, the two loads came out 0.44
and 0.25 (01d), 0.45 and 0.06 (01e): a waiting rank keeps the cores busier than a collective running
beside compute, and each grid's predicted stretch came closer to its runs' (1x1x4x1 1.99 -> 1.78
against 1.62 measured, 8x1x1x1 2.43 -> 2.59 against 2.67; means over the three loops). But the
iteration got worse in every loop (median |error| 7.0 -> 7.3, 6.3 -> 7.6, 9.3 -> 9.5 %; Spearman
0.967 -> 0.965, 0.959 -> 0.956, 0.969 -> 0.962): the z-split grids' long-predicted stretch was
hiding their long-predicted z collectives, which is the error to fix first.

Where the model misses now (benchmarks/cpu_stretch.py, on the runs of the loops cpu-2026-12-01l and
-01m against each loop's profile): the formula holds on each rank's own shares (the traced steps' busy
shares give the measured stretch within 10 % on every 8-rank grid of both loops), but the twin's
shares come from a lockstep timeline, every op at its mean over the ranks, and that timeline
overlaps compute with collectives more than the ranks do where z is split: on 1x1x4x2 the replay of
the run's own mean ops gives c 0.55, comm 0.77 against 0.46 and 0.65 in the trace (01m), and so a
stretch of 3.58 against 3.06 measured, the twin 3.82. Tried again on both loops' runs (refitted from
each loop's bench, validated offline; none kept, each traded the iteration target for the per-op one):
- the two loads above (0.56 waiting / 0.11 beside in 01l, 0.51 / 0.17 in 01m): per-op 31 and 31
  grids within 20 % (from 31 and 28; worst 27 %, from 40 and 35 %), iteration 34 and 33 within 15 %
  (from 35 and 35; 01m: 1x1x4x1 -17 %, 1x1x2x2 -15 %): at the right stretch the z-split grids'
  lockstep step is short;
- with them, the host time of issuing a collective (host_issue_s) fitted at 4 and 8 ranks too (1.17
  and 1.44 ms; 1.08 and 1.52 ms) and taken out of the busy shares: per-op 31 and 32 within 20 % (worst
  23 and 24 %), iteration 32 and 30 within 15 % (01l: 1x4x2x1 +20 %, 1x4x1x1 +19 %; 01m: 1x2x2x2 and
  2x2x2x1 +20 %);
- issue time charged only where the next op does not wait for the collective (a blocking
  collective's span already holds its issue): the fit, which matches bench's gaps between compute
  ops, ran to 4-5 ms per issue with 4 and 8 ranks and the iteration to 13 and 12 within 15 %;
- a bench grid with z = 4 on 8 ranks (none of the 8-rank bench grids has one: their z lines fall back
  to the ones measured alone), each of 1x2x4x1, 2x1x4x1 and 1x1x4x2 benched (2026-12-02) and added
  to 01m's files in turn: the grid's own z collectives came right (1x2x4x1 all-gather -22 -> +1 %,
  reduce-scatter -27 -> -7 %), its predicted stretch stayed as high (3.68, 3.42 and 3.73 against
  2.99, 2.79 and 3.06), per-op 28-29 grids within 20 % (from 28), iteration 35 within 15 % as before.
  In loop cpu-2026-12-02a, which benched 1x1x4x2 itself, its stretch came out 3.55 against 2.58.
Why lockstep misses, and what did not replace it (prototypes on 01m's runs, 2026-12-02, not kept):
- each rank replayed with its own measured spans (the engine in full mode, collectives from their last
  member's arrival) takes 0.87-0.96 of the traced step on 10 grids of 8 ranks, every rank at the ops'
  means 0.72-0.87: the ranks drift apart and wait for each other, which a lockstep timeline cannot
  show. Independent noise drawn from those spans overshoots (0.93-1.14): time-slicing is zero-sum,
  what a descheduled rank loses the others gain;
- a time-sliced scheduler in place of the fluid (each rank's thread and a gloo thread per rank in
  round-robin slices of 3 ms on 2 cores, fed the runs' own on-CPU times and collective spans) missed
  the measured stretch by a median of 17 % (worst 72 %) and the step by 10 % (worst 36 %) over the 30
  grids of 4 and 8 ranks: the fluid formula on lockstep shares does better.
What the lockstep timeline lacks (benchmarks/cpu_lockstep_gap.py, on 02a's runs, whose traces carry
each collective's issue time): the host's time issuing a collective (0.24-1.42 ms per collective
with 4 and 8 ranks), which delays the compute op after it, and the spread of the spans under
time-slicing (coefficient of variation 0.2-0.3 with 4 ranks, 0.5-0.7 with 8), which exposes more of
a collective overlapped with compute than its mean span does. The lockstep replay of the runs' own
mean spans with both takes 0.92-1.02 of the traced step on the 30 grids of 4 and 8 ranks (0.83-0.99
without), and its shares on the z = 4 grids come within 0.04 of the traced ones. Built into the
twin and validated offline (2026-12-02):
- kept: the issue time, measured by bench since cpu-2026-12-02b (0.57, 0.69 and 0.73 ms per
  collective the next compute op does not wait for, with 2, 4 and 8 ranks), charged to the compute
  op after such an issue (twin.kernels.host_times) and left out of the compute share: 02b's runs
  went from 7.1 to 5.7 % iteration median, 32 -> 33 grids within 15 %, per-op 31 -> 33 within 20 %
  (worst 27 -> 25 %); the older loops, whose bench did not record it, keep a fitted one with 2 ranks;
- not kept: the spans drawn as well (8 seeded draws at the runs' spread per rank count), on 01l, 01m
  and 02a with 02a's issue times for all three, against the twin with neither: per-op within 20 %
  32 -> 33, 31 -> 32, 28 -> 29 grids, worst 33 -> 27, 30 -> 24, 47 -> 40 %; iteration within 15 %
  35 -> 34, 35 -> 34, 26 -> 29. The grids with z = 4 keep a predicted stretch 11-33 % over the
  measured one: their GEMMs' on-CPU times, from bench, come out 2-19 % over the runs' (median over a
  grid's GEMMs; bench and runs minutes apart), and the fixed point amplifies that.
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
    seconds, or `host_s(op)` per op, as twin.kernels.host_times charges it), and during which it has
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
