"""The CPU loop's iteration model: collectives inside training per axis, and the committed quiet loops
(calibration/measurements/cpu-2026-12-01b and -01c: bench files and the 35 gpt-small runs' report)
reproduced offline by the profile fitted from their bench files."""

import functools
import glob
import json
import statistics
from pathlib import Path

import pytest

from calibration.fit import fit_profile
from calibration.lines import collective_line, excess_line
from calibration.validate_summary import spearman
from twin.costs.profile_types import CollectivePoint, CollectiveTable

LOOPS = Path(__file__).resolve().parent.parent / "calibration" / "measurements"


def test_collective_line_keeps_the_summed_span_of_a_burst():
    """Data-axis all-reduces leave in one burst at the end of a step: a span starts when the previous
    one ends, so some are near 0. The line must give back their sum, not be pulled to 0 by them."""
    nbytes = [1 << 20, 1 << 20, 1 << 18, 1 << 20, 1 << 18, 1 << 20]
    spans = [3e-3, 3e-5, 1e-3, 8e-3, 2e-5, 2e-3]
    a, b, _ = collective_line(nbytes, spans)
    assert sum(a + b * x for x in nbytes) == pytest.approx(sum(spans), rel=1e-6)
    assert a >= 0 and b >= 0


def test_a_training_line_keeps_the_bandwidth_measured_alone_and_the_summed_span():
    """Inside training a collective costs its line measured alone plus an excess per op (the wait for
    the last member, wake-ups among busy cores): the slope is the microbenchmark's, not one fitted to
    a few noisy spans of nearly one size (which came out at 7 MB/s or infinite), and the sum is kept."""
    alone = CollectivePoint("reduce_scatter", 2, 8, 8e-4, 3e8, 1)
    nbytes = [2.6e5, 5.2e5, 5.2e5, 1.0e6]
    spans = [9e-3, 4e-3, 8e-3, 1.2e-2]   # noisy: the free line's slope is not the transfer's
    a, b, res = excess_line(nbytes, spans, alone)
    assert b == pytest.approx(1 / 3e8)
    assert sum(a + b * x for x in nbytes) == pytest.approx(sum(spans), rel=1e-9)
    assert a > alone.latency_s and len(res) == 4
    a, b, _ = excess_line([1e6], [1e-4], alone)  # faster than alone: no negative latency
    assert a == pytest.approx(1e-9) and b == pytest.approx(1 / 3e8)


def test_training_lines_are_looked_up_by_axis_first():
    """An axis' own line; else another tensor axis' line; a data-axis line for the data axis only
    (and a tensor line never for it); else the line measured alone x slowdown."""
    x = CollectivePoint("all_reduce", 2, 2, 1e-3, 1e9, 1, "x")
    data = CollectivePoint("all_reduce", 2, 2, 5e-3, 1e9, 1, "data")
    alone = CollectivePoint("all_gather", 2, 2, 1e-4, 1e9, 1)
    t = CollectiveTable((alone,), 4, (x, data), slowdown=2.0)
    assert t.time("all_reduce", "x", 2, 0.5e6) == pytest.approx(1e-3 + 1e-3)   # 2-byte program count, fp32
    assert t.time("all_reduce", "y", 2, 0.5e6) == pytest.approx(1e-3 + 1e-3)   # the other tensor axis' line
    assert t.time("all_reduce", "data", 2, 1e6) == pytest.approx(5e-3 + 1e-3)  # data bytes are real bytes
    assert t.time("all_gather", "z", 2, 0.5e6) == pytest.approx(2.0 * (1e-4 + 1e-3))
    assert t.time("reduce_scatter", "z", 2, 1e6) is None
    alone_ar = CollectivePoint("all_reduce", 2, 2, 2e-4, 1e9, 1)
    t = CollectiveTable((alone_ar,), 4, (x,), slowdown=2.0)  # no data line: alone x slowdown, not x's
    assert t.time("all_reduce", "data", 2, 1e6) == pytest.approx(2.0 * (2e-4 + 1e-3))


@functools.lru_cache(maxsize=None)
def _fitted(loop: str) -> str:
    """The profile (TOML) fitted from a committed loop's bench files."""
    return fit_profile(sorted(glob.glob(str(LOOPS / loop / "bench-*.json"))), "cpu").toml


# (loop, median |error| under, at least this many of 35 within 15 %, worst under, Spearman at least)
BOUNDS = [("cpu-2026-12-01b", 0.09, 25, 1.0, 0.92), ("cpu-2026-12-01c", 0.085, 24, 0.36, 0.94),
          ("cpu-2026-12-01d", 0.075, 29, 0.40, 0.95), ("cpu-2026-12-01e", 0.07, 28, 0.24, 0.94),
          ("cpu-2026-12-01g", 0.07, 35, 0.15, 0.96), ("cpu-2026-12-01j", 0.115, 31, 0.24, 0.96),
          ("cpu-2026-12-01k", 0.095, 31, 0.19, 0.96), ("cpu-2026-12-01l", 0.065, 35, 0.15, 0.96),
          ("cpu-2026-12-01m", 0.045, 35, 0.14, 0.96), ("cpu-2026-12-02a", 0.085, 25, 0.24, 0.91),
          ("cpu-2026-12-02b", 0.065, 32, 0.18, 0.94), ("cpu-2026-12-02c", 0.035, 35, 0.155, 0.96),
          ("cpu-2026-12-02d", 0.045, 34, 0.19, 0.95), ("cpu-2026-12-02e", 0.045, 35, 0.15, 0.96),
          ("cpu-2026-12-02f", 0.055, 35, 0.125, 0.96), ("cpu-2026-12-02g", 0.04, 34, 0.175, 0.96),
          ("cpu-2026-12-02h", 0.035, 35, 0.15, 0.96), ("cpu-2026-12-02i", 0.035, 35, 0.11, 0.97),
          ("cpu-2026-12-02j", 0.05, 35, 0.155, 0.97), ("cpu-2026-12-03a", 0.065, 33, 0.19, 0.95),
          ("cpu-2026-12-03b", 0.15, 18, 0.57, 0.90)]

# The loops the default run reproduces, one per change in what bench records (each exercises the fit's
# handling of the files of its time): 01b the oldest files (no wake_s, free_mean_s), 01d the first
# on-CPU times, 01g the first repeated runs, 01l the first timed steps (step_s), 02b the first issue
# times, 02d the first spans' spread, 02j the Intel VM, 03a the newest. The others (8-13 s each on 2
# cores, most of it the fit's drawn replays) carry the marker `loops`: `python -m pytest -m loops`.
DEFAULT_LOOPS = {"cpu-2026-12-01b", "cpu-2026-12-01d", "cpu-2026-12-01g", "cpu-2026-12-01l",
                 "cpu-2026-12-02b", "cpu-2026-12-02d", "cpu-2026-12-02j", "cpu-2026-12-03a"}
CASES = [pytest.param(*b, id=b[0], marks=() if b[0] in DEFAULT_LOOPS else pytest.mark.loops) for b in BOUNDS]


