"""Throughput accounting: model FLOPs of a packed step and a measured matmul peak for MFU."""

import re
import statistics
import time
import warnings
from typing import Callable

import torch


def flop_counts(lm) -> tuple[float, float]:
    """(body, head) parameter counts: the matmul weights every token goes through, and the
    LM head. The input embedding is a lookup, not a matmul (unless tied to the head).
    A frozen weight (the base model under LoRA) counts 2/3: it needs the forward and the
    gradient of its input (4 FLOPs per token), not its own gradient (the other 2 of 6)."""
    head = lm.get_output_embeddings().weight
    skip = {id(lm.get_input_embeddings().weight), id(head)}
    body = sum(numel(p) * trained_share(p) for p in lm.parameters() if id(p) not in skip)
    return body, numel(head) * trained_share(head)


def trained_share(param) -> float:
    return 1.0 if param.requires_grad else 2.0 / 3.0


def numel(param) -> int:
    return getattr(param, "ds_numel", param.numel())  # a ZeRO-3 partitioned parameter holds a part only


def model_flops(body_params: int, head_params: int, n_layers: int, hidden_size: int,
                lengths: list[int], loss_tokens: int) -> float:
    """Training FLOPs (forward + backward) the SFT step needs for these sequences.

    6 per body weight per token; the LM head only on the positions whose loss is taken
    (the loss needs no logits elsewhere, so a trainer computing them does extra work,
    which shows as a lower MFU); causal attention: per layer, scores and weighted sum cost
    4 * len^2 * hidden forward, halved by the mask, tripled for forward + backward,
    counted per sequence as packing computes it.
    """
    attention = 6 * n_layers * hidden_size * sum(n * n for n in lengths)
    return 6.0 * body_params * sum(lengths) + 6.0 * head_params * loss_tokens + attention


