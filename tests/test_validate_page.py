"""The validation page's words and tables (calibration.validate_page), from a report made up to the
figures each line should give; the page itself is opened in a browser by tests/test_pages.py."""

from __future__ import annotations

from calibration.validate_page import grid_rows, kind_rows, summary_lines, validation_html
from calibration.validate_summary import CPU_TARGETS, GPU_TARGETS


def run(grid: str, measured: float, predicted: float, op_error: float, mem_error: float, repeats: int = 2) -> dict:
    ops = [{"name": "l0.fwd.fc1", "kind": "gemm", "measured_s": 0.01, "predicted_s": 0.01 * (1 + op_error),
            "error": op_error, "wall_s": 0.01},
           {"name": "l0.fwd.ar_x", "kind": "all_reduce", "measured_s": 0.02, "predicted_s": 0.02, "error": 0.0,
            "wall_s": 0.02, "peer_wait_s": 0.005}]
    return {"grid": grid, "model": "gpt-small", "system": "cpu", "profile": "cpu", "repeats": repeats,
            "iteration": {"measured_s": measured, "predicted_s": predicted, "error": predicted / measured - 1,
                          "spread": 0.1},
            "ops": {"median_abs_error": abs(op_error), "compute_median_abs_error": abs(op_error), "stretch": 2.0,
                    "stretch_predicted": 2.2},
            "memory": {"measured_bytes": 2**20 * 100, "predicted_bytes": 2**20 * 100 * (1 + mem_error),
                       "error": mem_error},
            "per_op": ops}


REPORT = {"runs": [run("1x1x1x1", 1.0, 1.04, 0.05, 0.01), run("2x1x1x1", 1.0, 1.30, 0.25, -0.02),
                   run("1x1x2x1", 2.0, 1.80, 0.10, 0.15)], "spearman": 1.0, "repeats": 6}


def test_the_summary_counts_what_meets_each_target_and_names_the_worst():
    lines = summary_lines(REPORT, CPU_TARGETS)
    assert lines[0].startswith("Iteration time: median |error| 10.0 %; 2 of 3 grids within 15 % (worst 2x1x1x1, +30 %)")
    assert "2 of 3 within 20 % (worst 2x1x1x1, 25 %)" in lines[1]
    assert "2 of 3 within 10 % (worst 1x1x2x1, +15 %)" in lines[2]
    assert "Spearman 1.00 over 3 grids" in lines[3]
    assert "median of 10 %" in lines[4]
    assert "1 of 3 grids within 5 %" in summary_lines(REPORT, GPU_TARGETS)[0]  # a GPU's targets are tighter
    assert len(lines) == 5  # no noise figures in the report: no line for them
    noise = {"target": 0.15, "run_log_sd": 0.139, "halves_within": 31, "halves_grids": 35, "repeats": 4,
             "grids": 35, "exact_model_within": 33.3, "exact_model_all": 0.19}
    last = summary_lines({**REPORT, "noise": noise}, CPU_TARGETS)[-1]
    assert "within 15 % on 31 of 35 grids" in last and "33.3 of 35 within 15 % (all of them 19 %" in last


def test_the_cells_past_their_target_are_marked():
    header, rows, over = grid_rows(REPORT["runs"], CPU_TARGETS)
    assert len(rows) == 3 and all(len(r) == len(header) for r in rows)
    error, per_op, memory = header.index("error"), header.index("per-op median |error|"), header.index("memory error")
    assert over == {(1, error), (1, per_op), (2, memory)}
    assert rows[0][memory] == "+1 %" and rows[1][error] == "+30 %"


def test_kinds_are_pooled_over_runs_and_the_page_holds_both_tables():
    header, rows = kind_rows(REPORT["runs"])
    by = {r[0]: dict(zip(header, r)) for r in rows}
    assert by["gemm"]["ops"] == "3" and by["gemm"]["median |error|"] == "10 %"
    assert by["all_reduce"]["waiting for the last member"] == "25 %" and by["gemm"]["waiting for the last member"] == "-"
    page = validation_html(REPORT)
    assert page.count("<table>") == 2 and "plot-iteration" in page and "plot-ops" in page
    assert "<td class=over>+30 %</td>" in page
