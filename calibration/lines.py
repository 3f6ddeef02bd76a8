"""The lines calibration fits: seconds = latency + bytes / bandwidth over measured points, and how well
each reproduces its points (relative residuals). Pure numbers in, numbers out."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import numpy as np


@dataclass
class Residual:
    """How well one fitted line reproduces its measurements: relative errors (fit/measured - 1)."""

    what: str
    points: int
    median: float
    worst: float


def residual(what: str, res: list[float]) -> Residual:
    a = [abs(r) for r in res]
    return Residual(what, len(a), statistics.median(a) if a else 0.0, max(a) if a else 0.0)


def fit_line(x: list[float], t: list[float]) -> tuple[float, float, list[float]]:
    """(intercept a >= 0, slope b >= 0, relative residuals) of t ~ a + b x, least squares on t's
    relative error (each point weighted 1/t), so that small and large sizes count alike."""
    X, T = np.asarray(x, float), np.asarray(t, float)
    w = 1.0 / T
    best = None
    for fix in (None, "a", "b"):
        if fix is None:
            A = np.stack([w, w * X], axis=1)
            (a, b), *_ = np.linalg.lstsq(A, np.ones_like(T), rcond=None)
        elif fix == "a":
            a, b = 0.0, float(np.sum(w * X) / np.sum((w * X) ** 2)) if np.any(X) else 0.0
        else:
            a, b = float(np.sum(w) / np.sum(w * w)), 0.0
        if a < 0 or b < 0:
            continue
        res = (a + b * X) / T - 1.0
        err = float(np.sum(res ** 2))
        if best is None or err < best[0]:
            best = (err, float(a), float(b), res.tolist())
    assert best is not None  # the constant fit (b = 0) always has a >= 0
    return best[1], best[2], best[3]


def collective_line(nbytes: list[float], seconds: list[float]) -> tuple[float, float, list[float]]:
    """(latency a >= 0, seconds per byte b >= 0, relative residuals) of seconds ~ a + b bytes over the
    collectives of recorded training steps, least squares on seconds (not on relative error): the
    fitted line then gives back their summed time, which is what an iteration pays (where the free fit
    has a term below 0, the one-term fit that keeps the sum: seconds ~ bytes x sum/sum, or the mean). A span inside
    training can be near 0 (a collective of a burst that completed while the one before it ran, as
    the data-axis all-reduces at the end of a step do: the span starts when the previous one ends),
    and a relative fit lets such spans pull the whole line to 0."""
    X, T = np.asarray(nbytes, float), np.asarray(seconds, float)
    best = None
    for fix in ((None, "a", "b") if len(set(nbytes)) >= 2 else ("b",)):
        if fix is None:
            (a, b), *_ = np.linalg.lstsq(np.stack([np.ones_like(X), X], axis=1), T, rcond=None)
        elif fix == "a":
            a, b = 0.0, float(T.sum() / X.sum()) if np.any(X) else 0.0  # keeps the sum too
        else:
            a, b = float(T.mean()), 0.0
        if a < 0 or b < 0:
            continue
        err = float(np.sum((a + b * X - T) ** 2))
        if best is None or err < best[0]:
            best = (err, float(a), float(b))
    assert best is not None  # the constant fit (b = 0) always has a >= 0
    _, a, b = best
    return a, b, [((a + b * x) / t - 1.0) if t > 0 else 0.0 for x, t in zip(X, T)]


def alone_point(table, kind: str, p: int, stride: int):
    """The `[[collective_table]]` point (measured alone) of this kind and group size, the nearest
    stride; None without one."""
    pts = [q for q in table.points if q.kind == kind and q.group_size == p] if table is not None else []
    return min(pts, key=lambda q: (q.stride != stride, abs(q.stride - stride))) if pts else None


def excess_line(nbytes: list[float], seconds: list[float], alone) -> tuple[float, float, list[float]]:
    """(latency, seconds per byte, relative residuals) of a collective inside training: the line
    measured alone (`alone`, a CollectivePoint) with its latency raised by the mean excess of the
    recorded spans over it, so that the line gives back their summed time. The slope stays the
    microbenchmark's: it timed 5 sizes over three decades, alone, while the recorded steps hold a few
    sizes within a factor 4, each span carrying time-slicing noise and the wait for the group's last
    member, whose free least-squares slope came out anywhere from 7 MB/s to infinite on the 2-core
    development VM; there 1x1x2x4's z reduce-scatters, 4x the bytes of the benched 2x2x2x1's, were
    predicted 4x their measured span. What training adds to a collective (the wait for the last
    member, the wake-up of its threads among busy cores) is taken per op, not per byte. Where the
    excess would leave a negative latency, the latency is 0 (the sum is then not kept)."""
    a0, b0 = alone.latency_s, 1.0 / alone.bandwidth
    extra = statistics.fmean(t - (a0 + b0 * x) for x, t in zip(nbytes, seconds))
    a = max(a0 + extra, 1e-9)
    return a, b0, [((a + b0 * x) / t - 1.0) if t > 0 else 0.0 for x, t in zip(nbytes, seconds)]


def cost_line(nbytes: list[float], seconds: list[float]) -> tuple[float, float, list[float]]:
    """fit_line, or with a single size, bandwidth alone (latency when that size is 0 bytes)."""
    if len(set(nbytes)) >= 2:
        return fit_line(nbytes, seconds)
    t = statistics.median(seconds)
    res = [t / s - 1.0 for s in seconds]
    return (0.0, t / nbytes[0], res) if nbytes[0] > 0 else (t, 0.0, res)