@pytest.mark.parametrize("loop,median,within,worst,rank", CASES)
def test_the_committed_cpu_loop_is_reproduced_offline(loop, median, within, worst, rank):
    """The profile fitted from a quiet loop's bench files, against its 35 measured gpt-small runs.

    Bounds, from what limits them: the same grid's ops inside `backend bench`'s recorded steps and
    inside its validation run, minutes apart on the same machine, differ by 0.57x-1.33x in summed
    GEMM time (run over bench: 2x1x1x1 1.33x, 1x1x2x1 1.24x, 8x1x1x1 0.65x, 1x1x8x1 0.57x; printed by
    benchmarks/cpu_iteration.py from the runs' traces), so no model fitted to the bench holds every
    grid within 15 % of one run. Measured with this fit: median |error| 7.6 %, 26 of 35 within
    15 %, Spearman 0.939 (before the split norms' own cost line: 8.3 %, 25, 0.938; before per-axis
    lines: 16.2 %, 16, 0.834); asserted with a margin for a refit's rounding: median under 9 %, at
    least 25 within 15 %, Spearman at least 0.92.
    (These bench files predate bench's wake_s and free_mean_s: the fit falls back to the median
    gap and spans alone, as it does for any older file.) With a collective inside training as its
    line measured alone plus a per-op excess: 7.7 %, 26, 0.926.

    cpu-2026-12-01c: the twin reproduces each benched grid's own
    recorded steps (replayed through the engine at their measured spans) within 9 %, while those
    steps and the grid's run differ by 0.79x-1.18x (1x1x1x1 0.79x, 1x1x8x1 0.81x, 8x1x1x1 0.81x,
    2x1x1x1 1.18x; `python benchmarks/cpu_iteration.py RUNS --bench DIR` prints both). Measured: 7.8 %,
    25 within 15 %, worst 33.5 % (1x8x1x1), Spearman 0.956 (free per-axis training lines: 7.9 %, 25,
    38.8 % on 1x1x2x4, 0.935); asserted: median under 8.5 %, at least 24, worst under 36 %, Spearman
    at least 0.94.

    cpu-2026-12-01d (the first loop whose bench recorded each compute
    op's on-CPU time and warmed up 2 steps; quiet, load 0.72 at the start): measured 9.1 %, 31 within
    15 %, worst 25 % (1x4x1x1), Spearman 0.96. With a role recorded at one size per rank count taking
    the on-CPU line pooled over the rank counts (calibration.training.pooled_cpu_lines; the whole-feature
    norms of the y-split grids): 7.6 %, 32 within 15 %, worst 21 % (1x4x1x1), Spearman 0.96. With each
    grid's own stretch (twin.host.cores, fitted from the bench steps' stretch: collective_core_load 0.40):
    7.0 %, 30 within 15 %, worst 21 % (2x2x1x2; 1x1x4x1 20 %, whose bench steps ran 1.6x the on-CPU
    time of its run), Spearman 0.968. With overlap_slowdown measured shape against shape
    (calibration.training.same_shape_slowdown): 6.6 %, 30 within 15 %, Spearman 0.966, but worst
    38.9 % (1x1x4x1; 1x1x2x2 31.5 %): this loop's bench steps are the one set in which a GEMM with a
    collective beside it took more on-CPU time than one of its shape alone (1.28x with 2 ranks, 1.56x
    with 4; 0.97-1.02 in every later loop, which recorded an op's mean over the steps, not the upper
    median of 4), and its runs did not (that 1.6x above); asserted: median under 7.5 %, at least 29,
    worst under 40 %, Spearman at least 0.95.

    cpu-2026-12-01e (the committed profile's files; the first loop whose bench costs an op in training
    as its mean over the recorded steps, taken with each grid's own stretch in the twin; quiet, load 0.9
    at the start): measured 6.9 %, 29 within 15 %, worst 22 % (1x1x2x4), Spearman 0.96. With the stretch
    bench measured as the floor where the ranks do not outnumber the cores (twin.host.cores.stretch_floor):
    6.3 %, 29, worst 22 %, Spearman 0.959 (benchmarks/cpu_bias.py); asserted: median under 7 %, at
    least 28, worst under 24 %, Spearman at least 0.94.

    cpu-2026-12-01g (the committed profile's files; the first loop that ran every grid 3 times in
    interleaved passes and compares the twin with the median of the three, since one run carries
    +-15 % per-process noise; quiet, load 0.7 at the start, 1,488 s): measured 6.2 %, 35 within 15 %,
    worst 13.3 % (4x1x1x1 -12 %, 2x1x2x2 -13 %, 4x2x1x1 +13 %), Spearman 0.978; asserted: median under
    7 %, all 35 within 15 %, worst under 15 %, Spearman at least 0.96.

    With the host time per collective issued where the ranks do not outnumber the cores
    (host_issue_s, calibration.sharing.issue_cost; only the 2-rank grids move): 01b 7.7 %, 27, 28.5 %,
    0.927; 01c 7.8 %, 26, 33.5 %, 0.958; 01d 6.8 %, 30, 20.9 %, 0.966; 01e 5.9 %, 29, 21.8 %, 0.960;
    01g 6.2 %, 35, 13.3 %, 0.978 (its worst grids have 8 ranks; 1x1x2x1 -7.0 -> +0.2 %); the bounds
    above hold them unchanged.

    cpu-2026-12-01j (the first loop with two bench passes among four run passes, R1 B1 R2 R3 B2 R4,
    the profile fitted from both; quiet, load 0.7 at the start, 2,227 s): measured 10.2 %, 32 within
    15 %, worst 22 % (2x1x4x1), Spearman 0.98; every grid but 1x1x1x2 predicted short (mean -9.4 %):
    the runs took 1.10x (median over the 13 benched grids, 0.95-1.23x) the iteration their grid's
    recorded bench steps imply, while the twin reproduced those steps at 0.90-1.08x. With the issue
    time charged only where the next compute op does not wait (twin.costs.kernels.host_times, 2026-12-02;
    these files fit it at 2 ranks): 10.98 %, 32, 22 %, 0.978; asserted: median under 11.5 %, at least
    31 within 15 %, worst under 24 %, Spearman at least 0.96.

    cpu-2026-12-01k (six run passes, two bench passes, R1 B1 R2 R3 R4 B2 R5 R6; quiet, load 0.6 at the
    start, 3,056 s): measured 8.6 %, 32 within 15 % (1x1x4x1 -16.7 %, 1x1x2x4 -16.9 %, 2x1x4x1
    -16.4 %), worst 17 %, Spearman 0.98, mean -8.5 %: again the runs took 1.10x (0.98-1.27x) the
    iteration of their grid's recorded bench steps, which the twin reproduced at 1.005x (0.94-1.14x);
    asserted: median under 9.5 %, at least 31 within 15 %, worst under 19 %, Spearman at least 0.96.

    cpu-2026-12-01l (R1 B1 R2 R3 B2 R4 as 01j; the first loop whose bench timed each recorded step
    whole, step_s; quiet, load 0.4 at the start, 2,169 s): measured 5.8 %, 35 within 15 %, worst
    13.5 % (1x4x1x1 +13.5 %, 2x1x1x1 -12.1 %), Spearman 0.971, mean -3.5 %. The runs took 1.02x
    (median, 0.70-1.17) the steps bench timed; those steps took 1.00-1.19x their replay, the same
    share in both passes (2x2x2x1 1.19/1.18, 1x1x4x1 1.15/1.14). host_issue_s fitted to the timed
    steps for every rank count instead of to the gaps: 8.1 %, 30 within 15 %, worst 26 % (1x4x2x1),
    not adopted; asserted: median under 6.5 %, all 35 within 15 %, worst under 15 %, Spearman at
    least 0.96.

    cpu-2026-12-01m (as 01l, the next 34 minutes; load 0.4 at the start, 2,049 s): measured 3.6 %,
    35 within 15 %, worst 12.6 % (1x1x2x2 -12.6 %, 1x1x4x1 -12.2 %), Spearman 0.974, mean -0.8 %;
    timed steps over their replay within 0.03 of 01l's on every benched grid; asserted: median
    under 4.5 %, all 35 within 15 %, worst under 14 %, Spearman at least 0.96.

    cpu-2026-12-02a (as 01l with 1x1x2x2 and 1x1x4x2 benched too, 15 grids; the first loop whose
    traces carry each collective's issue_us; quiet, load 0.8 at the start, 1,907 s): measured 8.0 %,
    26 within 15 %, worst 22 % (1x1x2x2 and 2x1x2x1 -22 %: every 4-rank grid ran 13-22 % slower than
    predicted), Spearman 0.92; the spread of a grid's runs had median 26 % (16 % in 01m); asserted:
    median under 8.5 %, at least 25 within 15 %, worst under 24 %, Spearman at least 0.91.

    cpu-2026-12-02b (as 01l, at commit 65e9614: overlap_slowdown measured shape against shape, and
    the first bench that records each collective's issue time; quiet, load 0.5 at the start, 1,828 s):
    measured 7.1 %, 32 within 15 %, worst 16.6 % (1x1x4x2 -17 %; 2x1x4x1 and 4x1x1x2 -16 %),
    Spearman 0.96. With the issue time its bench measured (host_issue_s, calibration.sharing.
    issue_measured; charged to the compute op after an issue it does not wait for): 5.7 %, 33 within
    15 %, worst 17.0 % (1x4x2x1 +17 %, 4x1x1x2 -16 %; 1x1x4x2 from -17 to -3 %), Spearman 0.953;
    asserted: median under 6.5 %, at least 32 within 15 %, worst under 18 %, Spearman at least 0.94.

    cpu-2026-12-02c (as 01l, at commit 94b8c8a, today's model: its bench measured the issue times, 0.44,
    0.71 and 0.75 ms with 2, 4 and 8 ranks; quiet, load 0.2 at the start, 1,762 s): measured 2.7 %, all
    35 within 15 %, worst 14.2 % (1x1x2x1), Spearman 0.978; asserted: median under 3.5 %, all 35
    within 15 %, worst under 15.5 %, Spearman at least 0.96.

    cpu-2026-12-02d (as 02c, at commit 786e958, the same model; its bench also records each span's
    spread; load 1.1 at the start, 1,625 s): measured 3.9 %, 34 within 15 %, worst 15.1 % (1x4x2x1),
    Spearman 0.969; asserted: median under 4.5 %, at least 34 within 15 %, worst under 16 %, Spearman
    at least 0.95.

    cpu-2026-12-02e (as 02d, at commit 85cfbd7, the same model; from a clean clone on a fresh VM,
    load 0.3 before its install; 1,971 s, bench 405 s; repeats' spread median 29 %): measured 3.7 %,
    all 35 within 15 %, worst 14.0 % (4x1x1x2), Spearman 0.982; asserted: median under 4.5 %, all 35
    within 15 %, worst under 15 %, Spearman at least 0.96.

    cpu-2026-12-02f (as 02e, at commit 84b6352, the same model; its bench also records the host's gaps
    beside a collective in flight; 1,830 s, bench 400 s; repeats' spread median 12 %): measured 4.7 %,
    all 35 within 15 %, worst 10.8 % (1x2x2x1), Spearman 0.980; asserted: median under 5.5 %, all 35
    within 15 %, worst under 12 %, Spearman at least 0.96.

    cpu-2026-12-02g (as 02f, at commit 74efa05, the same model, from a clean clone; its bench also
    records the host's gaps per kind of collective in flight; 1,839 s, bench 386 s; repeats' spread
    median 18 %): measured 4.05 %, all 35 within 15 %, worst 14.7 % (1x4x2x1), Spearman 0.980;
    asserted: median under 4.5 %, all 35 within 15 %, worst under 15 %, Spearman at least 0.96.

    With spans drawn at the spread bench measured (twin.host.spread; the four loops above whose bench
    records it, 2026-12-02): 02d 3.9 %, 34 within 15 %, worst 18.2 % (1x4x2x1), Spearman 0.967; 02e
    3.4 %, 35, 13.5 % (4x1x1x2), 0.979; 02f 4.9 %, 35, 11.9 % (1x2x2x1), 0.978; 02g 3.5 %, 34, 16.8 %
    (1x4x2x1 +14.7 -> +16.8 %), 0.981. Asserted: 02d worst under 19 %, 02f worst under 12.5 %, 02g
    median under 4 %, at least 34 within 15 %, worst under 17.5 %; the rest as before.

    cpu-2026-12-02h (as 02g, at commit 462fccb: the first loop run with the spans drawn at their
    spread, from a clean clone; load 0.8 at the start, 1,887 s, bench 394 s; repeats' spread median
    16 %): measured 2.8 %, all 35 within 15 %, worst 13.8 % (1x4x2x1), Spearman 0.978 (the model
    before it, on the same files: 3.3 %, 35, 11.5 %, 0.98); asserted: median under 3.5 %, all 35
    within 15 %, worst under 15 %, Spearman at least 0.96.

    cpu-2026-12-02i (as 02h, at commit 877ee97, which benches 1x4x2x1 too, 14 grids; from a clean
    clone, 1,949 s, bench 434 s; repeats' spread median 6 %): measured 2.9 %, all 35 within 15 %,
    worst 9.7 % (1x1x4x1), Spearman 0.989; asserted: median under 3.5 %, all 35 within 15 %, worst
    under 11 %, Spearman at least 0.97.

    cpu-2026-12-02j (as 02i, at commit 85c0b8f, the same model; from a clean clone on another 2-core
    VM, an Intel Xeon, where 01l-02i ran on AMD EPYC: 1x1x1x1 ran 0.52 s against 0.43 s in 02i; load
    1.2 at the start, 2,497 s, bench 524 s; repeats' spread median 21 %): measured 4.0 %, all 35
    within 15 %, worst 14.9 % (1x1x4x2 and 1x2x4x1), Spearman 0.980; asserted: median under 4.5 %, all 35 within 15 %, worst under 15.5 %,
    Spearman at least 0.97.

    With overlap_slowdown paired within each bench file (calibration.training.same_shape_slowdown,
    2026-12-03; 02j's 8 ranks 1.18 -> 1.02): 02j 4.5 %, all 35 within 15 %, worst 11 % (2x1x1x4),
    Spearman 0.987 (median bound 4.5 -> 5 %); 01d 6.6 %, 29 -> 32 within 15 %, worst 39 -> 21 %; 01k
    8.0 -> 8.5 %, 35 -> 32, worst 14 -> 17 % (1x1x4x1); the other loops within their bounds as before.

    cpu-2026-12-03a (at commit fd9cc1b, the first loop run with that pairing; from a clean clone on
    the Intel Xeon VM, slower than in 02j: 1x1x1x1 0.68 s against 0.52 s; load 0.6 at the start,
    2,843 s, bench 562 s; repeats' spread median 33 %, worst 117 %): measured 5.6 %, 33 within 15 %,
    worst 18 % (1x1x1x2, its repeats' spread 49 %; 2x1x1x2 -16 %), Spearman 0.967; asserted: median
    under 6.5 %, at least 33 within 15 %, worst under 19 %, Spearman at least 0.95.

    cpu-2026-12-03b (at commit e20f518, the same model as 03a; from a clean clone on the Intel Xeon
    VM, load 0.7 at the start, 2,868 s, bench 638 s): the noisiest loop yet, runs' noise 0.235 per run
    (log sd; 03a 0.139), its odd runs against its even runs within 15 % on 18 of 35 grids, its two bench
    passes 0.339 apart per pass (03a 0.123; 2x2x2x1's bench 60 s then 40 s). Measured: 14.3 %, 18
    within 15 %, worst 55 % (4x2x1x1 +34 %: every 8-rank x-split grid predicted long, its first bench
    pass ran in a slow stretch), Spearman 0.917; the shipped profile (03a's fit, benched four hours
    earlier) on the same runs: 5.9 %, 30 within 15 %, per-op 35 within 20 %, Spearman 0.95.
    Asserted: median under 15 %, at least 18 within 15 %, worst under 57 %, Spearman at least 0.90."""
    from twin.program.grid import Grid
    from twin.program.model import load_model
    from twin.program.program import Options
    from twin.predict.simulate import simulate_grid
    from twin.predict.study import prepare
    import tempfile
    report = json.loads((LOOPS / loop / "report.json").read_text())
    with tempfile.TemporaryDirectory() as d:
        prof = Path(d) / "cpu.toml"
        prof.write_text(_fitted(loop))
        pred, meas = [], []
        for run in report["runs"]:
            spec = load_model(run["model"])
            grid = Grid.parse(run["grid"])
            options = Options(**{k: v for k, v in run["options"].items() if k in Options.__dataclass_fields__})
            study = prepare("cpu", spec, grid.size, run["batch"], spec.seq_len, options, profile=str(prof),
                            gemm_tuning=False)
            pred.append(simulate_grid(study, grid).iteration_time_s)
            meas.append(run["iteration"]["measured_s"])
    errs = [abs(p / m - 1) for p, m in zip(pred, meas)]
    assert len(errs) == 35
    assert statistics.median(errs) < median, statistics.median(errs)
    assert sum(e <= 0.15 for e in errs) >= within, sorted(errs)
    assert max(errs) < worst, max(errs)
    assert spearman(pred, meas) >= rank, spearman(pred, meas)


