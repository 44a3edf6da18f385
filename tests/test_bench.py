"""The benchmark reports what it claims to measure (tiny sizes; no speed asserted)."""

import re
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import horovodrun_gloo, run

from partial_fc_mx.pfc.gemm import ISA_BFLOAT16, effective_isa, onednn_library


def test_pfc_bench_times_the_noisy_label_variants_against_the_plain_step():
    """--variants: the filter and 3 sub-centers in the same run, each against the plain
    step, with 3x the sampled rows for the sub-centers and their memory in the theory."""
    result = horovodrun_gloo(2, [sys.executable, "-m", "partial_fc_mx.bench", "pfc",
                                 "--classes", "4000", "--num-sample", "100",
                                 "--batch-size", "8", "--embedding-size", "16",
                                 "--steps", "2", "--warmup", "1",
                                 "--variants", "plain", "filter", "sub3"], timeout=180)
    assert result.returncode == 0, result.stdout[-3000:]
    out = result.stdout
    for rank in (0, 1):
        assert re.search(rf"rank {rank}  sub3  C=\s+4,000  sampled rows\s+300  step", out)
        for variant, rows in (("filter", "1.0"), ("sub3", "3.0")):
            assert re.search(rf"rank {rank}  C=4,000: {variant} step = [\d.]+x plain's "
                             rf"\([\d.]+ / [\d.]+ ms\); its GEMMs' growth alone \({rows}x the "
                             r"rows\) would make it [\d.]+x", out), out[-3000:]
    theory = [float(t) for t in re.findall(r"x theory ([\d,.]+) MiB", out)]
    assert len(theory) == 6 and theory[2] > 2 * theory[0]  # rank 0: plain, filter, sub3


def test_pfc_bench_alternates_the_bfloat16_gemms_with_the_plain_step_in_rounds():
    """--variants plain gemm16 plain gemm16: each round's ratio, then median [min, max]
    of the step and of the GEMM phase. Where the CPU
    has no bfloat16 arithmetic, every rank refuses with the reason instead."""
    result = horovodrun_gloo(2, [sys.executable, "-m", "partial_fc_mx.bench", "pfc",
                                 "--classes", "4000", "--num-sample", "100",
                                 "--batch-size", "8", "--embedding-size", "16",
                                 "--steps", "2", "--warmup", "1",
                                 "--variants", "plain", "gemm16", "plain", "gemm16"], timeout=180)
    out = result.stdout
    if not effective_isa(onednn_library()) & ISA_BFLOAT16:
        assert result.returncode != 0 and "without bfloat16 arithmetic" in out, out[-3000:]
        return
    assert result.returncode == 0, out[-3000:]
    for rank in (0, 1):
        for what in ("step", "GEMM phase"):
            assert re.search(rf"rank {rank}  C=4,000: gemm16 {what} / plain's over 2 alternating "
                             r"rounds: median [\d.]+ \[[\d.]+, [\d.]+\]", out), out[-3000:]
    assert "gemm16 step = " not in out  # rounds are summarised, not paired one by one
    assert len(re.findall(r"rank \d  gemm16  C=\s+4,000  sampled rows\s+100  step", out)) == 4


