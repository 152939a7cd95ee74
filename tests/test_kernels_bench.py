"""``mmspec bench kernels``: the JSON rows' schema, correctness from the interpreter, and the
projected rows' arithmetic."""

from __future__ import annotations

import json

import pytest
import torch

from mmspec import cli
from mmspec.bench import kernels as bench
from mmspec.kernels import dispatch

ROW_KEYS = {"kernel", "shape", "dtype", "max_abs_err", "tolerance", "correct", "reference_ms", "projected"}


def test_projected_tree_attention_is_the_stated_arithmetic():
    """EAGLE-2's 60 nodes over 4,096 cached tokens, 32 heads of 128, fp16: q, o, k, v and the
    (1, 60, 60) tree mask once; 4 T S D FLOPs per head."""
    row = bench.project_tree_attention()
    S = 4096 + 60
    assert row["bytes"] == 2 * 32 * 60 * 128 * 2 + 2 * 32 * S * 128 * 2 + 60 * 60
    assert row["flops"] == 4 * 32 * 60 * S * 128
    assert row["h100_memory_us"] == pytest.approx(1e6 * row["bytes"] / bench.H100["hbm_bytes_per_s"])
    assert row["h100_us"] == max(row["h100_memory_us"], row["h100_compute_us"], row["h100_sfu_us"])
    assert row["bound"] == "memory" and row["projected"] is True
    # the torch path reads the same tensors plus the dense mask, in two launches
    assert row["torch_bytes"] > row["bytes"] and row["torch_launches"] == 2


def test_projections_say_where_fusion_pays():
    """The fused rotation pays for a tree block over a token cache and not for a long video chunk
    (every query tile re-rotates every key): why the dispatcher keeps long blocks on the reference."""
    tokens, video = bench.project_rolling_tokens(), bench.project_rolling_video()
    assert tokens["inputs"]["query_tiles"] == 1 and tokens["projected_speedup"] > 1.5
    assert video["inputs"]["queries"] == 3 * 1560 and video["inputs"]["keys"] == 24 * 1560
    assert video["bound"] == "sfu" and video["projected_speedup"] < 1
    accept = bench.project_guided_accept()
    assert accept["inputs"]["vocab"] == 16384 and accept["torch_launches"] > 2 * accept["launches"]
    assert accept["torch_bytes"] > 5 * accept["bytes"]


@pytest.mark.skipif(not dispatch.TRITON_AVAILABLE, reason="triton is not installed (torch's CPU-only wheels, e.g. on aarch64, come without it)")
def test_cli_writes_measured_and_projected_rows(tmp_path, monkeypatch, capsys):
    """Two small cases (to keep the interpreter run short) through ``mmspec bench kernels --json``."""
    full = bench.measured_cases
    monkeypatch.setattr(bench, "measured_cases", lambda seed: [full(seed)[0], full(seed)[4]])
    out = tmp_path / "kernels.json"
    assert cli.main(["bench", "kernels", "--json", str(out), "--quick", "--quiet"]) == 0
    result = json.loads(out.read_text())
    assert result["bench"] == "kernels"
    rows = result["rows"]
    assert all(ROW_KEYS <= set(row) for row in rows)
    measured = [r for r in rows if not r["projected"]]
    assert [(r["kernel"], r["dtype"]) for r in measured] == [("tree_attention", "float32"),
                                                              ("tree_attention", "float16"),
                                                              ("guided_accept", "float32")]
    for row in measured:
        assert row["correct"] is True and row["max_abs_err"] <= row["tolerance"] and row["reference_ms"] > 0
    assert measured[2]["decisions_equal"] is True
    projected = [r for r in rows if r["projected"]]
    assert {r["kernel"] for r in projected} == {"tree_attention", "rolling_attention", "guided_accept"}
    assert all(r["inputs"] and r["h100_us"] > 0 and r["reference_ms"] is None for r in projected)
    assert "tree_attention" in capsys.readouterr().out


def test_attention_tolerance_follows_the_tests():
    """fp32 a fixed 2e-6; fp16 twice torch's own fp16 error plus a quarter ulp at the outputs' scale."""
    case = bench.measured_cases(0)[0]
    ref = __import__("mmspec.kernels", fromlist=["tree_attention_reference"]).tree_attention_reference
    exact = ref(**case["inputs"])
    assert bench._attention_tolerance(ref, case["inputs"], exact, torch.float32) == 2e-6
    tol = bench._attention_tolerance(ref, case["inputs"], exact, torch.float16)
    torch_err = (ref(**bench._cast(case["inputs"], torch.float16)).float() - exact).abs().max().item()
    assert tol == pytest.approx(2 * torch_err + 2.5e-4 * exact.abs().max().item())