def test_the_stretch_model_holds_on_each_ranks_shares_not_on_the_lockstep_ones(tmp_path):
    """benchmarks/cpu_stretch.py on the committed runs of cpu-2026-12-01m (runs.tar.xz), four 8-rank
    grids, four runs each, against the profile fitted from that loop's bench files.

    Measured (medians over the runs): twin.host.cores' formula on each rank's own busy shares of the
    traced step gives 3.12, 2.97, 2.51, 2.22 against the measured stretch 3.06, 2.79, 2.60, 2.23
    (1x1x4x2, 2x1x4x1, 4x2x1x1, 1x8x1x1: within 7 %); on the shares of the same ops at their mean
    over the ranks in lockstep, 3.58 and 3.30 on the two grids with z = 4 (+17 %, +18 %), 2.57 and
    2.31 on the others (-1 %, +4 %). Asserted: the first within 10 % on all four, the second more
    than 12 % over on the z = 4 grids and within 6 % on the others."""
    import sys
    import tarfile
    sys.path.insert(0, str(LOOPS.parent.parent / "benchmarks"))
    from cpu_stretch import one_run
    grids = {"1x1x4x2": True, "2x1x4x1": True, "4x2x1x1": False, "1x8x1x1": False}  # grid: z = 4
    with tarfile.open(LOOPS / "cpu-2026-12-01m" / "runs.tar.xz") as tar:
        members = [m for m in tar.getmembers() if m.name.split("/")[1:2] and m.name.split("/")[1] in grids]
        tar.extractall(tmp_path, members=members, filter="data")
    prof = tmp_path / "cpu.toml"
    prof.write_text(_fitted("cpu-2026-12-01m"))
    for grid, z4 in grids.items():
        rows = [one_run(d, str(prof), twin=False) for d in sorted((tmp_path / "runs" / grid).glob("r*"))]
        assert len(rows) == 4
        measured, real, replay = (statistics.median(r[k] for r in rows) for k in ("measured", "real", "replay"))
        assert abs(real / measured - 1) <= 0.10, (grid, real, measured)
        if z4:
            assert replay / measured - 1 > 0.12, (grid, replay, measured)
        else:
            assert abs(replay / measured - 1) <= 0.06, (grid, replay, measured)


