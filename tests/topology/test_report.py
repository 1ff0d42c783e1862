"""The `ep-runtime plan` command (topology.report.main) and the synthetic load file writer."""

import json
from pathlib import Path

import pytest
import torch

from topology import Topology, plan_from_phy2log, report, synthetic

EXAMPLES = Path(__file__).resolve().parents[2] / "topology" / "examples"


def test_plan_command_compares_and_draws(tmp_path, capsys):
    load = tmp_path / "load.json"
    assert synthetic.main(["--out", str(load), "--routes", str(tmp_path / "routes.pt"), "--held-out",
                           str(tmp_path / "held.pt"), "--layers", "2", "--experts", "64", "--tokens", "256",
                           "--zipf", "1.2"]) == 0
    png = tmp_path / "placement.png"
    out_json = tmp_path / "plan.json"
    assert report.main(["--topology", str(EXAMPLES / "h100-4x8.yaml"), "--load", str(load), "--physical", "96",
                        "--compare", "--png", str(png), "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    for name in ("locality", "eplb_global", "eplb_hierarchical", "greedy", "none"):
        assert name in text
    assert "judged on 256 tokens a layer, held out: the file's held_out_routes" in text and "remote nodes" in text
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    doc = json.loads(out_json.read_text())
    assert len(doc["phy2log"]) == 2 and len(doc["phy2log"][0]) == 96
    assert doc["judged_on"] == "held out: the file's held_out_routes"
    # The figures are the held-out routes' own count, not the fitted load's.
    plan_ = plan_from_phy2log(torch.tensor(doc["phy2log"]), torch.ones(2, 64), Topology.from_file(
        EXAMPLES / "h100-4x8.yaml"), traffic=None)
    judged = plan_.evaluate(torch.load(tmp_path / "held.pt").long())
    assert doc["balance_per_layer"] == judged.balance_L.tolist()
    assert doc["balance_per_layer"] != doc["fitted_balance_per_layer"]


def test_plan_command_judges_on_tokens_it_did_not_plan_from(tmp_path):
    """--held-out wins over the file's held-out routes; without either, the routes split in halves;
    a load without routes is judged on drawn tokens, and the report says they are not held out."""
    load, nxt = tmp_path / "load.json", tmp_path / "next.json"
    common = ["--layers", "1", "--experts", "32", "--groups", "4", "--tokens", "200"]
    synthetic.main(["--out", str(load), "--routes", str(tmp_path / "r.pt"), *common])
    synthetic.main(["--out", str(nxt), "--routes", str(tmp_path / "n.pt"), "--seed", "5", *common])
    doc = report._read_load(str(load))
    routes = doc["routes"]
    fit, judged, source = report.judging_routes(doc, report._read_load(str(nxt)))
    assert torch.equal(fit, doc["load"]) and torch.equal(judged, torch.load(tmp_path / "n.pt").long())
    assert source.startswith("held out: the routes of --held-out")
    fit, judged, source = report.judging_routes(doc, None)
    assert torch.equal(judged, routes[:, 100:]) and torch.equal(fit, synthetic.route_load(routes[:, :100], 32))
    assert source.startswith("held out: the second half")
    _, judged, source = report.judging_routes({"load": doc["load"], "expert_groups": 4, "topk": 8}, None)
    assert source.startswith("NOT held out") and judged.shape == (1, 4096, 8)


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
    routes = tmp_path / "routes.pt"  # a routes file where the held-out load JSON belongs
    torch.save(torch.zeros(4, 2, dtype=torch.long), routes)
    with pytest.raises(SystemExit, match=f"^ep-runtime plan: --held-out {routes}: .*expected a load JSON"):
        report.main(["--topology", pcie, "--load", str(load), "--held-out", str(routes)])
    with pytest.raises(SystemExit, match="^--physical: expected a multiple of the 8 GPUs and at least the 3 experts"):
        report.main(["--topology", pcie, "--load", str(load), "--physical", "12"])


def test_plan_command_default_physical_experts_fill_whole_gpus(tmp_path, capsys):
    """3 experts on 8 GPUs: one slot a GPU for the experts, one for replicas (16), not E + GPUs = 11."""
    load, out_json = tmp_path / "load.json", tmp_path / "plan.json"
    load.write_text(json.dumps({"load": [[1.0, 2.0, 3.0]]}))
    assert report.main(["--topology", str(EXAMPLES / "pcie-2x4.json"), "--load", str(load), "--json",
                        str(out_json)]) == 0
    assert len(json.loads(out_json.read_text())["phy2log"][0]) == 16
