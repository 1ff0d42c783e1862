"""The `ep-runtime plan` command (topology.report.main) and the synthetic load file writer."""

import json
from pathlib import Path

import pytest

from topology import report, synthetic

EXAMPLES = Path(__file__).resolve().parents[2] / "topology" / "examples"


def test_plan_command_compares_and_draws(tmp_path, capsys):
    load = tmp_path / "load.json"
    assert synthetic.main(["--out", str(load), "--routes", str(tmp_path / "routes.pt"), "--layers", "2",
                           "--experts", "64", "--tokens", "256", "--zipf", "1.2"]) == 0
    png = tmp_path / "placement.png"
    out_json = tmp_path / "plan.json"
    assert report.main(["--topology", str(EXAMPLES / "h100-4x8.yaml"), "--load", str(load), "--physical", "96",
                        "--compare", "--png", str(png), "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    for name in ("locality", "eplb_global", "eplb_hierarchical", "greedy", "none"):
        assert name in text
    assert "measured routes" in text and "remote nodes" in text
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    doc = json.loads(out_json.read_text())
    assert len(doc["phy2log"]) == 2 and len(doc["phy2log"][0]) == 96


def test_plan_command_reports_bad_input(tmp_path):
    """Every bad file, load or size ends the program with one line naming what is wrong."""
    load, pcie = tmp_path / "load.json", str(EXAMPLES / "pcie-2x4.json")
    load.write_text(json.dumps({"load": [[1.0, -1.0]]}))
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("gpus: [1,\n")
    for args, message in [
        (["--topology", pcie, "--load", str(load)], "load: expected values >= 0"),
        (["--topology", pcie, "--load", str(tmp_path / "nope.json")], "--load"),
        (["--topology", str(bad_yaml), "--load", str(load)], f"--topology {bad_yaml}: ParserError"),
        (["--topology", str(tmp_path / "nope.yaml"), "--load", str(load)], "--topology"),
    ]:
        with pytest.raises(SystemExit, match=f"^ep-runtime plan: {message}"):
            report.main(args)
    load.write_text(json.dumps({"weights": []}))
    with pytest.raises(SystemExit, match="^ep-runtime plan: --load .*load"):
        report.main(["--topology", pcie, "--load", str(load)])
    load.write_text(json.dumps({"load": [[1.0, 2.0, 3.0]]}))
    with pytest.raises(SystemExit, match="^--physical: expected a multiple of the 8 GPUs and at least the 3 experts"):
        report.main(["--topology", pcie, "--load", str(load), "--physical", "12"])


def test_plan_command_default_physical_experts_fill_whole_gpus(tmp_path, capsys):
    """3 experts on 8 GPUs: one slot a GPU for the experts, one for replicas (16), not E + GPUs = 11."""
    load, out_json = tmp_path / "load.json", tmp_path / "plan.json"
    load.write_text(json.dumps({"load": [[1.0, 2.0, 3.0]]}))
    assert report.main(["--topology", str(EXAMPLES / "pcie-2x4.json"), "--load", str(load), "--json",
                        str(out_json)]) == 0
    assert len(json.loads(out_json.read_text())["phy2log"][0]) == 16
