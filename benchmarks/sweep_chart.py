"""The README's sweep chart: runs (or resumes) docs/sweep-nic.toml, draws days to train under failures
against GCDs, one line per NIC rate, and writes docs/sweep-nic.png (a headless Chromium screenshot of
the plotly figure) and docs/sweep-nic.json (the figures the chart shows).

    python benchmarks/sweep_chart.py [--out-dir docs] [--results sweep-nic.csv]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default=str(ROOT / "docs"))
    ap.add_argument("--results", default=str(Path(tempfile.gettempdir()) / "sweep-nic.csv"))
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    subprocess.run([sys.executable, "-m", "twin.cli", "sweep", str(ROOT / "docs/sweep-nic.toml"), "--quiet",
                    "--out", a.results], cwd=ROOT, check=True)
    import plotly.graph_objects as go
    from twin.sweep.results import read_rows

    rows = [r for r in read_rows(a.results)[1] if r["status"] == "ok"]
    fig = go.Figure()
    shown = []
    for nic in sorted({float(r["node.nic_bandwidth"]) for r in rows}):
        line = sorted((r for r in rows if float(r["node.nic_bandwidth"]) == nic), key=lambda r: int(r["gpus"]))
        fig.add_trace(go.Scatter(x=[int(r["gpus"]) for r in line], y=[float(r["wall_days"]) for r in line],
                                 mode="lines+markers+text", name=f"NIC {nic / 1e9:g} GB/s",
                                 text=[f"{float(r['percent_of_peak']):.0f}%" for r in line],
                                 textposition="top right"))
        shown += [{"gpus": int(r["gpus"]), "nic_bandwidth": nic, "grid": r["grid"],
                   "wall_days": round(float(r["wall_days"]), 3), "train_days": round(float(r["train_days"]), 3),
                   "goodput": round(float(r["goodput"]), 4), "percent_of_peak": round(float(r["percent_of_peak"]), 2),
                   "wall_gpu_hours": round(float(r["wall_gpu_hours"]))} for r in line]
    fig.update_layout(title="gpt-20b on Frontier, 1e12 tokens: days to train under failures (labels: % of peak)",
                      xaxis=dict(title="GCDs", type="log", tickvals=sorted({s["gpus"] for s in shown}),
                                 ticktext=[f"{g:,}" for g in sorted({s["gpus"] for s in shown})]),
                      yaxis=dict(title="days (checkpoint every 30 min, node MTBF assumed)", type="log"),
                      width=900, height=480, template="plotly_white", margin=dict(l=70, r=30, t=60, b=60))
    out = Path(a.out_dir)
    with tempfile.TemporaryDirectory() as tmp:
        page = Path(tmp) / "chart.html"
        fig.write_html(page, include_plotlyjs=True, config={"displayModeBar": False})
        from playwright.sync_api import sync_playwright
        chromium = shutil.which("chromium") or "/usr/bin/chromium"
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, headless=True, args=["--no-sandbox"])
            p = browser.new_page(viewport={"width": 920, "height": 500})
            p.goto(page.as_uri())
            p.wait_for_selector(".js-plotly-plot .scatterlayer")
            p.locator(".js-plotly-plot").screenshot(path=str(out / "sweep-nic.png"))
            browser.close()
    (out / "sweep-nic.json").write_text(json.dumps({"sweep": "docs/sweep-nic.toml", "made_by": "python docs/make_images.py sweep-nic",
                                                    "points": shown}, indent=1) + "\n")
    print(f"wrote {out / 'sweep-nic.png'} and {out / 'sweep-nic.json'}")


if __name__ == "__main__":
    main()
