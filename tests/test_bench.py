"""The benchmark reports what it claims to measure (tiny sizes; no speed asserted)."""

import re
import sys

from conftest import horovodrun_gloo


def test_pfc_bench_reports_the_sample_ratios_and_memory_for_each_rank():
    result = horovodrun_gloo(2, [sys.executable, "-m", "partial_fc_mx.bench", "pfc",
                                 "--classes", "2001", "30000", "--num-sample", "100",
                                 "--batch-size", "8", "--embedding-size", "16",
                                 "--steps", "2", "--warmup", "1"], timeout=180)
    assert result.returncode == 0, result.stdout[-3000:]
    out = result.stdout
    # rank 0's shard of 2001 classes has 1001 rows; --num-sample 100 -> 100 sampled
    assert re.search(r"rank 0  C=\s+2,001  sampled\s+100  step", out)
    assert re.search(r"rank 1  C=\s+30,000  sampled\s+100  step", out)
    ratios = [float(r) for r in re.findall(r"RSS \+[\d,]+ MiB = ([\d.]+)x theory", out)]
    assert len(ratios) == 4 and all(r > 0 for r in ratios)
    assert len(re.findall(r"at the same sample size: \d+\.\d+", out)) == 2
    assert re.search(r"GEMMs C=30,000: [\d.]+ GFLOP/s summed over the 2 ranks", out)