def test_issue_times_and_varying_spans_close_the_lockstep_gap(tmp_path):
    """benchmarks/cpu_lockstep_gap.py on the committed runs of cpu-2026-12-02a (their traces carry
    each collective's issue_us), a grid with z = 4 and one without, four runs each, against the
    profile fitted from that loop's bench files.

    Measured (medians over the runs, 8 draws): the lockstep replay of each op at its mean span takes
    0.83 (1x1x4x2) and 0.97 (8x1x1x1) of the traced step; with each collective's issue time 0.86 and
    0.97; with the spans drawn at the run's own spread too, 0.94 and 0.98. The compute share of
    1x1x4x2 goes 0.44 -> 0.40 against 0.36 traced. Asserted: on 1x1x4x2 the plain replay short by
    more than 10 % and the noisy one within 8 %, its compute share closer to the traced one; on
    8x1x1x1 all three within 5 % of each other."""
    import sys
    import tarfile
    sys.path.insert(0, str(LOOPS.parent.parent / "benchmarks"))
    from cpu_lockstep_gap import one_run
    grids = ("1x1x4x2", "8x1x1x1")
    with tarfile.open(LOOPS / "cpu-2026-12-02a" / "runs.tar.xz") as tar:
        members = [m for m in tar.getmembers() if m.name.split("/")[1:2] and m.name.split("/")[1] in grids]
        tar.extractall(tmp_path, members=members, filter="data")
    from twin.costs.profile import load_profile
    prof = tmp_path / "cpu.toml"
    prof.write_text(_fitted("cpu-2026-12-02a"))
    host_s = load_profile(str(prof)).for_ranks(8).host_op_s
    for grid in grids:
        rows = [one_run(d, host_s, 8) for d in sorted((tmp_path / "runs" / grid).glob("r*"))]
        assert len(rows) == 4 and all(r["issue_ms"] > 0 for r in rows)
        plain, issued, noisy = (statistics.median(r["step"][k] for r in rows) for k in range(3))
        traced_c, plain_c, noisy_c = (statistics.median(r["shares"][k][0] for r in rows) for k in (0, 1, 3))
        if grid == "1x1x4x2":
            assert plain < 0.90 and abs(noisy - 1) < 0.08 and plain < issued < noisy, (plain, issued, noisy)
            assert abs(noisy_c - traced_c) < abs(plain_c - traced_c), (traced_c, plain_c, noisy_c)
        else:
            assert max(plain, issued, noisy) - min(plain, issued, noisy) < 0.05, (plain, issued, noisy)