def test_pfc_bench_reports_the_sample_ratios_and_memory_for_each_rank():
    result = horovodrun_gloo(2, [sys.executable, "-m", "partial_fc_mx.bench", "pfc",
                                 "--classes", "2001", "30000", "--num-sample", "100",
                                 "--batch-size", "8", "--embedding-size", "16",
                                 "--steps", "2", "--warmup", "1"], timeout=180)
    assert result.returncode == 0, result.stdout[-3000:]
    out = result.stdout
    # rank 0's shard of 2001 classes has 1001 rows; --num-sample 100 -> 100 sampled
    assert re.search(r"rank 0  plain  C=\s+2,001  sampled rows\s+100  step", out)
    assert re.search(r"rank 1  plain  C=\s+30,000  sampled rows\s+100  step", out)
    ratios = [float(r) for r in re.findall(r"RSS \+[\d,]+ MiB = ([\d.]+)x theory", out)]
    assert len(ratios) == 4 and all(r > 0 for r in ratios)
    assert len(re.findall(r"at the same sample size: \d+\.\d+", out)) == 2
    # both ranks' GEMMs against numpy's sgemm at one rank's thread count, every rank at once
    assert re.search(r"GEMMs plain C=30,000: [\d.]+ GFLOP/s summed over the 2 ranks of \S+ = \d+% "
                     r"of numpy sgemm's [\d.]+ GFLOP/s summed over the same ranks \(T=1 each",
                     out), out[-3000:]
    per_rank = re.findall(r"GEMMs [\d.]+ GFLOP/s = \d+% of numpy sgemm [\d.]+ GFLOP/s "
                          r"\(16 x 16 by 100 x 16, T=1\)", out)
    assert len(per_rank) == 4  # 2 cores, 2 ranks: MXNet gives each 1 thread
    floors = re.findall(r"step = ([\d.]+)x its GEMM phase \([\d.]+ ms\); memory-traffic "
                        r"floor ([\d.]+) ms \(([\d.]+) MB at [\d.]+ GB/s, this rank's", out)
    assert len(floors) == 4 and all(float(ratio) > 0 for ratio, _, _ in floors)
    assert [mb for _, _, mb in floors] == ["0.1"] * 4  # 51,200 bytes: see below


def test_pfc_bench_runs_and_lists_every_benchmark_without_opencv_onnx_tensorboardx():
    """`bench pfc` imports only what it uses: an OpenCV, onnx or tensorboardX that cannot
    load (built for another numpy) crashed every rank when all benchmarks were imported
    at start-up. Here they cannot be imported at all."""
    hidden = ("import runpy, sys; sys.modules.update(cv2=None, onnx=None, tensorboardX=None); "
              "sys.argv[0] = 'bench'; runpy.run_module('partial_fc_mx.bench', "
              "run_name='__main__'); "
              "assert not {'cv2', 'onnx', 'tensorboardX'} & {m for m, v in sys.modules.items() "
              "if v is not None}")
    listed = run([sys.executable, "-c", hidden, "--help"], timeout=120)
    assert listed.returncode == 0, listed.stdout[-3000:]
    assert all(name in listed.stdout for name in ("pfc", "train", "ops", "data", "save", "ijb"))
    options = run([sys.executable, "-c", hidden, "pfc", "--help"], timeout=120)
    assert options.returncode == 0 and "--num-sample" in options.stdout, options.stdout[-3000:]
    ran = run([sys.executable, "-c", hidden, "pfc", "--classes", "1000", "--num-sample", "50",
               "--batch-size", "4", "--embedding-size", "8", "--steps", "1", "--warmup", "0"],
              timeout=180)
    assert ran.returncode == 0, ran.stdout[-3000:]
    assert re.search(r"rank 0  plain  C=\s+1,000  sampled rows\s+50  step", ran.stdout), \
        ran.stdout[-3000:]


def test_every_benchmark_module_is_listed_with_its_arguments_and_run():
    """A benchmark module is reachable only through bench/__main__.BENCHMARKS."""
    import importlib
    from pathlib import Path

    from partial_fc_mx.bench.__main__ import BENCHMARKS

    folder = Path(importlib.import_module("partial_fc_mx.bench").__file__).parent
    helpers = {"__init__", "__main__", "timing", "shapes", "threads"}
    modules = {path.stem for path in folder.glob("*.py")} - helpers
    assert set(BENCHMARKS) == modules
    for name in BENCHMARKS:
        module = importlib.import_module(f"partial_fc_mx.bench.{name}")
        assert callable(module.add_arguments) and callable(module.run), name


