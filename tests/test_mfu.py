"""perf/mfu never exceeds 1, whatever the peak it is read against, and says where the peak came from."""

import warnings

import pytest
import torch

from hpsft.utils.perf import PeakFlops, device_peak, measure_matmul_peak
from tests.conftest import base_overrides, read_metrics, run_cli

CPU = torch.device("cpu")
SHAPE = (64, 32, 48)  # rows, hidden, intermediate of a measured GEMM


def test_a_disturbed_measurement_is_measured_again_then_raised_to_the_achieved_rate():
    readings = iter([1e9, 4e9])  # the first measurement disturbed (too low), the second not
    peak = PeakFlops.measured(lambda: next(readings), "test GEMM")
    assert peak.value == 1e9 and "measured" in peak.source
    assert peak.covering(0.5e9) == 1e9  # below the peak: nothing happens
    assert peak.covering(3e9) == 4e9  # above: measured again, the larger reading stands
    with pytest.warns(UserWarning, match="raised to the step's rate"):
        assert peak.covering(5e9) == 5e9  # above even the second: raised, with a warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once only; never measured a third time
        assert peak.covering(6e9) == 6e9
        assert peak.covering(2e9) == 6e9
    for achieved in (0.5e9, 3e9, 5e9, 6e9, 2e9):
        assert achieved / peak.covering(achieved) <= 1


def test_mfu_stays_at_most_one_against_a_real_but_disturbed_measurement():
    """The 'peak' is a real GEMM too small to be efficient (as a disturbed start-up trial would
    read low); a step running at a real large GEMM's rate beats it: it is measured again, then
    raised to the step's rate with a warning, so the reading is exactly 1."""
    peak = PeakFlops.measured(lambda: measure_matmul_peak(4, 4, 4, torch.float32, CPU, 2, 0.01), "tiny GEMM")
    achieved = measure_matmul_peak(256, 256, 256, torch.float32, CPU, 2, 0.05)
    assert achieved > 2 * peak.value  # the disturbance is real
    with pytest.warns(UserWarning, match="raised to the step's rate"):
        assert achieved / peak.covering(achieved) == 1.0
    assert peak.remeasure is None  # measured again once, and only once


def test_a_configured_peak_is_never_measured():
    peak = PeakFlops.configured(2e9)
    assert "trainer.peak_flops_per_device" in peak.source
    with pytest.warns(UserWarning, match="trainer.peak_flops_per_device"):
        assert peak.covering(3e9) == 3e9
    with pytest.raises(ValueError, match="positive"):
        PeakFlops.configured(0.0)


def test_the_peak_is_configured_else_a_known_accelerators_datasheet_else_measured():
    assert device_peak(2e9, CPU, torch.float32, SHAPE, device_name="NVIDIA H200").value == 2e9  # the override wins
    h100 = device_peak(None, CPU, torch.bfloat16, SHAPE, device_name="NVIDIA H100 80GB HBM3")
    assert h100.value == 989.5e12 and h100.source.startswith("datasheet dense peak of NVIDIA H100 80GB HBM3")
    assert device_peak(None, CPU, torch.bfloat16, SHAPE, device_name="NVIDIA H100 PCIe").value == 756.5e12
    assert device_peak(None, CPU, torch.float16, SHAPE, device_name="NVIDIA A100-SXM4-80GB").value == 312e12
    assert device_peak(None, CPU, torch.bfloat16, SHAPE, device_name="NVIDIA L40S").value == 366.5e12
    assert device_peak(None, CPU, torch.bfloat16, SHAPE, device_name="NVIDIA L4").value == 121e12
    # fp32 matmuls: CUDA cores, or TF32 tensor cores when torch is allowed to use them
    assert device_peak(None, CPU, torch.float32, SHAPE, device_name="NVIDIA A100-PCIE-40GB").value == 19.5e12
    precision = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert device_peak(None, CPU, torch.float32, SHAPE, device_name="NVIDIA A100-PCIE-40GB").value == 156e12
    finally:
        torch.set_float32_matmul_precision(precision)
    # Unknown names (A10G is not A10; no GPU at all) fall back to a real GEMM on the device.
    for name in ("NVIDIA A10G", None):
        peak = device_peak(None, CPU, torch.float32, SHAPE, device_name=name)
        assert peak.source.startswith("measured") and "64x32x48" in peak.source and peak.remeasure is not None


def test_the_measured_peak_is_a_median_of_real_gemms():
    rate = measure_matmul_peak(*SHAPE, torch.float32, CPU, trials=3, seconds_per_trial=0.02)
    assert 1e6 < rate < 1e14  # FLOP/s of a real GEMM on a CPU


def test_training_with_a_far_too_low_peak_logs_mfu_at_most_one(tmp_path, model_path, tiny_data):
    train, val = tiny_data
    out_dir = tmp_path / "run"
    result = run_cli("hpsft.train", base_overrides(model_path, train, None, out_dir, **{
        "trainer.total_steps": 2, "trainer.export_hf": "false", "trainer.peak_flops_per_device": 1e6}))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "MFU peak per device: trainer.peak_flops_per_device = 1e+06 FLOP/s" in result.stdout
    assert "raised to the step's rate" in result.stderr
    mfus = [m["perf/mfu"] for m in read_metrics(out_dir) if "perf/mfu" in m]
    assert len(mfus) == 2 and all(0 < mfu <= 1 for mfu in mfus), mfus