def test_wake_up_and_mean_host_gap_are_fitted(tmp_path):
    """bench's wake_s (a collective's completion to the start of the op that waited for it) adds to
    the collective's in-training line, less the host time the twin charges that op; host_op_s is the
    mean gap (free_mean_s), and axis_slowdown the axis' summed time inside training over alone."""
    import copy
    from test_calibration import MEASUREMENT, write
    from twin.costs.profile import load_profile
    data = copy.deepcopy(MEASUREMENT)
    data["ops"].append({"op": "host", "numel": 0, "bytes": 0, "model": "gpt-tiny", "ops": 90,
                        "seconds": 2e-4, "mean_s": 9e-4, "free_mean_s": 3e-4})
    base = {"role": "", "stream": "x", "axis": "x", "flops": 0.0, "covered": 0.0, "kind": "all_reduce"}
    sizes = (1 << 12, 1 << 18, 1 << 20)  # program bytes (2 per element): 2x on the wire in fp32
    data["steps"] = [{**base, "name": f"ar{i}", "bytes": b, "seconds": 1e-3 + 2 * b / 1e9, "wake_s": 8e-4}
                     for i, b in enumerate(sizes)]
    path = tmp_path / "wake.toml"
    path.write_text(fit_profile([write(tmp_path, data, "wake.json")], "wake").toml)
    prof = load_profile(str(path))
    assert prof.host_op_s == pytest.approx(3e-4) and "mean gap" in prof.sources["host_op_s"]
    p2 = prof.for_ranks(2)
    t = p2.collectives()
    assert t.time("all_reduce", "x", 2, 1 << 16) == pytest.approx(1e-3 + 5e-4 + 2 * (1 << 16) / 1e9, rel=1e-6)
    alone = sum(2e-4 + 2 * b / 1e9 for b in sizes)  # MEASUREMENT's line measured alone
    inside = sum(1e-3 + 5e-4 + 2 * b / 1e9 for b in sizes)
    assert p2.axis_slowdown == {"x": pytest.approx(inside / alone, rel=1e-4)}
    assert t.time("all_gather", "x", 2, 1 << 16) == pytest.approx(inside / alone * (2e-4 + 2 * (1 << 16) / 1e9),
                                                                  rel=1e-4)


def test_a_collective_issued_costs_the_host_of_the_compute_op_after_it():
    """On a CPU the host that issues a collective is the device that computes (it fills the buffers,
    gloo's thread takes its core as it wakes): each compute op pays host_op_s plus host_issue_s per
    collective issued since the compute op before it that it does not wait for (the wait holds the
    issue of one it waits for)."""
    from twin.costs.kernels import host_times
    from twin.program.program import Op
    ops = [Op(0, "ag0", "all_gather", "z", axis="z"), Op(1, "ag1", "all_gather", "z", axis="z"),
           Op(2, "gemm0", "gemm", "compute"), Op(3, "gemm1", "gemm", "compute"),
           Op(4, "rs", "reduce_scatter", "z", axis="z"), Op(5, "norm", "elementwise", "compute")]
    assert host_times(ops, 2e-4, 5e-4) == pytest.approx([0, 0, 2e-4 + 1e-3, 2e-4, 0, 2e-4 + 5e-4])
    ops[2] = Op(2, "gemm0", "gemm", "compute", deps=(0,))  # waits for ag0: only ag1's issue is charged
    assert host_times(ops, 2e-4, 5e-4) == pytest.approx([0, 0, 2e-4 + 5e-4, 2e-4, 0, 2e-4 + 5e-4])
    assert host_times(ops, 0.0, 0.0) == [0.0] * 6  # a GPU profile: the op times unchanged


def test_the_issue_cost_is_fitted_where_the_ranks_do_not_outnumber_the_cores():
    """cpu-2026-12-01g's bench files (before bench recorded issue times): with 2 ranks on 2 cores the
    recorded steps replayed at their measured spans spend 345 ms between compute ops per step where
    bench measured 417 ms (1x1x2x1: 35 against 80; a gap in which its runs issued a z collective
    took 0.70 ms, one with none 0.18); 1.59 ms per collective issued that the next compute op does
    not wait for closes it (0.66 ms when every issue was charged; the fit takes in whatever else the
    replay misses between compute ops: bench measured 0.57 ms per such issue in cpu-2026-12-02b).
    With 4 and 8 ranks on 2 cores these files give no issue cost."""
    import tempfile
    from twin.costs.profile import load_profile
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "cpu.toml"
        path.write_text(_fitted("cpu-2026-12-01g"))
        prof = load_profile(str(path))
    assert 1e-3 < prof.for_ranks(2).host_issue_s < 2.5e-3
    assert "replay of the recorded training steps" in prof.sources["node_share[1].host_issue_s"]
    assert prof.for_ranks(1).host_issue_s == prof.for_ranks(4).host_issue_s == prof.for_ranks(8).host_issue_s == 0


def test_the_issue_cost_is_measured_where_bench_recorded_it():
    """cpu-2026-12-02b's bench files record each collective's issue time (issue_s): the profile takes
    the mean over the collectives the next compute op does not wait for, with every rank count that
    ran collectives (measured 0.57, 0.69 and 0.73 ms with 2, 4 and 8 ranks on 2 cores); one rank
    issues none."""
    import tempfile
    from twin.costs.profile import load_profile
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "cpu.toml"
        path.write_text(_fitted("cpu-2026-12-02b"))
        prof = load_profile(str(path))
    for k, ranks in enumerate((1, 2, 4, 8)):
        if ranks == 1:
            assert prof.for_ranks(1).host_issue_s == 0
            continue
        assert 2e-4 < prof.for_ranks(ranks).host_issue_s < 2e-3, ranks
        assert prof.sources[f"node_share[{k}].host_issue_s"].startswith("measured: mean host time of issuing")
    assert prof.for_ranks(2).host_issue_s < prof.for_ranks(8).host_issue_s  # more ranks, longer to issue


def test_bench_takes_an_ops_mean_over_the_recorded_steps():
    """The twin sums ops into an iteration, so bench gives each op its mean over the recorded steps
    (the mean of a sum is the sum of the means); the upper median of 4 it took before gave one step
    run 5x long no weight at all, and 4 alike steps' upper one otherwise (benchmarks/cpu_step_spread.py)."""
    from backend.bench.steps import per_step
    assert per_step([1e-3, 1e-3, 1e-3, 5e-3]) == pytest.approx(2e-3)
    assert per_step([1e-3, 2e-3, 3e-3, 4e-3]) == pytest.approx(2.5e-3)