def test_numpy_sgemm_runs_with_the_thread_count_asked_for():
    from partial_fc_mx.bench.pfc import numpy_blas_threads

    before = numpy_blas_threads()
    assert before is not None  # numpy's wheel carries OpenBLAS
    try:
        assert numpy_blas_threads(1) == 1
        assert numpy_blas_threads(3) == 3
    finally:
        numpy_blas_threads(before)
    assert numpy_blas_threads() == before


def test_each_ranks_floor_is_its_bytes_at_its_own_bandwidth(capsys, monkeypatch):
    """Two ranks of one host, each with its own measured share of the bandwidth."""
    from partial_fc_mx.bench import pfc

    monkeypatch.setattr(pfc.dist, "device", lambda local_rank: "cpu(0)")
    result = {"variant": "plain", "classes": 1000, "sampled": 100, "step_ms": 10.0,
              "gemm_gflops": 5.0, "phases_ms": {"gemm": 1.0, "communication": 1.0}, "rss_mib": 1.0,
              "theory_mib": 1.0, "baseline_mib": 100.0, "traffic_bytes": 10**9,
              "startup_s": 1.0, "shard_gib": 1.0}
    everyone = [{"results": [result], "host": "a", "threads": 1, "numpy_gflops": 10.0,
                 "bandwidth_gbs": bandwidth} for bandwidth in (10.0, 20.0)]
    args = SimpleNamespace(fp16_centers=False, batch_size=4, embedding_size=8,
                           variants=["plain"])
    pfc.print_report(args, SimpleNamespace(size=2), everyone)
    out = capsys.readouterr().out
    assert re.findall(r"memory-traffic floor ([\d.]+) ms", out) == ["100.00", "50.00"]
    assert "GEMMs 5.0 GFLOP/s = 50% of numpy sgemm 10.0 GFLOP/s" in out
    assert "10.0 GFLOP/s summed over the 2 ranks of a = 50% of numpy sgemm's 20.0" in out


def test_save_bench_reports_each_way_of_writing_a_shard(tmp_path):
    result = run([sys.executable, "-m", "partial_fc_mx.bench", "save", "--rows", "2000",
                  "--embedding-size", "64", "--repeats", "2", "--dir", str(tmp_path)])
    assert result.returncode == 0, result.stdout[-3000:]
    assert "one shard of 2000 x 64 float32 (0 MiB)" in result.stdout
    rows = re.findall(r"^  (.+?)\s+([\d.]+) ms\s+\d+ MiB/s\s+([\d.]+)x np.save$",
                      result.stdout, flags=re.MULTILINE)
    assert [name for name, _, _ in rows] == ["np.save", "np.save + fsync",
                                             "checksummed + fsync",
                                             "verify (read back + CRC-32)"]
    assert float(rows[0][2]) == 1.0 and all(float(ms) > 0 for _, ms, _ in rows)
    assert list(tmp_path.iterdir()) == []  # it cleans up


def test_ijb_bench_reports_each_phase_and_the_peak_memory():
    result = run([sys.executable, "-m", "partial_fc_mx.bench", "ijb", "--pictures", "3000",
                  "--templates", "300", "--pairs", "20000", "--embedding-size", "32"])
    assert result.returncode == 0, result.stdout[-3000:]
    assert "3,000 pictures, 300 templates, 20,000 pairs" in result.stdout
    phases = re.findall(r"^  (.+?)\s+([\d.]+) s   peak RSS\s+[\d,]+ MiB$", result.stdout,
                        flags=re.MULTILINE)
    assert [name for name, _ in phases] == ["read the metadata", "read the pairs",
                                            "score the pairs", "ROC and TAR@FAR"]
    assert re.search(r"peak RSS [\d,]+ MiB: [\d,]+ MiB above .* pairs 0 MiB, scores 0 MiB\)",
                     result.stdout), result.stdout


