"""Summarize a benchmarks/gpu_check.sh run: GEMM peak, tokens/s and flop/s of each run, % of peak.

    python benchmarks/gpu_check_summary.py WORK_DIR [OUT_DIR]   # writes WORK_DIR/gpu_check.json, prints it

OUT_DIR is where gpu_check.sh leaves its tarball of WORK_DIR (default WORK_DIR): the printed line
that commits the check's files extracts them from it.

Throughput averages skip the first steps (CUDA warm-up, GEMM layout tuning) and the traced last step.
Flop conventions: `flops_per_s` is ModelSpec.reference_flops (Narayanan et al. SC'21) with the
recomputed forward counted when the run recomputes (the AxoNN convention); `model_flops_per_s` never
counts it (useful work only). Target: flops_per_s >= 50% of the measured bf16 GEMM peak.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TARGET = 0.5
SKIP = 3  # first steps left out of the averages


def run_summary(run_dir: Path, peak: float | None) -> dict | None:
    log = run_dir / "log.jsonl"
    if not log.is_file():
        return None
    recs = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    steady = recs[SKIP:-1] or recs[1:] or recs
    if not steady:
        return None

    def mean(key: str) -> float:
        return sum(r[key] for r in steady) / len(steady)

    out = {"run": run_dir.name, "steps": len(recs), "steps_averaged": len(steady),
           "first_loss": recs[0]["loss"], "last_loss": recs[-1]["loss"],
           "step_time_s": mean("step_time_s"), "tokens_per_s": mean("tokens_per_s"),
           "flops_per_s": mean("flops_per_s"), "model_flops_per_s": mean("model_flops_per_s"),
           "flops_convention": recs[-1]["flops_convention"]}
    if peak:
        out["fraction_of_gemm_peak"] = out["flops_per_s"] / peak
        out["model_fraction_of_gemm_peak"] = out["model_flops_per_s"] / peak
        out["meets_target"] = out["fraction_of_gemm_peak"] >= TARGET
    return out


def replay_summary(trace: Path, peak: float | None) -> dict:
    """GEMM time of the replayed program's traced iteration (rank 0) and its flop rate."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from twin.program.trace import read_trace

    gemms = [s for s in read_trace(trace) if s.kind == "gemm" and s.rank == 0]
    seconds = sum(s.duration_s for s in gemms)
    flops = sum(2.0 * s.args["m"] * s.args["n"] * s.args["k"] for s in gemms)
    out = {"gemms": len(gemms), "gemm_seconds": seconds, "gemm_flops_per_s": flops / seconds if seconds else 0.0}
    if peak:
        out["fraction_of_gemm_peak"] = out["gemm_flops_per_s"] / peak
    return out


def main(out_dir: str) -> dict:
    out = Path(out_dir)
    result: dict = {"target_fraction_of_gemm_peak": TARGET}
    env = out / "environment.txt"
    commits = [line.split()[1] for line in env.read_text().splitlines()
               if line.startswith("commit ")] if env.is_file() else []
    if commits:
        result["commit"] = commits[0]
    gemm_file = out / "gemm.json"
    peak = None
    if gemm_file.is_file():
        gemm = json.loads(gemm_file.read_text())
        result["machine"] = gemm["machine"]
        rows = gemm["gemm"]
        squares = [r for r in rows if r["m"] == r["n"] == r["k"]]
        if squares:
            best = max(squares, key=lambda r: r["tflops"])
            peak = best["tflops"] * 1e12
            result["gemm_peak"] = {"flops_per_s": peak, "shape": f"{best['m']}^3", "layout": best["layout"],
                                   "dtype": best["dtype"]}
        result["gemm_table"] = rows
    result["runs"] = [s for s in (run_summary(d, peak) for d in sorted(out.glob("run_*")) if d.is_dir()) if s]
    if (out / "pytest_gpu.rc").is_file():
        log = (out / "pytest_gpu.log").read_text().strip().splitlines() if (out / "pytest_gpu.log").is_file() else []
        result["gpu_tests"] = {"exit_code": int((out / "pytest_gpu.rc").read_text().strip() or -1),
                               "last_line": log[-1] if log else ""}
    if (out / "replay_trace").is_dir():
        result["replay"] = replay_summary(out / "replay_trace", peak)
    (out / "gpu_check.json").write_text(json.dumps(result, indent=1))
    return result


KEPT = ("gpu_check.json", "environment.txt", "gemm.json", "profile", "validate.json")  # what to commit


def commit_dir(result: dict) -> str:
    """calibration/measurements/gpu-<device>-<date>/, the folder this check's files are committed to."""
    machine = result.get("machine", {})
    device = machine.get("gpu") or machine.get("cpu") or "unknown"
    slug = "".join(c if c.isalnum() else "-" for c in device.lower()).strip("-")
    while "--" in slug:
        slug = slug.replace("--", "-")
    date = machine.get("date", "")[:10] or "undated"
    return f"calibration/measurements/gpu-{slug}-{date}"


def keep_command(result: dict, work: Path, out_dir: str) -> str:
    """The shell line that commits this check (its summary, bench measurement, fitted profile and
    validation report, those of KEPT that `work` holds) from the tarball gpu_check.sh leaves in
    `out_dir` (where the files come back)."""
    folder = commit_dir(result)
    members = " ".join(f"./{name}" for name in KEPT if (work / name).exists())
    device = result.get("machine", {}).get("gpu") or "a CPU (dry run)"
    return (f"mkdir -p {folder} && tar -xzf {out_dir}/gpu_check_files.tar.gz -C {folder} {members} && "
            f"git add {folder} && git commit -m 'GPU check on {device}: bench, fitted profile, validation'")


if __name__ == "__main__":
    work_dir = sys.argv[1] if len(sys.argv) > 1 else "gpu_check_out"
    res = main(work_dir)
    brief = {k: v for k, v in res.items() if k != "gemm_table"}
    print(json.dumps(brief, indent=1))
    print(f"\nto keep it (from the repository root):\n  "
          f"{keep_command(res, Path(work_dir), sys.argv[2] if len(sys.argv) > 2 else work_dir)}")