def test_a_role_recorded_at_one_size_takes_the_pooled_on_cpu_line(tmp_path):
    """A norm over whole features is recorded at one size per rank count (8 ranks: 262 kB), which
    cannot tell latency from bandwidth: its line's shape is the on-CPU line over every rank count's
    sizes, at this count's level, x this count's stretch (a bandwidth-only line gave 1x8x1x1's 2 MB
    norms 2x their measured time)."""
    import copy
    from test_calibration import MEASUREMENT, write
    from twin.costs.kernels import KernelModel
    from twin.costs.profile import load_profile
    from twin.program.program import Op

    def cost(b):  # on-CPU seconds of a layer norm of b bytes
        return 1e-4 + b * 1e-9

    def steps(sizes, stretch):
        return [{"name": f"ln{i}", "kind": "elementwise", "role": "layer_norm", "stream": "compute", "axis": "",
                 "bytes": b, "flops": 0.0, "covered": 0.0, "cpu_s": cost(b), "seconds": stretch * cost(b)}
                for i, b in enumerate(sizes)]
    two = copy.deepcopy(MEASUREMENT) | {"steps": steps([1 << 16, 1 << 18, 1 << 20], 1.0)}
    four = copy.deepcopy(MEASUREMENT) | {"grid": "2x1x1x2", "ranks": 4, "ranks_per_node": 4,
                                         "steps": steps([1 << 20] * 3, 2.0)}
    path = tmp_path / "pooled.toml"
    path.write_text(fit_profile([write(tmp_path, two, "two.json"), write(tmp_path, four, "four.json")], "p").toml)
    prof = load_profile(str(path)).for_ranks(4)
    norm = Op(0, "ln", "elementwise", "compute", bytes=1 << 22, role="layer_norm")
    assert KernelModel(prof, tuning=False).kernel_time(norm) == pytest.approx(2.0 * cost(1 << 22), rel=1e-3)
    assert any("with 2 or more ranks" in v and "stretch 2.000" in v
               for k, v in prof.sources.items() if k.startswith("op_cost") and k.endswith("latency_s"))


def test_each_grid_takes_its_own_stretch_from_the_twins_timeline(tmp_path):
    """On CPU a compute op takes its on-CPU time x its grid's stretch (twin.host.cores), from the busy
    shares of the twin's own timeline (a fixed point), with node_cores and collective_core_load
    fitted from bench's recorded steps. Ranks blocked in collectives leave their cores to the
    others: 1x8x1x1, whose ranks wait long on blocking y all-reduces, stretches less than 1x1x8x1,
    whose z all-gathers run beside compute (measured 2.25 against 2.99 in cpu-2026-12-01d's runs,
    1.83 against 2.95 in -01c's; the pooled stretch gave both 2.64)."""
    from twin.host.cores import busy_shares, core_stretch
    from twin.program.grid import Grid
    from twin.program.model import load_model
    from twin.costs.profile import load_profile
    from twin.program.program import host_ordered
    from twin.predict.simulate import model_for, program_for, shared_core_stretch, simulate_grid
    from twin.predict.study import prepare
    path = tmp_path / "cpu.toml"
    path.write_text(_fitted("cpu-2026-12-01d"))
    prof = load_profile(str(path))
    assert prof.node_cores == 2 and 0.2 < prof.collective_core_load < 0.5
    assert "recorded training steps" in prof.sources["collective_core_load"]
    spec = load_model("gpt-small")
    got = {}
    for g in ("1x8x1x1", "1x1x8x1"):
        grid = Grid.parse(g)
        study = prepare("cpu", spec, 8, 16, spec.seq_len, profile=str(path), gemm_tuning=False)
        prog = host_ordered(program_for(study, grid))
        s = got[g] = shared_core_stretch(study, grid, prog, model_for(study, grid))
        res = simulate_grid(study, grid, record=True)
        idx = {op.name: op.index for op in prog.ops}
        spans = [(0, idx[x.name], x.start_s, x.duration_s) for x in res.spans]
        p = study.profile
        shares = busy_shares(spans, lambda i: prog.ops[i].is_collective, p.host_op_s)
        assert core_stretch(8, 2, p.collective_core_load, *shares) == pytest.approx(s, rel=2e-3)  # the fixed point
        gemm = next(op for op in prog.ops if op.kind == "gemm")
        assert next(x.duration_s for x in res.spans if x.name == gemm.name) >= (
            study.kernels.kernel_time(gemm) * s / p.stretch + p.host_op_s) * (1 - 1e-6)
    assert got["1x8x1x1"] < prof.for_ranks(8).stretch < got["1x1x8x1"]
    # 2 ranks on 2 cores: at least the stretch bench measured with 2 ranks (the formula alone says 1)
    study = prepare("cpu", spec, 2, 16, spec.seq_len, profile=str(path), gemm_tuning=False)
    grid = Grid.parse("2x1x1x1")
    two = shared_core_stretch(study, grid, host_ordered(program_for(study, grid)), model_for(study, grid))
    assert two == pytest.approx(prof.for_ranks(2).stretch) and two > 1.0
    # files without on-CPU times (cpu-2026-12-01c): no model, every grid at the pooled stretch
    old = tmp_path / "old.toml"
    old.write_text(_fitted("cpu-2026-12-01c"))
    study = prepare("cpu", spec, 8, 16, spec.seq_len, profile=str(old), gemm_tuning=False)
    grid = Grid.parse("1x8x1x1")
    assert shared_core_stretch(study, grid, program_for(study, grid), model_for(study, grid)) is None


def test_grid_auto_on_cpu_picks_the_fastest_grid():
    """The search rules grids out by lower bounds on their simulated time; on CPU each grid runs at its
    own stretch, which can be below the pooled one the op times hold, so a compute op's least time is
    its on-CPU time (the stretch is at least 1). At the pooled stretch the bound of 1x1x1x4 (its own
    stretch 1.50 against 1.66) ruled it out, and gpt-small on 4 ranks chose 1x1x2x2 at 0.512 s over
    1x1x1x4 at 0.490 s."""
    from twin.predict.search import rank_grids
    from twin.predict.simulate import choose_grid, simulate_grid
    from twin.predict.study import prepare
    study = prepare("cpu", "gpt-small", 4)
    best, _ = choose_grid(study)
    every = [c.grid for c in rank_grids(study, None, keep=1000)]
    assert best.simulated_s == pytest.approx(min(simulate_grid(study, g).iteration_time_s for g in every))


def _validated(run: str, measured_it: float, op_measured: float, spread_ops: float = 1.0) -> dict:
    """A validate_run result of one run of 2x1x1x1 with two ops (what pool_repeats reads)."""
    ops = [{"name": "fwd.gemm", "kind": "gemm", "measured_s": op_measured, "predicted_s": 0.010,
            "error": 0.010 / op_measured - 1, "wall_s": op_measured, "cpu_s": op_measured},
           {"name": "ar.data", "kind": "all_reduce", "measured_s": 0.004 * spread_ops, "predicted_s": 0.004,
            "error": 1 / spread_ops - 1, "wall_s": 0.004 * spread_ops, "peer_wait_s": 0.001,
            "predicted_excess_s": 0.001}]
    return {"run": run, "model": "gpt-tiny", "grid": "2x1x1x1", "batch": 8, "options": {},
            "iteration": {"measured_s": measured_it, "predicted_s": 0.10, "error": 0.10 / measured_it - 1,
                          "steps_used": 4, "outside_ops_measured_s": 0.01},
            "ops": {"matched": 2, "unmatched": [], "stretch": 1.0, "median_abs_error": 0.0,
                    "compute_median_abs_error": 0.0, "by_kind": {}, "collective_spans": {"all_reduce": [4, 1]}},
            "memory": {"predicted_bytes": 100, "measured_bytes": 100, "error": 0.0}, "per_op": ops}