@pytest.mark.parametrize("weight, momentum, expected", [
    ("float32", "float32", 2 * (16 * 100 * 4 + 100 * (16 * 4 + 16 * 4 + 16 * 4))),  # 51,200
    ("float16", "float32", 2 * (16 * 100 * 4 + 100 * (16 * 2 + 16 * 4 + 16 * 4))),
])
def test_the_memory_traffic_floor_counts_logits_rows_states_and_gradient(weight, momentum,
                                                                          expected):
    """Logits written and read; each sampled row, its states and its float32 gradient
    written and read."""
    import mxnet as mx

    from partial_fc_mx.bench.pfc import minimal_traffic

    arrays = {"weight": [mx.nd.zeros((300, 16), dtype=weight)],  # one block each
              "mom": [mx.nd.zeros((300, 16), dtype=momentum)]}
    pfc = SimpleNamespace(sampled_classes=np.arange(100), embedding_size=16, subcenters=1,
                          centers=SimpleNamespace(arrays=lambda: arrays))
    assert minimal_traffic(pfc, global_batch=16) == expected


def test_train_bench_reports_both_heads_and_their_ratio():
    result = horovodrun_gloo(2, [sys.executable, "-m", "partial_fc_mx.bench", "train",
                                 "--networks", "tiny", "--classes", "1000", "--batch-size",
                                 "4", "--steps", "2", "--warmup", "1", "--fp16-centers"],
                             timeout=240)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "sample_rate 0.1, float16 centers" in result.stdout
    rows = re.findall(r"tiny  B=\s+4  C=\s+1,000\s+(pfc|fc)\s+([\d.]+) img/s  step\s+(\d+) ms  "
                      r"\((.+)\)  start-up [\d.]+ s", result.stdout)
    assert [head for head, *_ in rows] == ["pfc", "fc"], result.stdout[-3000:]
    for _, img_s, step_ms, phases in rows:
        assert abs(float(img_s) - 8 / (int(step_ms) / 1e3)) < 0.05 * float(img_s) + 0.2
        assert [p.rsplit(" ", 1)[0] for p in phases.split(", ")] == [
            "backbone forward", "classifier", "backbone backward", "backbone allreduce",
            "backbone update", "classifier update"]
    assert re.search(r"C=\s+1,000  Partial FC / data-parallel FC img/s: [\d.]+", result.stdout)


def test_train_bench_skips_a_data_parallel_fc_that_cannot_fit():
    result = horovodrun_gloo(2, [sys.executable, "-m", "partial_fc_mx.bench", "train",
                                 "--networks", "tiny", "--classes", "4000000", "300000000",
                                 "--heads", "fc"], timeout=120)
    assert result.returncode == 0, result.stdout[-3000:]
    # 4M x 512: one array holds it, 24 GiB of RAM do not (centers, gradient, momentum...)
    assert re.search(r"C=4,000,000\s+fc  cannot run: needs [\d.]+ GiB per rank, [\d.]+ GiB "
                     r"available per rank", result.stdout), result.stdout[-3000:]
    assert re.search(r"C=300,000,000\s+fc  cannot run: one process scores 300,000,000 of "
                     r"its 300,000,000 class centers", result.stdout), result.stdout[-3000:]


def test_train_bench_prints_each_configuration_before_a_later_one_fails():
    """A configuration killed for memory (or refused, as 300M classes on 2 ranks are
    here) must not take the figures of the earlier ones with it."""
    result = horovodrun_gloo(2, [sys.executable, "-m", "partial_fc_mx.bench", "train",
                                 "--networks", "tiny", "--classes", "1000", "300000000",
                                 "--heads", "pfc", "--batch-size", "4", "--steps", "1"],
                             timeout=180)
    assert result.returncode != 0
    assert re.search(r"tiny  B=\s+4  C=\s+1,000\s+pfc\s+[\d.]+ img/s", result.stdout), \
        result.stdout[-3000:]
    assert "use at least" in result.stdout  # the refusal of the second one


