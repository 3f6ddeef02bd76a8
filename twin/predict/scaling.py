"""Scaling studies: the predicted iteration of a series of (model, GPU count) points, the Python API
behind `twin scaling`.

- weak: the model grows with the GPU count, about 9.8 M parameters per GPU, as in AxoNN's model table
  (docs/reference/published.md: gpt-5b on 512, gpt-10b on 1,024, ... gpt-320b on 32,768 GPUs),
  one global batch for every point (the documented 2,048 x 2,048 tokens unless given);
- strong: the system's default model on 1/8, 1/4, 1/2 and all of its default GPU count, one batch
  (the default study's).

Each point gets its best grid (`--grid auto`: the analytical top `simulate_top` + 16, bounded and simulated: twin.predict.simulate),
the iteration time, flop/s, percent of the advertised peak and the efficiency against the first
point: flop/s per GPU of the point over that of the first (for strong scaling, with one model and
one batch, this is speed-up over the GPU ratio). Points whose model does not fit or whose GPU count
the machine lacks are left out with the reason.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from topologies.system import SystemSpec, load_system
from topologies.common import TwinError, finite_json
from twin.program.program import Options

# AxoNN's model table (published.md): the weak-scaling series, about 9.8 M parameters per GPU
WEAK_SERIES = (("gpt-5b", 512), ("gpt-10b", 1024), ("gpt-20b", 2048), ("gpt-40b", 4096),
               ("gpt-80b", 8192), ("gpt-160b", 16384), ("gpt-320b", 32768))
SERIES = ("weak", "strong")


@dataclass
class ScalingPoint:
    """One point of a series. Times in seconds, rates in flop/s, efficiency and shares in percent."""

    model: str
    gpus: int
    batch: int                 # global batch, sequences
    grid: str
    iteration_s: float
    flops_per_s: float
    percent_of_peak: float
    efficiency: float          # percent: flop/s per GPU against the first point's
    breakdown_s: dict = field(default_factory=dict)
    grid_choice: str = ""


@dataclass
class ScalingResult:
    system: str
    series: str
    points: list[ScalingPoint]
    skipped: list[str] = field(default_factory=list)   # "model on N GPUs: why"

    def as_dict(self) -> dict:
        return {"system": self.system, "series": self.series, "points": [asdict(p) for p in self.points],
                "skipped": self.skipped}

    def to_json(self) -> str:
        return finite_json(self.as_dict(), indent=1)

    def point(self, gpus: int) -> ScalingPoint:
        for p in self.points:
            if p.gpus == gpus:
                return p
        raise KeyError(f"no point with {gpus} GPUs in the {self.series} series of {self.system}")


def series_points(system: SystemSpec, series: str) -> list[tuple[str, int]]:
    """The (model, GPU count) points of a series on a system (those the machine has GPUs for)."""
    if series == "weak":
        return [(m, g) for m, g in WEAK_SERIES if g <= system.total_gpus]
    if series == "strong":
        g = system.default_gpus
        return [(system.default_model, g // k) for k in (8, 4, 2, 1) if g % k == 0 and g // k >= 1]
    from topologies.datafile import did_you_mean
    raise TwinError(f"unknown series {series!r}:{did_you_mean(series, SERIES)} choose one of {', '.join(SERIES)}")


def scaling(system: str | SystemSpec, series: str = "weak", points: list[tuple[str, int]] | None = None,
            batch: int | None = None, options: Options | None = None, simulate_top: int = 4,
            gpus: list[int] | None = None, progress=None) -> ScalingResult:
    """Predict every point of a series (or the given (model, GPUs) `points`); `gpus` keeps only the
    points with those GPU counts. `batch`: global batch in sequences (default: the weak series, the
    model's; the strong series, the default study's). `progress(what, done, total)` is called before
    each point."""
    from twin.predict.simulate import SimulationConfig, simulate

    spec = load_system(system) if isinstance(system, str) else system
    pts = list(points) if points is not None else series_points(spec, series)
    if gpus:
        pts = [p for p in pts if p[1] in set(gpus)]
    if not pts:
        raise TwinError(f"the {series} series of {spec.name} has no point"
                        + (f" with {', '.join(map(str, gpus))} GPUs" if gpus else ""))
    if batch is None and series == "strong" and spec.default_batch:
        batch = spec.default_batch
    out, skipped, base = [], [], None
    for i, (model, n) in enumerate(pts):
        if progress is not None:
            progress(f"{model} on {n} GPUs", i, len(pts))
        try:
            r = simulate(SimulationConfig(spec, model, n, "auto", batch=batch, options=options, simulate_top=simulate_top))
        except TwinError as e:
            skipped.append(f"{model} on {n} GPUs: {e}")
            continue
        per_gpu = r.flops_per_s / n
        base = per_gpu if base is None else base
        out.append(ScalingPoint(model, n, r.global_batch, r.grid_str, r.iteration_time_s, r.flops_per_s,
                                r.percent_of_peak, 100.0 * per_gpu / base, r.breakdown_s, r.grid_choice))
    if not out:
        raise TwinError(f"no point of the {series} series runs on {spec.name}: " + "; ".join(skipped))
    return ScalingResult(spec.name, series, out, skipped)


def scaling_figure(result: ScalingResult):
    """A plotly figure: percent of peak and efficiency (percent) against GPUs (log axis)."""
    import plotly.graph_objects as go

    x = [p.gpus for p in result.points]
    labels = [f"{p.model}<br>{p.grid}<br>{p.iteration_s:.2f} s" for p in result.points]
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=x, y=[p.percent_of_peak for p in result.points], mode="lines+markers",
                             name="% of peak", text=labels, hovertemplate="%{x:,d} GPUs: %{y:.1f}%<br>%{text}"))
    fig.add_trace(go.Scatter(x=x, y=[p.efficiency for p in result.points], mode="lines+markers",
                             name="efficiency vs first point (%)", text=labels,
                             hovertemplate="%{x:,d} GPUs: %{y:.1f}%<br>%{text}"))
    fig.update_layout(title=f"{result.series} scaling on {result.system} (twin prediction)",
                      xaxis=dict(title="GPUs", type="log", tickvals=x, tickformat=",d"), yaxis=dict(title="percent", rangemode="tozero"),
                      template="plotly_white")
    return fig


def scaling_html(result: ScalingResult) -> str:
    """The figure as a self-contained HTML page (plotly embedded: opens offline)."""
    return scaling_figure(result).to_html(include_plotlyjs=True, full_html=True)