def test_repeated_runs_of_a_grid_are_compared_at_their_median():
    """A single CPU run per grid carries +-15 % per-process noise (the same grid minutes apart), as
    large as the loop's target: the loop repeats each grid and `twin validate` compares the prediction
    with the median of the repeats, per op too, and reports their spread beside the error."""
    from calibration.validate_summary import pool_repeats
    runs = [_validated("a", 0.125, 0.0125, 1.5), _validated("b", 0.100, 0.010), _validated("c", 0.080, 0.008, 0.5)]
    p = pool_repeats(runs)
    assert p["repeats"] == 3 and p["runs"] == ["a", "b", "c"]
    it = p["iteration"]
    assert it["measured_s"] == pytest.approx(0.100) and it["error"] == pytest.approx(0.0)  # not 0.125's -20 %
    assert it["spread"] == pytest.approx(0.125 / 0.080 - 1) and it["measured_each_s"] == [0.125, 0.100, 0.080]
    assert it["steps_used"] == 12
    ops = {o["name"]: o for o in p["per_op"]}
    assert ops["fwd.gemm"]["measured_s"] == pytest.approx(0.010) and ops["fwd.gemm"]["error"] == pytest.approx(0)
    assert ops["ar.data"]["error_from_last_arrival"] == pytest.approx(0.003 / 0.003 - 1)
    assert p["ops"]["median_abs_error"] == pytest.approx(0) and p["ops"]["by_kind"]["gemm"]["median_abs_error"] == 0
    assert p["ops"]["by_kind"]["all_reduce"]["completed_with_previous_share"] == pytest.approx(3 / 12)
    one = pool_repeats(runs[:1])  # one run: as validated, with a spread of 0
    assert one["iteration"]["error"] == pytest.approx(0.10 / 0.125 - 1) and one["iteration"]["spread"] == 0


def test_the_loops_passes_vary_the_order_of_the_grids():
    """Repeats run in interleaved passes whose order varies, so that a drift of the machine during the
    loop does not fall on one grid: every pass runs every grid once, no grid keeps its place or its
    predecessor in all passes."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_validate", LOOPS.parent.parent / "benchmarks" / "bench_validate.py")
    bv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bv)
    grids = [f"g{i}" for i in range(35)]
    orders = bv.pass_orders(grids, 3)
    assert len(orders) == 3 and all(sorted(o) == sorted(grids) for o in orders)
    assert not any(len({o.index(g) for o in orders}) == 1 for g in grids)
    before = [{g: o[o.index(g) - 1] for g in o[1:]} for o in orders]
    assert not any(all(g in b and b[g] == before[0].get(g) for b in before) for g in grids)
    assert bv.pass_orders(grids, 1) == [grids]


def test_bench_passes_sit_among_the_run_passes():
    """The loop's bench passes are spread among its run passes (so the profile and the runs sample the
    same stretch of a drifting machine); calibrate-only benches alone."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_validate", LOOPS.parent.parent / "benchmarks" / "bench_validate.py")
    bv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bv)
    assert bv.loop_plan(3, 1) == ["R1", "B1", "R2", "R3"]
    assert bv.loop_plan(4, 2) == ["R1", "B1", "R2", "R3", "B2", "R4"]
    assert bv.loop_plan(0, 2) == ["B1", "B2"]
    for repeats, passes in ((1, 1), (2, 1), (5, 2), (3, 3), (7, 3)):
        plan = bv.loop_plan(repeats, passes)
        assert sorted(plan) == sorted([f"R{k + 1}" for k in range(repeats)] + [f"B{j + 1}" for j in range(passes)])
        assert [p for p in plan if p[0] == "R"] == [f"R{k + 1}" for k in range(repeats)]


def test_a_gemm_timed_by_several_bench_passes_takes_their_median(tmp_path):
    """Bench passes of one loop time the same GEMM shapes: the profile holds one point per shape, at
    the median time of the files, and names them all."""
    import copy
    from test_calibration import MEASUREMENT, write
    files = []
    for i, scale in enumerate((1.0, 1.3, 0.9)):
        data = copy.deepcopy(MEASUREMENT)
        for row in data["gemm"]:
            row["seconds"] *= scale
        files.append(write(tmp_path, data, f"bench-{i}.json"))
    pooled = fit_profile(files, "three").toml
    one = load_profile_text(tmp_path, fit_profile(files[:1], "one").toml)
    three = load_profile_text(tmp_path, pooled)
    micro = [pt for pt in three.gemm_table if not pt.training]
    assert len(micro) == len([pt for pt in one.gemm_table if not pt.training]) == len(MEASUREMENT["gemm"])
    for a, b in zip(micro, (pt for pt in one.gemm_table if not pt.training)):
        assert (a.m, a.n, a.k, a.layout) == (b.m, b.n, b.k, b.layout)
        assert a.flops == pytest.approx(b.flops, rel=1e-3)  # the median of 1.0, 1.3 and 0.9 is 1.0
    assert "median of 3 files" in pooled


def load_profile_text(tmp_path, text: str):
    from twin.costs.profile import load_profile
    path = tmp_path / "p.toml"
    path.write_text(text)
    return load_profile(str(path))


def test_the_noise_floor_counts_what_an_exact_model_can_reach():
    """calibration.noise: no noise puts every grid within 15 %; the runs' noise is the sd of log(run
    time) among a grid's repeats; halves compare odd runs with even ones; noise_floor holds them all
    for a validation with repeats, and None without."""
    import math

    from calibration.noise import exact_model, halves, noise_floor, noise_line, run_noise
    assert exact_model(0.0, 3, 35, trials=20) == (35.0, 1.0)
    expected, every = exact_model(0.5, 3, 35, trials=50)
    assert expected < 30 and every == 0.0  # 50 % per run: far outside
    expected, every = exact_model(0.139, 4, 35)  # 03a's noise: the committed table's cell
    assert 32.8 < expected < 33.8 and 0.1 < every < 0.3
    times = [[1.0, math.e ** 0.2, 1.0, math.e ** 0.2], [2.0, 2.0, 2.0, 2.0]]
    assert run_noise(times) == pytest.approx(math.sqrt(4 * 0.1 ** 2 / 6))
    assert halves(times) == (1, 2)  # odd runs 1.0, even runs e^0.2 = 1.22: apart; the second agrees
    assert halves(times, target=0.25) == (2, 2)
    nf = noise_floor(times)
    assert nf["halves_within"] == 1 and nf["grids"] == 2 and nf["repeats"] == 4 and nf["target"] == 0.15
    assert "1 of 2 grids within 15 %" in noise_line(nf)
    assert noise_floor([[1.0], [2.0]]) is None and run_noise([[1.0]]) is None