@pytest.mark.parametrize("network", ["r50", "vit_t"])
def test_the_memory_estimate_matches_the_resident_memory_of_training(network):
    """The preflight's estimate (memory.py: weights, gradients, momentum, activations at
    the batch, Partial FC) against what a real training process grows by, for a
    convolutional network and a transformer (whose estimate, when every output counted
    twice, was 4 times too high); more networks and batches are in docs/benchmarks.md."""
    result = run([sys.executable, "-m", "partial_fc_mx.bench", "train", "--networks", network,
                  "--classes", "1000", "--heads", "pfc", "--batch-size", "8", "--steps", "1",
                  "--warmup", "0"], timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]
    found = re.search(r"memory: estimate ([\d.]+) GiB, RSS growth ([\d.]+) GiB \(x([\d.]+)\)",
                      result.stdout)
    assert found, result.stdout[-3000:]
    assert float(found.group(1)) > 0.4  # the backbone counted, not Partial FC's few MiB alone
    assert 0.75 <= float(found.group(3)) <= 1.25, found.group(0)


DATA_PARALLEL_MATCHES_PARTIAL_FC = """
import horovod.mxnet as hvd, mxnet as mx, numpy as np
from partial_fc_mx.bench.train import DataParallelFC
from partial_fc_mx.pfc.partial_fc import PartialFC
hvd.init()
rank, world = hvd.rank(), hvd.size()
rng = np.random.default_rng(SEED)  # the same draws on every rank
weight = rng.standard_normal((50, 8)) * 0.1
x = mx.nd.array(rng.standard_normal((6 * world, 8))[6 * rank:6 * rank + 6])
labels = rng.integers(0, 50, 6 * world)[6 * rank:6 * rank + 6]
fc = DataParallelFC(50, 8, mx.cpu())
fc.weight.set_data(mx.nd.array(weight))
pfc = PartialFC(50, 8, rank=rank, world_size=world, sample_rate=1.0)
rows = slice(pfc.shard.start, pfc.shard.stop)
pfc.weight[:] = weight[rows]
for head in (fc, pfc):
    loss, grad = head.forward_backward(x, labels, grad_scale=3.0)
    head.step(0.5)
    if head is fc:  # the mean over this rank's batch: average them
        loss = hvd.allreduce(loss, op=hvd.Average, name="loss")
    centers = fc.weight.data()[rows] if head is fc else pfc.weight
    print("RESULT", float(loss.asscalar()), *grad.asnumpy().ravel(),
          *centers.asnumpy().ravel(), flush=True)
"""


@pytest.mark.parametrize("world, seed", [(1, 0), (1, 1), (2, 2), (2, 3)])
def test_the_data_parallel_head_trains_what_partial_fc_at_rate_1_trains(world, seed):
    """The comparison is fair: on every rank the same loss over the global batch, the
    same gradient for the rank's embeddings and the same updated centers."""
    command = [sys.executable, "-c", DATA_PARALLEL_MATCHES_PARTIAL_FC.replace("SEED", str(seed))]
    result = run(command, timeout=120) if world == 1 else horovodrun_gloo(world, command,
                                                                          timeout=180)
    assert result.returncode == 0, result.stdout[-3000:]
    by_rank = {}
    for line in result.stdout.splitlines():
        if "RESULT" in line:  # horovodrun prefixes "[rank]<stdout>:"
            rank = int(line[1:line.index("]")]) if line.startswith("[") else 0
            by_rank.setdefault(rank, []).append(np.array(line.split("RESULT", 1)[1].split(),
                                                         float))
    assert sorted(by_rank) == list(range(world))
    assert all(len(results) == 2 for results in by_rank.values())
    for fc, pfc in by_rank.values():
        assert fc[0] > 1  # a real loss, not zeros on both sides
        for part in (slice(0, 1), slice(1, 49), slice(49, None)):  # loss, grad, centers
            scale = np.abs(pfc[part]).max()
            assert scale > 0
            np.testing.assert_allclose(fc[part], pfc[part], rtol=1e-4, atol=1e-4 * scale)


