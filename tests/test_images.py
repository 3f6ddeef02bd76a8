"""Images that cannot go stale: every image README.md and docs/*.md show is made by docs/make_images.py,
with a sidecar JSON of the figures it shows; these tests recompute those figures from the current
code (cheaply) and fail, saying what to run, when an image is out of date."""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import asdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
REMAKE = "the image is out of date: run `python docs/make_images.py {name}` and commit the image and its sidecar"


def _make_images():
    spec = importlib.util.spec_from_file_location("make_images", DOCS / "make_images.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _shown_images() -> set[str]:
    """Local images that the README and the docs pages show (paths relative to docs/)."""
    out = set()
    for page in [ROOT / "README.md", *DOCS.glob("*.md")]:
        for target in re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", page.read_text()):
            if "://" not in target:
                out.add(str((page.parent / target).resolve().relative_to(DOCS)))
    return out


def test_every_image_shown_is_made_by_the_script_with_a_sidecar():
    mk = _make_images()
    shown = _shown_images()
    assert shown, "no image found in README.md or docs/"
    assert shown <= set(mk.SIDECARS), f"images made by hand: {sorted(shown - set(mk.SIDECARS))} (add them to docs/make_images.py)"
    for image in shown:
        assert (DOCS / image).is_file() and (DOCS / mk.SIDECARS[image]).is_file(), image


def test_the_frontier_report_image_shows_todays_default_study():
    from twin.predict.simulate import SimulationConfig, simulate
    mk = _make_images()
    side = json.loads((DOCS / "frontier-report.json").read_text())
    now = mk.frontier_figures(simulate(SimulationConfig("frontier")))
    assert side["figures"] == now, REMAKE.format(name="frontier-report") + f"\nsidecar: {side['figures']}\nnow:     {now}"


def test_the_memorization_image_shows_the_studys_defaults_and_the_pages_table():
    pytest.importorskip("numpy")
    from backend.studies.study import StudyConfig
    side = json.loads((DOCS / "memorization.json").read_text())
    defaults = asdict(StudyConfig())
    for key, value in defaults.items():
        assert side["config"][key] == pytest.approx(value), (key, REMAKE.format(name="memorization --train"))
    page = (DOCS / "memorization.md").read_text()
    recs = {(r["loss"], r["epoch"]): r for r in side["records"]}
    rows = re.findall(r"^\| (\d+) \| ([\d.]+)% \(([\d.]+) / ([\d.]+)\) \| ([\d.]+)% \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) / ([\d.]+) \|$",
                      page, re.M)
    assert rows, "docs/memorization.md has no table of the study"
    for epoch, em, canary, text, gold_em, rouge, gold_rouge, loss, gold_loss in rows:
        std, gold = recs["standard", int(epoch)], recs["goldfish", int(epoch)]
        assert float(em) == pytest.approx(100 * std["exact_match"], abs=0.06)
        assert float(canary) == pytest.approx(100 * std["canary_exact_match"], abs=0.06)
        assert float(text) == pytest.approx(100 * std["text_exact_match"], abs=0.06)
        assert float(gold_em) == pytest.approx(100 * gold["exact_match"], abs=0.06)
        assert float(rouge) == pytest.approx(std["rouge_l"], abs=6e-4)
        assert float(gold_rouge) == pytest.approx(gold["rouge_l"], abs=6e-4)
        assert float(loss) == pytest.approx(std["held_out_loss"], abs=6e-4)
        assert float(gold_loss) == pytest.approx(gold["held_out_loss"], abs=6e-4)


def test_the_sweep_chart_shows_todays_predictions():
    """One point of the README's sweep (gpt-20b on 1,024 GCDs at today's NIC rate), predicted again."""
    from twin.predict.simulate import SimulationConfig, simulate
    side = json.loads((DOCS / "sweep-nic.json").read_text())
    point = next(p for p in side["points"] if p["gpus"] == 1024 and p["nic_bandwidth"] == 25e9)
    r = simulate(SimulationConfig("frontier", "gpt-20b", 1024, "auto", batch=4096, simulate_top=1))
    assert (r.grid_str, round(r.percent_of_peak, 2)) == (point["grid"], point["percent_of_peak"]), \
        REMAKE.format(name="sweep-nic")
