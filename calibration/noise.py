"""The measurement's own noise: how close to a target any model can come against repeated runs.

A grid's runs on a shared machine differ from run to run (on the 2-core development VM by a log
standard deviation of 0.09-0.24 per run, docs/calibration.md), so a grid can miss a 15 % target with an
exact model. Before a miss is read as the twin's, `noise_floor` says what the runs themselves allow:
- the runs' noise: the standard deviation of log(iteration time) among a grid's repeats, pooled over
  the grids (root mean square, n - 1 weights);
- measured against measured: each grid's median over its odd repeats against the median over its even
  ones, and how many grids agree within the target; no model is involved;
- an exact model: one that predicts every grid's true mean, judged against the median of R runs with
  that noise (log-normal, grids independent; seeded Monte Carlo): the expected count of grids within
  the target and the chance that every grid is. It leaves out the profile's own noise (fitted from
  bench passes on the same machine), so it is an upper bound on what a loop can show.

Used by `twin validate` (the report's "noise", printed under its table) and benchmarks/bench_validate.py.
"""

from __future__ import annotations

import math
import random
import statistics

TARGET = 0.15  # the iteration target: within 15 %
TRIALS = 4000


def run_noise(times: list[list[float]]) -> float | None:
    """Pooled standard deviation of log(run time) over the grids' repeats (times: per grid, each run's
    iteration in seconds); None where no grid has two runs."""
    ss, dof = 0.0, 0
    for runs in times:
        if len(runs) > 1:
            logs = [math.log(t) for t in runs]
            mean = statistics.fmean(logs)
            ss += sum((x - mean) ** 2 for x in logs)
            dof += len(logs) - 1
    return math.sqrt(ss / dof) if dof else None


def halves(times: list[list[float]], target: float = TARGET) -> tuple[int, int]:
    """(grids whose odd-run and even-run medians agree within `target`, grids with two runs or more)."""
    agree = n = 0
    for runs in times:
        if len(runs) >= 2:
            a, b = statistics.median(runs[0::2]), statistics.median(runs[1::2])
            agree += abs(a / b - 1) <= target
            n += 1
    return agree, n


def exact_model(sigma: float, repeats: int, grids: int, target: float = TARGET, profile_sd: float = 0.0,
                trials: int = TRIALS, seed: int = 0) -> tuple[float, float]:
    """A model exact on every grid's mean against the median of `repeats` log-normal runs of log sd
    `sigma`, each prediction off by a log-normal error of sd `profile_sd` (0: none): the expected count
    of the `grids` within `target`, and the chance that all are."""
    rng = random.Random(seed)
    total = every = 0
    for _ in range(trials):
        inside = sum(abs(math.exp(rng.gauss(0.0, profile_sd) - statistics.median(rng.gauss(0.0, sigma) for _ in range(repeats)))
                         - 1) <= target for _ in range(grids))
        total += inside
        every += inside == grids
    return total / trials, every / trials


def noise_floor(times: list[list[float]], target: float = TARGET) -> dict | None:
    """The three figures above for one validation (times: per grid, each run's iteration in seconds),
    R the median count of runs per grid; None where no grid has two runs."""
    sigma = run_noise(times)
    if sigma is None:
        return None
    agree, compared = halves(times, target)
    repeats = int(statistics.median(len(t) for t in times))
    expected, every = exact_model(sigma, repeats, len(times), target)
    return {"target": target, "run_log_sd": sigma, "halves_within": agree, "halves_grids": compared,
            "repeats": repeats, "grids": len(times), "exact_model_within": expected, "exact_model_all": every}


def noise_line(noise: dict) -> str:
    """One sentence of noise_floor's figures, for a summary under a validation's table."""
    pct = round(100 * noise["target"])
    return (f"the runs' own noise: {noise['run_log_sd']:.3f} per run (log sd); odd runs against even runs: "
            f"{noise['halves_within']} of {noise['halves_grids']} grids within {pct} %; a model exact on every "
            f"grid's mean, against the median of {noise['repeats']} runs: {noise['exact_model_within']:.1f} of "
            f"{noise['grids']} within {pct} % expected, all of them {100 * noise['exact_model_all']:.0f} % of the time")