GIVES_MEMORY_BACK = """
import argparse, psutil
from partial_fc_mx import dist
from partial_fc_mx.bench.train import bench_config
args = argparse.Namespace(embedding_size=EMBEDDING, sample_rate=0.1, steps=1,
                          warmup=0, output=OUTPUT, fp16_centers=False, fp16=False,
                          cpu_precision="auto", gradient_accumulation=1)
world = dist.init()
before = psutil.Process().memory_info().rss
assert "img_s" in bench_config(world, NETWORK, 8, CLASSES, HEAD, args)
print("RETAINED_MIB", (psutil.Process().memory_info().rss - before) / 2**20)
"""


@pytest.mark.parametrize("network, classes, embedding, head", [
    ("tiny", 800_000, 64, "fc"),  # 0.2 GiB of centers; 1.1 GiB with gradient, momentum...
    ("r18", 1000, 512, "pfc"),  # the backbone's buffers
])
def test_train_bench_gives_a_configurations_memory_back_before_the_next(
        tmp_path, network, classes, embedding, head):
    """One bench process runs many configurations: what one held must not stay resident
    (r18 over three class counts was killed for memory at the third). Measured before the
    fix: 720 MiB (tiny: reference cycles) and 790 MiB (r18: glibc's heaps) stayed;
    after: under 150 MiB, libraries loaded once."""
    script = GIVES_MEMORY_BACK
    for name, value in {"EMBEDDING": embedding, "OUTPUT": repr(str(tmp_path)),
                        "NETWORK": repr(network), "CLASSES": classes, "HEAD": repr(head)}.items():
        script = script.replace(name, str(value))
    result = run([sys.executable, "-c", script], timeout=240)
    assert result.returncode == 0, result.stdout[-3000:]
    retained = float(result.stdout.split("RETAINED_MIB", 1)[1].split()[0])
    assert retained < 300, result.stdout[-3000:]


@pytest.mark.parametrize("fp16_centers, expected", [(False, 15 * 16 * (4 + 4)),
                                                     (True, 15 * 16 * (2 + 2))])
def test_the_start_up_figure_counts_every_array_of_the_shard(fp16_centers, expected):
    """s/GiB divides by this rank's rows (15 of 31) with their momentum, stored dtypes."""
    from partial_fc_mx.bench.pfc import shard_bytes
    from partial_fc_mx.pfc.partial_fc import PartialFC

    pfc = PartialFC(31, 16, rank=1, world_size=2, sample_rate=1.0, fp16_centers=fp16_centers)
    assert shard_bytes(pfc) == expected


def test_ops_bench_rates_every_gemm_against_the_forward():
    result = run([sys.executable, "-m", "partial_fc_mx.bench", "ops", "--batch-size", "64",
                  "--num-sample", "2000", "--embedding-size", "64"], timeout=180)
    assert result.returncode == 0, result.stdout[-3000:]
    rates = re.findall(r"([\d.]+) ms\s+([\d.]+) GFLOP/s\s+([\d.]+)x forward  (.+?)(  OFF THE "
                       r"FAST PATH)?$", result.stdout, re.MULTILINE)
    names = [name for *_, name, _ in rates]
    # MXNet's five, then oneDNN 3's float32 pair, and its bfloat16 pair where the CPU
    # computes bfloat16 (said where not)
    native = bool(effective_isa(onednn_library()) & ISA_BFLOAT16)
    assert len(rates) == 5 + 2 + 2 * native and names[0].startswith(
        "G = x w^T: FullyConnected forward")
    assert names[5:7] == ["G = x w^T: oneDNN 3, float32", "dx and dw: oneDNN 3, float32, per GEMM"]
    assert native or "oneDNN 3's bfloat16 GEMMs not timed: this CPU has no" in result.stdout
    assert float(rates[0][2]) == 1.0 and all(float(rate) > 0 for _, rate, *_ in rates)
    assert [bool(flag) for *_, flag in rates] == [float(r) > 1.2 for _, _, r, _, _ in rates]
    passes = re.findall(r"^\s+([\d.]+) ms  (fused C\+\+ kernels|MXNet operators).*: v = w s / "
                        r"\|w\| ([\d.]+), softmax with the spare column ([\d.]+), gradient "
                        r"projection ([\d.]+), SGD on the sampled rows ([\d.]+)$",
                        result.stdout, re.MULTILINE)
    assert [kind for _, kind, *_ in passes] == ["fused C++ kernels", "MXNet operators"], \
        result.stdout[-2000:]
    for total, _, *parts in passes:  # the total is the sum of what it lists, each
        rounding = 0.05 * (len(parts) + 1)  # figure printed to 0.1 ms
        assert abs(float(total) - sum(map(float, parts))) <= rounding + 1e-9