def test_the_op_noise_splits_four_runs_into_pairs_three_ways():
    """benchmarks/cpu_op_noise.py: each split's gap is the median over ops of |A / B - 1|, A and B
    each op's median over a pair of runs; the twin's error is taken against the median of all."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("cpu_op_noise", LOOPS.parent.parent / "benchmarks" / "cpu_op_noise.py")
    on = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(on)

    def run(a: float, b: float) -> dict:
        return {"per_op": [{"name": "gemm", "measured_s": a, "predicted_s": 1.0},
                           {"name": "norm", "measured_s": b, "predicted_s": 2.0}],
                "ops": {"stretch": 2.0, "stretch_predicted": 2.5}}

    g = on.grid_noise([run(1.0, 2.0), run(1.0, 2.0), run(2.0, 2.0), run(2.0, 2.0)])
    # runs 1+3 / 2+4 and 1+4 / 2+3: each pair's gemm median 1.5, no gap; 1+2 / 3+4: gemm 1 against 2
    assert g["halves"] == [0.0, pytest.approx(0.25), 0.0]  # median of |1/2 - 1| = 0.5 and the norm's 0
    assert g["twin"] == pytest.approx(0.5 * abs(1.0 / 1.5 - 1))  # gemm 1/1.5 - 1, norm 0: their median
    assert g["stretch"] == [2.0] * 4 and g["stretch_predicted"] == 2.5


def test_ranks_are_pinned_round_robin_when_asked():
    """BACKEND_CPU_BIND=cores pins rank i to core i mod cores (as srun --cpu-bind=cores); unset, a
    rank keeps every core it was given."""
    import os
    import subprocess
    import sys
    from backend.launch.rank import bind_cores
    assert [bind_cores(r, [0, 1]) for r in range(4)] == [{0}, {1}, {0}, {1}]
    cores = sorted(os.sched_getaffinity(0))
    code = "import sys; from backend.launch.rank import bind_rank; print(sorted(bind_rank(int(sys.argv[1]))))"
    for bind, want in (("cores", [cores[1 % len(cores)]]), ("none", cores)):
        env = {**os.environ, "BACKEND_CPU_BIND": bind, "BACKEND_CPU_BIND_CORES": ",".join(map(str, cores))}
        out = subprocess.run([sys.executable, "-c", code, "1"], env=env, cwd=LOOPS.parent.parent,
                             capture_output=True, text=True, timeout=60).stdout.strip()
        assert out == str(want), (bind, out)


def test_host_gaps_tell_free_gaps_from_gaps_beside_a_collective():
    """twin.present.trace.host_gaps, which backend bench and benchmarks/cpu_host_gaps.py read the host's gaps
    with: a gap with no collective in flight, one beside an all-gather with none issued or completed
    in it (quiet), one in which the all-gather completes (the op after it waited for it), one in
    which a reduce-scatter is issued."""
    from twin.present.trace import Span, host_gaps
    comp = [Span(0, n, "gemm", "compute", s, d) for n, s, d in
            (("z", -1.0, 0.4), ("a", 0.0, 1.0), ("b", 1.2, 1.0), ("c", 2.6, 0.4), ("d", 3.3, 0.2))]
    ag = Span(0, "ag", "all_gather", "z", 0.5, 2.0)
    rs = Span(0, "rs", "reduce_scatter", "z", 3.1, 1.0)
    gaps = host_gaps(comp, [ag, rs])
    assert [round(g.seconds, 6) for g in gaps] == [0.6, 0.2, 0.4, 0.3]
    assert [set(g.in_flight) for g in gaps] == [set(), {"all_gather"}, {"all_gather"}, {"reduce_scatter"}]
    assert [g.quiet for g in gaps] == [True, True, False, False]
    assert gaps[2].waited == ag and gaps[2].wake_s == pytest.approx(0.1)
    assert all(g.waited is None for g in (gaps[0], gaps[1], gaps[3]))


def test_the_twin_leaves_out_host_time_on_1x1x1x8(tmp_path):
    """benchmarks/cpu_host_gaps.py on cpu-2026-12-02g. Bench's 1x1x1x8: free gaps' mean 2.08 ms on a
    median of 0.08 ms, 241 ms of a step's descheduling in its gaps against 142 ms in its compute ops.
    The runs of 1x1x1x8: the free mean 1.36 times host_op_s, the twin's host time leaving out 8.5 %
    of the step (its iteration predicted 8 % short). Asserted: bench's gaps hold more descheduling
    than its ops, the runs' free mean over 1.2 times host_op_s and over 5 % of the step left out."""
    import sys
    import tarfile
    sys.path.insert(0, str(LOOPS.parent.parent / "benchmarks"))
    from cpu_host_gaps import bench_row, grid_row
    loop = LOOPS / "cpu-2026-12-02g"
    *_, in_ops, in_gaps = bench_row(str(loop / "bench-1x1x1x8.json")).split()
    assert float(in_gaps) > float(in_ops) > 100
    with tarfile.open(loop / "runs.tar.xz") as tar:
        tar.extractall(tmp_path, members=[m for m in tar.getmembers() if m.name.split("/")[1:2] == ["1x1x1x8"]],
                       filter="data")
    prof = tmp_path / "cpu.toml"
    prof.write_text(_fitted("cpu-2026-12-02g"))
    from twin.costs.profile import load_profile
    p = load_profile(str(prof))
    runs = sorted(f.parent for f in (tmp_path / "runs" / "1x1x1x8").rglob("log.jsonl"))
    assert len(runs) == 4
    cols = grid_row(runs, lambda r: p.for_ranks(r).host_op_s).split()
    assert float(cols[5]) > 1.2 and float(cols[-1].rstrip("%")) > 5.0, cols


def test_spans_drawn_at_their_spread_bring_the_z4_stretch_toward_the_runs(tmp_path):
    """twin.host.spread on cpu-2026-12-02g's runs of 1x1x4x2 (z all-gathers prefetched beside compute):
    the profile fitted from its bench records each class's spread (8 ranks: compute 0.69, z
    all-gathers 0.65); with it the predicted stretch is 3.32 (3.60 with every op at its mean span,
    the same profile less its span_spread; 3.52 as the loop was fitted before, collective_core_load
    0.37 from mean-span replays against 0.39 from drawn ones), against 2.74 measured, and the per-op
    median error 24.9 % (34.5 %; 32.2 %). Asserted: the spreads as measured, the stretch lower by at least 0.1 and still above
    the measured one, the per-op median error lower by at least 4 points."""
    import tarfile
    from calibration.validate import validate_runs
    from twin.costs.profile import load_profile
    loop = LOOPS / "cpu-2026-12-02g"
    with tarfile.open(loop / "runs.tar.xz") as tar:
        tar.extractall(tmp_path, members=[m for m in tar.getmembers() if m.name.split("/")[1:2] == ["1x1x4x2"]],
                       filter="data")
    runs = sorted(f.parent for f in (tmp_path / "runs" / "1x1x4x2").rglob("log.jsonl"))
    drawn, mean = tmp_path / "drawn.toml", tmp_path / "mean.toml"
    drawn.write_text(_fitted("cpu-2026-12-02g"))
    mean.write_text("\n".join(ln for ln in _fitted("cpu-2026-12-02g").splitlines() if not ln.startswith("span_spread")))
    spread = load_profile(str(drawn)).for_ranks(8).span_spread
    assert 0.5 < spread["compute"] < 0.9 and 0.5 < spread["all_gather_z"] < 0.9, spread
    assert load_profile(str(mean)).for_ranks(8).span_spread == {}
    got = {}
    for name, prof in (("drawn", drawn), ("mean", mean)):
        ops = validate_runs(runs, profile=str(prof))["runs"][0]["ops"]
        got[name] = ops["stretch_predicted"], ops["median_abs_error"], ops["stretch"]
    (s_drawn, e_drawn, measured), (s_mean, e_mean, _) = got["drawn"], got["mean"]
    assert measured < s_drawn < s_mean - 0.1, got
    assert e_drawn < e_mean - 0.04, got