def measure_matmul_peak(rows: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
                        device: torch.device, trials: int = 5, seconds_per_trial: float = 0.4) -> float:
    """FLOP/s of a GEMM of the model's MLP shape on this device: the ceiling MFU is read against.

    The median of several trials after an untimed one: a single short trial is at the mercy
    of whatever else runs at that moment (thread-pool start-up, a neighbour process), and
    every MFU reading inherits its error. A reading that still beats it is handled by
    PeakFlops.covering.
    """
    a = torch.randn(rows, hidden_size, dtype=dtype, device=device)
    b = torch.randn(hidden_size, intermediate_size, dtype=dtype, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rates = []
    for trial in range(trials + 1):
        sync()
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds_per_trial:
            torch.matmul(a, b)
            count += 1
        sync()
        if trial:  # the first one warms up thread pools, kernels and clocks
            rates.append(2.0 * rows * hidden_size * intermediate_size * count / (time.perf_counter() - start))
    return statistics.median(rates)


# Dense (no 2:4 sparsity) peak FLOP/s of known accelerators by the dtype their matmuls run in,
# from the vendors' datasheets, which print the sparse figure for tensor-core formats (marked
# "with sparsity"): those are halved here. fp32 is the CUDA-core (non-tensor) rate.
#   H100 SXM5 / H200: nvidia.com/en-us/data-center/h100/ and /h200/ (tech specs table):
#     FP32 67 TF, TF32 989 TF*, BF16/FP16 1,979 TF* (* with sparsity)
#   H100 NVL, H200 NVL: same tables: FP32 60 TF, TF32 835 TF*, BF16/FP16 1,671 TF*
#   H100 PCIe: "NVIDIA H100 Tensor Core GPU" datasheet: FP32 51 TF, TF32 756 TF*, BF16/FP16 1,513 TF*
#   A100 (SXM4 and PCIe): nvidia.com/en-us/data-center/a100/: FP32 19.5 TF, TF32 156 TF,
#     BF16/FP16 312 TF (dense; 312 / 624 with sparsity)
#   L40S: nvidia.com/en-us/data-center/l40s/: FP32 91.6 TF, TF32 366 TF*, BF16/FP16 733 TF*
#   L4: nvidia.com/en-us/data-center/l4/: FP32 30.3 TF, TF32 120 TF*, BF16/FP16 242 TF*
#   A10 / A10G: nvidia.com/en-us/data-center/products/a10-gpu/: FP32 31.2 TF, TF32 125 TF*,
#     BF16/FP16 250 TF*
# A key matches torch.cuda.get_device_name() where it appears not followed by a letter or digit
# ("NVIDIA H100 80GB HBM3" is the SXM part; "NVIDIA A100-SXM4-80GB"; "A10" is not "A10G", whose
# peak is not published the same way), tried in this order: the more specific first.
TF = 1e12
DATASHEET_DENSE_PEAKS = {
    "H200 NVL": {"float32": 60 * TF, "tf32": 417.5 * TF, "bfloat16": 835.5 * TF, "float16": 835.5 * TF},
    "H100 NVL": {"float32": 60 * TF, "tf32": 417.5 * TF, "bfloat16": 835.5 * TF, "float16": 835.5 * TF},
    "H100 PCIe": {"float32": 51 * TF, "tf32": 378 * TF, "bfloat16": 756.5 * TF, "float16": 756.5 * TF},
    "H100": {"float32": 67 * TF, "tf32": 494.5 * TF, "bfloat16": 989.5 * TF, "float16": 989.5 * TF},
    "H200": {"float32": 67 * TF, "tf32": 494.5 * TF, "bfloat16": 989.5 * TF, "float16": 989.5 * TF},
    "A100": {"float32": 19.5 * TF, "tf32": 156 * TF, "bfloat16": 312 * TF, "float16": 312 * TF},
    "L40S": {"float32": 91.6 * TF, "tf32": 183 * TF, "bfloat16": 366.5 * TF, "float16": 366.5 * TF},
    "L4": {"float32": 30.3 * TF, "tf32": 60 * TF, "bfloat16": 121 * TF, "float16": 121 * TF},
    "A10": {"float32": 31.2 * TF, "tf32": 62.5 * TF, "bfloat16": 125 * TF, "float16": 125 * TF},
}


def matmul_dtype_name(dtype: torch.dtype) -> str:
    """The format a GEMM of this dtype runs in on CUDA: fp32 matmuls run as TF32 when torch
    allows it (torch.set_float32_matmul_precision("high"/"medium"))."""
    if dtype == torch.float32:
        return "float32" if torch.get_float32_matmul_precision() == "highest" else "tf32"
    return str(dtype).removeprefix("torch.")


def datasheet_peak(device_name: str, dtype: torch.dtype) -> tuple[float, str] | None:
    """(dense peak FLOP/s, which entry) of a known accelerator, or None."""
    for key, peaks in DATASHEET_DENSE_PEAKS.items():
        if re.search(re.escape(key) + "(?![0-9A-Za-z])", device_name):
            fmt = matmul_dtype_name(dtype)
            if fmt in peaks:
                return peaks[fmt], f"{key} {fmt}"
    return None


class PeakFlops:
    """One device's MFU denominator, where it came from, and the guarantee MFU <= 1.

    A step that runs faster than the peak proves the peak too low: a disturbed measurement,
    a GEMM shape slower than the model's, or a wrong trainer.peak_flops_per_device. A
    measured peak is then measured once more (the larger reading stands); if the step still
    beats it, the peak is raised to the step's rate, an observed lower bound of the true
    peak, with a warning. Readings against a raised peak overstate MFU as much as the peak
    understates the device: the warning says so.
    """

    def __init__(self, value: float, source: str, remeasure: Callable[[], float] | None = None):
        if not value > 0:
            raise ValueError(f"peak FLOP/s must be positive, got {value} ({source})")
        self.value, self.source, self.remeasure = value, source, remeasure
        self.raised = False  # to a step's rate: warned about once

    @classmethod
    def configured(cls, value: float) -> "PeakFlops":
        return cls(value, f"trainer.peak_flops_per_device = {value:.4g} FLOP/s")

    @classmethod
    def datasheet(cls, device_name: str, dtype: torch.dtype) -> "PeakFlops | None":
        """A known accelerator's dense datasheet peak (DATASHEET_DENSE_PEAKS), or None."""
        known = datasheet_peak(device_name, dtype)
        if known is None:
            return None
        value, entry = known
        return cls(value, f"datasheet dense peak of {device_name} ({entry}): {value:.4g} FLOP/s")

    @classmethod
    def measured(cls, measure: Callable[[], float], what: str) -> "PeakFlops":
        value = measure()
        return cls(value, f"measured: {value:.4g} FLOP/s, {what}", measure)

    def covering(self, achieved: float) -> float:
        """The peak, raised when needed so that achieved / peak <= 1."""
        if achieved <= self.value:
            return self.value
        if self.remeasure is not None:
            remeasured, self.remeasure = self.remeasure(), None
            print(f"hpsft: a step ran at {achieved:.4g} FLOP/s, above the measured peak {self.value:.4g}; "
                  f"measured again: {remeasured:.4g}", flush=True)
            self.value = max(self.value, remeasured)
        if achieved > self.value:
            if not self.raised:
                warnings.warn(
                    f"hpsft: a step ran at {achieved:.4g} FLOP/s, above the MFU peak {self.value:.4g} ({self.source}); "
                    "the peak is raised to the step's rate, so perf/mfu overstates utilisation. Set "
                    "trainer.peak_flops_per_device to the device's dense peak for the training dtype.",
                    stacklevel=2,
                )
            self.value, self.raised = achieved, True
        return self.value


def device_peak(configured: float | None, device: torch.device, dtype: torch.dtype, gemm_shape: tuple[int, int, int],
                device_name: str | None = None) -> PeakFlops:
    """One device's MFU denominator: trainer.peak_flops_per_device when set, else a known
    accelerator's dense datasheet peak for the dtype, else (a CPU, an unknown accelerator) the
    median rate of a GEMM of `gemm_shape` (rows, hidden, intermediate: the model's MLP)
    measured on the device. `device_name` defaults to what torch reports for a GPU."""
    if configured is not None:
        return PeakFlops.configured(configured)
    if device_name is None and device.type == "cuda":
        device_name = torch.cuda.get_device_name(device)
    known = PeakFlops.datasheet(device_name, dtype) if device_name else None
    if known is not None:
        return known
    return PeakFlops.measured(lambda: measure_matmul_peak(*gemm_shape, dtype, device),
                              f"median GEMM {'x'.join(map(str, gemm_shape))} {dtype} on {device}")


def rss_anon_bytes() -> int:
    """This process's anonymous resident memory (RssAnon of /proc/self/status: what it holds
    itself, not the mapped files, such as the token store, that the page cache holds); 0 where
    the kernel does not show it."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
