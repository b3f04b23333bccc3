"""The prepared GPU check's own logic on the CPU (benchmarks/gpu_check.py): the device's peak
bandwidth from its name, the bytes each kernel must move, the greedy comparison's rule, and
the whole check end to end on a tiny shape (triton interpreted, the engine's ranks on the CPU),
which writes its report. No figure of it is a measurement: GPU figures stay unmeasured until a
GPU runs it (docs/kernels.md, "GPU figures")."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


@pytest.fixture
def check(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The script as a module; the sys.path entry it adds is taken back afterwards."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 3350.0),
        ("NVIDIA H100 PCIe", 2000.0),
        ("NVIDIA H200", 4800.0),
        ("NVIDIA A100-SXM4-80GB", 2039.0),
        ("Tesla T4", None),
    ],
)
def test_the_peak_bandwidth_comes_from_the_device_name(check: ModuleType, name: str, peak: float | None) -> None:
    assert check.peak_gbps(name) == peak


def test_the_bytes_each_kernel_must_move(check: ModuleType) -> None:
    # K and V of 2 sequences x 10 tokens x 2 KV heads x 8 dims in bf16, then q and the output of 4 heads.
    assert (
        check.paged_decode_bytes(seqs=2, context=10, heads=4, kv_heads=2, head_dim=8, element=2)
        == 2 * 2 * 10 * 2 * 8 * 2 + 2 * 2 * 4 * 8 * 2
    )
    # x; 5 adapters' A of 2 slices, rank 4, 16 inputs; the fp32 result.
    assert check.shrink_bytes(tokens=3, in_features=16, rank=4, slices=2, adapters=5, element=2) == 96 + 1280 + 96
    # the fp32 shrink; 5 adapters' B of 8 + 4 outputs; out read and written.
    assert check.expand_bytes(tokens=3, widths=(8, 4), rank=4, adapters=5, element=2) == 96 + 480 + 144
    assert check.gbps(2_000_000_000, 0.5) == 4.0
    tiny = check.MODEL_SHAPES["tiny"]
    layer = sum(out * inp for out, inp in tiny.module_shapes().values())
    assert check.weight_bytes(tiny, 2) == 2 * (tiny.num_layers * layer + tiny.vocab_size * tiny.hidden_size)


def test_the_8b_shape_is_llama_3_8b(check: ModuleType) -> None:
    shape = check.MODEL_SHAPES["8b"]
    parameters = check.weight_bytes(shape, 1) + shape.vocab_size * shape.hidden_size  # plus the embedding
    assert 7.9e9 < parameters < 8.1e9


def test_a_greedy_difference_counts_only_where_the_reference_was_sure(check: ModuleType) -> None:
    sure, close = 1.0, check.GREEDY_MARGIN / 2
    assert check.first_real_difference([(1, sure), (2, sure)], [(1, sure), (2, sure)]) is None
    assert check.first_real_difference([(1, sure), (3, sure)], [(1, sure), (2, sure)]) == 1
    # A close call parts the sequences: what follows is not compared.
    assert check.first_real_difference([(1, sure), (3, sure), (9, sure)], [(1, sure), (2, close), (4, sure)]) is None


def test_the_report_shows_the_fraction_of_the_peak_and_every_failure(check: ModuleType) -> None:
    report = check.Report("a device", 2000.0)
    assert report.fraction(500.0) == "25.0%"
    assert check.Report("a device", None).fraction(500.0) == "n/a"
    check.kernel_row(report, "shrink", 1_000_000, 0.001, 0.5, 1e-2)
    assert "| shrink | 1.0 | 1000.0 | 1 | 0.1% | 5.0e-01 |" in report.text()
    assert "FAILED: shrink: differs from the torch path by 5.0e-01 (limit 1e-02)" in report.text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with a GPU runs the check itself")
def test_without_a_gpu_the_check_says_how_to_run_its_own_logic(check: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        check.parse_args([])
    assert "--device cpu --shape tiny" in capsys.readouterr().err


def test_the_whole_check_runs_on_a_tiny_shape_on_the_cpu(check: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    argv = ["--device", "cpu", "--shape", "tiny", "--out", str(tmp_path), "--steps", "2", "--context", "40", "--new-tokens", "4"]
    assert check.main([*argv, "--peak-gbps", "100"]) == 0
    report = (tmp_path / "report.md").read_text()
    assert "all checks passed" in report and "FAILED" not in report
    for heading in ("## (1) kernels", "## (2) decode", "## (3) greedy tokens"):
        assert heading in report
    assert report.count("| paged decode, 8 seqs x 40 tokens |") == 1 and "| shrink, qkv, 8 adapters, 8 tokens |" in report
    assert "8 adapters cost" in report and report.count("- request ") == 4