def test_the_anchor_names_the_arcface_torch_file_it_lacks(tmp_path):
    """bench anchor runs insightface's own files: a wrong folder is named, with where
    the files come from, before torch is imported or any process waits for another."""
    from partial_fc_mx.bench.anchor import load_reference
    from partial_fc_mx.errors import UserError

    (tmp_path / "partial_fc_v2.py").write_text("VERSION = 2\n")
    missing = re.escape(str(tmp_path / "losses.py"))
    with pytest.raises(UserError, match=f"{missing} does not exist.*insightface"):
        load_reference(tmp_path)
    (tmp_path / "losses.py").write_text("SCALE = 64\n")
    modules = load_reference(tmp_path)
    assert modules["partial_fc_v2"].VERSION == 2 and modules["losses"].SCALE == 64


@pytest.mark.parametrize("shard_rows", [7, 1000, 499_999, 500_000, 5_000_001])
def test_both_benchmarks_sample_the_centers_asked_for(shard_rows):
    """bench pfc and bench anchor turn --num-sample into a sample rate that both
    implementations truncate back to the same count (int(rate * rows))."""
    import argparse

    from partial_fc_mx.bench import shapes
    from partial_fc_mx.pfc.centers import num_sample

    for wanted in (1, 3, shard_rows // 10 or 1, shard_rows):
        args = argparse.Namespace(num_sample=wanted, sample_rate=0.1)
        assert num_sample(shard_rows, shapes.sample_rate(args, shard_rows)) == wanted


def test_a_benchmark_reports_a_user_error_without_a_traceback(tmp_path, capsys):
    from partial_fc_mx.bench.__main__ import main

    with pytest.raises(SystemExit) as stopped:
        main(["anchor", "--arcface-torch", str(tmp_path)])
    assert stopped.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("error: ") and "partial_fc_v2.py does not exist" in error
    assert "Traceback" not in error


def test_saving_bench_reports_what_each_way_of_saving_costs_the_run(tmp_path):
    result = horovodrun_gloo(2, [sys.executable, "-m", "partial_fc_mx.bench", "saving",
                                 "--networks", "tiny", "--steps", "2", "--classes", "100",
                                 "--output", str(tmp_path)], timeout=600)
    assert result.returncode == 0, result.stdout[-3000:]
    ways = re.findall(r"  (checkpoint[^\n]*?)\s+costs the run\s+([\d.-]+) s \(rank 0 [\d.-]+ s, "
                      r"rank 1 [\d.-]+ s\); ([\d.]+)x the checkpoint alone", result.stdout)
    assert [way for way, _, _ in ways] == ["checkpoint only", "checkpoint + export inline",
                                           "checkpoint + export in background"], result.stdout
    assert float(ways[0][2]) == 1.0
    assert re.search(r"the background export took [\d.]+ s", result.stdout)
