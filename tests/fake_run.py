"""A run folder as `backend run --out` writes it (trace/, log.jsonl, summary.json), made in a moment by
the twin (its trace has the backend's schema): for tests of what reads runs (`twin validate`, the report)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path


def fake_run(folder: Path, grid: str = "2x1x1x1", step_time_s: float = 0.05, steps: int = 4,
             peaks: list[int] | None = None) -> Path:
    from twin.program.grid import Grid
    from twin.program.program import Options
    from twin.predict.simulate import SimulationConfig, simulate
    from twin.program.trace import write_trace

    r = simulate(SimulationConfig("cpu", "gpt-tiny", Grid.parse(grid).size, grid, record=True))
    write_trace(folder / "trace", r.spans, {"model": "gpt-tiny", "grid": grid, "options": dataclasses.asdict(Options())})
    (folder / "log.jsonl").write_text("".join(
        json.dumps({"step": i, "step_time_s": step_time_s, "tokens_per_s": 256 / step_time_s, "loss": 5.5}) + "\n"
        for i in range(1, steps + 1)))
    (folder / "summary.json").write_text(json.dumps({"memory_peak_bytes": peaks or [2_000_000] * Grid.parse(grid).size}))
    return folder
