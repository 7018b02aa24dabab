"""The byte accounting (hpsft/ops/byte_accounting.py) against what a GPU measured.

The figures are the H200 run's (docs/gpu_results.md, bench_varlen_ce.py --device cuda: peak
extra MiB of one bf16 fwd+bwd, H=4096, V=128256, every token supervised), 1% tolerance.
"""

import pytest
import torch

from hpsft.ops.byte_accounting import account_hpsft, account_liger
from hpsft.ops.live_bytes import LiveBytes, allocator_bytes

H, V = 4096, 128256
# (tokens, chunk rows) -> peak extra MiB measured on the H200 (commit 41feec3's loss: fp32
# d(weight) buffer, fp32 logit block and its bf16 copy, fp32 d(hidden) rows).
MEASURED_HPSFT = {(8192, 4096): 5202, (32768, 4096): 5778, (8192, 2048): 3699, (32768, 2048): 4276}
MEASURED_LIGER = {8192: 1129, 32768: 1509}


@pytest.mark.parametrize(("tokens", "chunk_rows"), MEASURED_HPSFT)
def test_accounting_reproduces_the_measured_hpsft_figures(tokens, chunk_rows):
    """Catches a count that misses an allocation of the CUDA path (e.g. the bf16 copy of the
    logit block: 1002 MiB at 4096 rows) or one that counts views as new memory."""
    accounted = account_hpsft(tokens, H, V, torch.bfloat16, chunk_rows=chunk_rows)
    assert accounted.peak_mib == pytest.approx(MEASURED_HPSFT[tokens, chunk_rows], rel=0.01), accounted.describe()


@pytest.mark.parametrize("tokens", MEASURED_LIGER)
def test_accounting_of_liger_reproduces_its_measured_figure(tokens):
    accounted = account_liger(tokens, H, V, torch.bfloat16)
    assert accounted.peak_mib == pytest.approx(MEASURED_LIGER[tokens], rel=0.01), accounted.describe()


def test_live_bytes_counts_new_storages_once_until_freed():
    """Views, in-place and out= results are not new memory; a freed tensor stops counting;
    tensors made before the count are not counted, not even when freed inside it."""
    before = torch.empty(1000, device="meta")
    with LiveBytes() as count:
        a = torch.empty(300, 10, device="meta")  # 12000 bytes -> 12288 (512-byte blocks)
        a.t().mul_(2)  # a view, then in place
        torch.mm(a, torch.empty(10, 10, device="meta"), out=torch.empty(300, 10, device="meta"))
        del before
        b = a.sum(dim=1)  # 1200 bytes -> 1536
        del a
        assert count.live == 1536
    assert count.peak == 12288 + 512 + 12288  # a, the 10x10 operand and mm's output, alive together
    assert allocator_bytes(0) == 0 and allocator_bytes(1) == 512 and allocator_bytes(1024) == 1024
    del b
