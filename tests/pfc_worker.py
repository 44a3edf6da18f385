"""One rank of a Partial FC exactness test; launched alone, by horovodrun or by mpirun.

Every rank builds the same global problem from a seed, runs PartialFC on its part,
and compares with the float64 full-softmax reference in pfc_reference.py. It prints
`PASS rank R ...` with the errors it saw, or raises. Several cases run one after the
other in one launch (the process start-up, not the cases, was most of the time). Usage:

    python tests/pfc_worker.py CASE...   (CASE: exact, unequal, sampled, dense-sampled,
                                          replay-sampled, fp16, fp16-sampled, bf16,
                                          adamw, adamw-sampled,
                                          adamw-fp16-sampled, adamw-dense-sampled,
                                          adaface, adaface-sampled, adaface-unequal,
                                          far, varying, nan-center, composed-sampled,
                                          composed-unequal,
                                          bad-label, nonfinite, width, loss-scale)
       a case may add "sub3" (sub-center ArcFace, 3 rows per class) and "filter"
       (inter-class filtering at 0.2), e.g. sub3-filter-blocks-replay-sampled, and
       "accum" (each rank's batch in 2 accumulated micro-batches, held to the
       reference of the whole batch, its sample to the whole batch's), and "gemm16"
       (the GEMMs' inputs rounded to bfloat16 by oneDNN 3, held to GEMM16's band)
"""

from __future__ import annotations

import sys
from pathlib import Path

import horovod.mxnet as hvd
import mxnet as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pfc_reference import AdaFace as ReferenceAdaFace  # noqa: E402
from pfc_reference import adamw, loss_and_grads, sgd_momentum  # noqa: E402

from partial_fc_mx.cleaning.dominant import own_class_cosines  # noqa: E402
from partial_fc_mx.pfc.center_optimizers.adamw import AdamW  # noqa: E402
from partial_fc_mx.pfc.center_optimizers.sgd import SGD  # noqa: E402
from partial_fc_mx.pfc.gemm import (  # noqa: E402
    ISA_BFLOAT16,
    GemmChoiceError,
    OneDNNGemm,
    choose,
    effective_isa,
    onednn_library,
)
from partial_fc_mx.pfc.margins.adaface import AdaFace  # noqa: E402
from partial_fc_mx.pfc.partial_fc import PartialFC, PartialFCInputError  # noqa: E402
from partial_fc_mx.pfc.rows import ComposedRows, FusedRows  # noqa: E402

LR, MU, WD = 0.5, 0.9, 5e-4
LR_ADAMW = 0.01
TOLERANCE = 1e-5
SUBCENTERS = 3
FILTER = 0.2
"""The cases' inter-class filtering threshold: random 24-d embeddings and centers
meet at cosines of about +-0.2 (3 sub-centers, a max of 3: higher), so 13-42% of the
negatives are filtered (at least 2% checked)."""
BFLOAT16 = np.dtype([("bfloat16", np.uint16)])  # how MXNet 1.9 names bfloat16
# relative rounding of the embedding gradient handed back in the embeddings' dtype
ROUNDING = {"fp16": 2e-3, "bf16": 1e-2}
UNIT_ROUNDOFF = 2.0**-8  # bfloat16's: 8 significant bits, rounded to nearest
GEMM16 = {"loss": 2 * UNIT_ROUNDOFF, "rest": 3 * UNIT_ROUNDOFF}
"""The band of the bfloat16 GEMM inputs (gemm16), from the format, not from a run: a
product of two rounded numbers is off by at most 2u relative, which bounds the logits'
error and so the loss's; what the backward GEMMs give (the gradients, and the updates
and states made of them) multiplies two rounded inputs of which one, the
probabilities, carries the rounded logits' error too: 3u. Observed: at most 0.6 of it.
The inter-class filter's threshold and sub-centers' argmax are rules, not smooth
functions: an entry within the rounding of the threshold, or two sub-centers within it
of each other, may be decided the other way, so gemm16 is held to the band without
them (the rules' paths are the same code as in float32)."""


def rel(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / max(np.linalg.norm(b), 1e-30))


def problem(seed, world, num_classes, dim, batch_sizes):
    rng = np.random.default_rng(seed)
    total = sum(batch_sizes)
    x = rng.normal(size=(total, dim)).astype(np.float32)
    labels = rng.integers(0, num_classes, total)
    offsets = np.concatenate([[0], np.cumsum(batch_sizes)])
    return x, labels, offsets


def margins(case: str) -> tuple:
    """(PartialFC's margin, the reference's, scale). AdaFace starts from statistics near
    the test's norms (about 4.9 +- 0.7) and follows them fast (t_alpha 0.5); with h = 1
    its quality z spreads over [-1, 1], clipped at both ends for some rows (checked)."""
    scale = 64.0 if case == "far" else 30.0
    if "adaface" not in case:
        return (1.0, 0.5, 0.0), (1.0, 0.5, 0.0), scale
    m, h, t_alpha, mean, std = 0.4, 1.0, 0.5, 5.0, 0.4
    margin = AdaFace(scale, m=m, h=h, t_alpha=t_alpha)
    margin.load_state_dict({"mean": mean, "std": std})
    return margin, ReferenceAdaFace(scale, m, h, t_alpha, mean, std), scale


def center_optimizer(case: str):
    """SGD (the default) or AdamW, with its float64 reference update and start states."""
    if "adamw" in case:
        optimizer = AdamW(weight_decay=WD)

        def reference(w, states, g, rows):
            return adamw(w, states, g, rows, LR_ADAMW, optimizer.beta1, optimizer.beta2,
                         optimizer.epsilon, WD)

        def start(rng, shape):  # rows part-way into training, each sampled a different
            return {"mean": 0.01 * rng.normal(size=shape),  # number of times before
                    "var": 1e-4 * rng.random(shape), "steps": rng.integers(0, 4, (shape[0], 1))}

        return optimizer, LR_ADAMW, reference, start
    optimizer = SGD(momentum=MU, weight_decay=WD, fused="composed" not in case)
    return (optimizer, LR, lambda w, states, g, rows: sgd_momentum(w, states, g, rows, LR, MU, WD),
            lambda rng, shape: {"mom": 0.01 * rng.normal(size=shape)})


def far_apart(rng, weight: np.ndarray, dim: int):
    """The "far" case: every embedding near one direction u, the first half of the
    classes near u and the others near -u. With s = 64 the best logit of every row on
    the second half's rank sits ~100 below the row's maximum: its exp underflows
    float32's normal range, and that rank's share of every row's softmax is denormal or
    zero, targets among them included."""
    u = np.zeros(dim)
    u[0] = 1.0
    half = len(weight) // 2
    weight[:half] = u + 0.05 * rng.normal(size=(half, dim))
    weight[half:] = -u + 0.05 * rng.normal(size=(len(weight) - half, dim))

    def near_u(x):
        return (u + 0.05 * x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    return near_u


def run_steps(case: str, rank: int, world: int) -> dict:
    sampled, fp16 = "sampled" in case or case == "varying", "fp16" in case
    # dense: every row's states and decay, every step; replay (center_update "exact"):
    # a sampled row first takes the steps it missed, so it matches the dense reference
    replay = "replay" in case
    lazy = "dense" not in case and not replay
    num_classes, dim = (400, 24) if sampled else (53, 24)
    # varying: 2% of a shard sampled, fewer rows than a batch's positives in the first
    # and last step, more in the middle one: the step's buffers shrink, then regrow
    # past their first size (buffers.py)
    sample_rate = {"varying": 0.02}.get(case, 0.2 if sampled else 1.0)
    batch_sizes = [4 + r for r in range(world)] if "unequal" in case else [5] * world
    batch_sizes = [8] * world if case == "varying" else batch_sizes
    margin, reference_margin, scale = margins(case)
    optimizer, lr, reference_update, start_states = center_optimizer(case)
    k = SUBCENTERS if "sub3" in case else 1
    threshold = FILTER if "filter" in case else 0.0
    rng = np.random.default_rng(1)
    weight = rng.normal(size=(num_classes * k, dim)).astype(np.float32)
    reshape = far_apart(rng, weight, dim) if case == "far" else (lambda x: x)
    states = start_states(rng, (num_classes * k, dim))
    # blocks: each shard stored in blocks of 11 rows, its sample spread over them
    pfc = PartialFC(num_classes, dim, rank=rank, world_size=world, sample_rate=sample_rate,
                    margin=margin, scale=scale, fp16_centers=fp16, seed=7,
                    center_update="exact" if replay else ("lazy" if lazy else "dense"),
                    optimizer=optimizer, center_block_rows=11 if "blocks" in case else None,
                    num_subcenters=k, interclass_filtering_threshold=threshold)
    assert len(pfc.centers.blocks) == (-(-pfc.shard.count * k // 11) if "blocks" in case else 1)
    # accum: a twin with the same seed samples the whole batch, as without accumulation
    twin = PartialFC(num_classes, dim, rank=rank, world_size=world, sample_rate=sample_rate,
                     seed=7, num_subcenters=k) if "accum" in case else None
    assert isinstance(pfc.rows, FusedRows)  # the CPU's
    if "composed" in case:  # the row passes a GPU runs, from MXNet operators
        pfc.rows = ComposedRows(pfc.buffers)
    if "gemm16" in case:  # the GEMMs' inputs rounded to bfloat16, by oneDNN 3
        pfc.gemm = OneDNNGemm(onednn_library(), threads=1)
    shard = slice(pfc.shard.start * k, pfc.shard.stop * k)  # the shard's rows
    stored = {name: parts[0].dtype for name, parts in pfc.centers.arrays().items()}
    # the reference starts from the same (rounded) values
    weight = weight.astype(stored.pop("weight"))
    states = {name: state.astype(stored[name]) for name, state in states.items()}
    pfc.centers.load_state_dict({"weight": weight[shard],
                                 **{name: state[shard] for name, state in states.items()}})
    ref_w = weight.astype(np.float64)
    ref_states = {name: state.astype(np.float64) for name, state in states.items()}
    errors = {"loss": 0.0, "grad": 0.0, "weight": 0.0, "update": 0.0,
              **{f"state_{name}": 0.0 for name in states}}
    sample_sizes, buffer_bytes = [], []
    steps = 3 if case == "varying" else 6 if replay else 2
    for step in range(steps):
        x, labels, offsets = problem(100 + step, world, num_classes, dim, batch_sizes)
        x = reshape(x)
        if threshold:  # every other row near its class's (first) center: a target cosine
            near = np.arange(0, len(x), 2)  # above the threshold, which must stay
            x[near] = weight[labels[near] * k] + 0.1 * x[near] / np.sqrt(dim)
        if case == "varying" and step == 1:
            labels %= 2  # two classes, both on rank 0
        mine = slice(offsets[rank], offsets[rank + 1])
        local_x = mx.nd.array(x[mine])
        if fp16 or "bf16" in case:  # the reference sees the same rounded embeddings
            dtype = "float16" if fp16 else BFLOAT16
            local_x = mx.nd.amp_cast(local_x, dtype=dtype)
            x = mx.nd.amp_cast(mx.nd.array(x), dtype=dtype).astype("float32").asnumpy()
        # replay: no state_dict (it brings every row current) until the last step, so
        # the forwards read rows that had missed steps
        before = None if replay else pfc.centers.state_dict()
        if twin is None:
            loss, grad = pfc.forward_backward(local_x, mx.nd.array(labels[mine]))
        else:
            loss, grad = accumulated(pfc, local_x, labels[mine])
            whole = twin.sample(labels)[0]
            assert np.array_equal(pfc._last_rows, whole), "another sample than the whole batch's"
            errors["micro_batches"] = 2
        pfc.step(lr)
        assert grad.dtype == local_x.dtype and grad.shape == local_x.shape
        sampled = np.sort(np.concatenate(hvd.allgather_object(pfc.sampled_classes)))
        sample_sizes.append(len(pfc.sampled_classes))
        buffer_bytes.append(pfc.buffers.nbytes())
        if "adaface" in case:  # the batch statistics, then the margin that uses them
            reference_margin.observe(np.linalg.norm(x.astype(np.float64), axis=1))
            kept = pfc.margin.state_dict()
            errors["statistics"] = max(errors.get("statistics", 0.0), rel(
                [kept["mean"], kept["std"]], [reference_margin.mean, reference_margin.std]))
            z = reference_margin.z(np.linalg.norm(x.astype(np.float64), axis=1))
            for name, rows in (("z=-1", z == -1), ("z=1", z == 1), ("|z|<1", abs(z) < 1)):
                errors[name] = errors.get(name, 0) + int(rows.sum())
        ref_loss, ref_gx, ref_gw, ref_filtered = loss_and_grads(
            x, labels, ref_w, reference_margin, scale, sampled, k, threshold)
        if threshold:  # the share of negatives filtered, and enough of them to matter
            got_filtered = pfc.filtered_fraction.asscalar()
            errors["filtered"] = max(errors.get("filtered", 0.0), rel(got_filtered, ref_filtered))
            errors["filtered_share"] = round(float(ref_filtered), 3)
            assert ref_filtered > 0.02, f"the filter took {ref_filtered:.3f} of the negatives"
            target_cos = own_class_cosines(x, labels, ref_w.reshape(num_classes, k, dim)[labels])
            protected = int((np.cos(np.arccos(target_cos.max(1)) + 0.5) > threshold).sum())
            assert protected > 0, "no target's logit is above the threshold: none protected"
            errors["protected_targets"] = protected
        sampled_rows = (sampled[:, None] * k + np.arange(k)).reshape(-1)
        updated = sampled_rows if lazy else np.arange(num_classes * k)
        new_w, new_states = reference_update(ref_w, ref_states, ref_gw, updated)
        errors["loss"] = max(errors["loss"], rel(loss.asscalar(), ref_loss))
        errors["grad"] = max(errors["grad"], rel(grad.astype("float32").asnumpy(), ref_gx[mine]))
        ref_w, ref_states, old_w = new_w, new_states, ref_w
        if before is None and step < steps - 1:
            continue
        got = pfc.centers.state_dict()
        errors["weight"] = max(errors["weight"], rel(got["weight"], new_w[shard]))
        for name, state in new_states.items():
            errors[f"state_{name}"] = max(errors[f"state_{name}"], rel(got[name], state[shard]))
        if before is None:
            continue
        errors["update"] = max(errors["update"],
                               rel(got["weight"] - before["weight"], (new_w - old_w)[shard]))
        mine_rows = (pfc.sampled_classes - pfc.shard.start)[:, None] * k + np.arange(k)
        untouched = np.setdiff1d(np.arange(pfc.shard.count * k), mine_rows)
        if len(untouched) and lazy:  # unsampled rows and every state of them: bit for bit
            for name in ["weight", *states]:
                assert got[name][untouched].tobytes() == before[name][untouched].tobytes(), \
                    f"{name} of an unsampled row changed"
            errors["untouched_rows"] = len(untouched)
        elif len(untouched):  # dense: they moved by their states and decay alone
            assert not np.array_equal(got["weight"][untouched], before["weight"][untouched])
            errors["moved_unsampled_rows"] = len(untouched)
        if case == "far":  # some rank's best logit of every row is past exp's range
            w_hat = old_w[sampled] / np.linalg.norm(old_w[sampled], axis=1, keepdims=True)
            cos = x / np.linalg.norm(x, axis=1, keepdims=True) @ w_hat.T
            mine = np.isin(sampled, pfc.sampled_classes)
            gap = scale * (cos[:, mine].max(1) - cos.max(1))
            # exp(-87.4) is below float32's smallest normal number: denormal or zero
            underflowed = hvd.allgather_object(int((gap < -87.4).sum()))
            assert max(underflowed) == len(x), (underflowed, gap)
            errors["underflowed_rows"] = underflowed[rank]
        if fp16:  # the stored values are rounded (float16 centers); continue from them
            ref_w = np.concatenate(hvd.allgather_object(got["weight"])).astype(np.float64)
            ref_states = {name: np.concatenate(hvd.allgather_object(got[name])).astype(np.float64)
                          for name in states}
    if case == "varying":
        errors["sample_sizes"] = "/".join(map(str, sample_sizes))
        a, b, c = sample_sizes
        assert a > b < c, f"the sample size did not shrink and grow: {sample_sizes}"
        regrown = hvd.allgather_object(buffer_bytes[2] > buffer_bytes[0])
        assert any(regrown), f"no rank's buffers grew past their first size: {buffer_bytes}"
    return errors


def accumulated(pfc: PartialFC, x: mx.nd.NDArray, labels: np.ndarray) -> tuple:
    """The batch's loss and gradient from 2 micro-batches (of unequal sizes where the
    batch is odd), accumulated."""
    pfc.accumulate(labels, 2)
    half = len(labels) // 2
    parts = [pfc.forward_backward(x[part], mx.nd.array(labels[part]))
             for part in (slice(0, half), slice(half, len(labels)))]
    return parts[0][0] + parts[1][0], mx.nd.concat(*(grad for _, grad in parts), dim=0)


def run_bad_input(case: str, rank: int, world: int) -> str:
    pfc = PartialFC(20, 8, rank=rank, world_size=world)
    x = np.ones((4, 8), np.float32)
    labels = np.array([1, 2, 3, 4], np.float32)
    culprit = world - 1
    if rank == culprit and case == "bad-label":
        labels[1:4] = [20, -1, 2.5]
    if rank == culprit and case == "nonfinite":
        x[2, 3] = np.nan
    if rank == culprit and case == "width":
        x = x[:, :7]
    try:
        pfc.forward_backward(mx.nd.array(x), labels)
    except PartialFCInputError as error:
        return str(error)
    raise AssertionError(f"rank {rank}: bad input on rank {culprit} was accepted")


def run_nan_center(rank: int, world: int, k: int) -> str:
    """A NaN in one rank's sampled centers must make the loss non-finite on every rank
    (the trainer stops on it), not be skipped by the pooled row maxima. (The CPU's
    softmax turns the row's sum into Inf, so its spare entry into 0: loss Inf, or NaN
    where that rank's share underflows to 0.)"""
    pfc = PartialFC(20, 8, rank=rank, world_size=world, num_subcenters=k)
    if rank == world - 1:  # with sub-centers, one of the class's others than its first
        weight = pfc.centers.state_dict()["weight"]
        weight[k + k // 2, 3] = np.nan
        pfc.centers.load_state_dict({"weight": weight})
    labels = np.arange(4) + 4 * rank
    loss, grad = pfc.forward_backward(mx.nd.ones((4, 8)), labels)
    grad.wait_to_read()  # its allreduce finishes before any rank exits
    value = loss.asscalar()
    assert not np.isfinite(value), f"rank {rank}: loss {value} with a NaN center"
    return f"loss is {value}"


def run_loss_scale(rank: int, world: int) -> str:
    """float16 training multiplies the embeddings' gradient by the loss scale. With a
    large global batch and embeddings of large norm the gradient is ~1e-8, below
    float16's smallest value (6e-8): it must be scaled before the cast to float16,
    or it is flushed to zero. The scaled float16 gradient may have no more zeros than
    the scaled float32 one stored in float16, and must match it to float16 precision."""
    rows, dim, scale = 2048, 16, 2.0**16
    rng = np.random.default_rng(rank)
    x16 = mx.nd.array(1e4 * rng.normal(size=(rows, dim))).astype("float16")
    labels = mx.nd.array(rng.integers(0, 64, rows))
    pfc = PartialFC(64, dim, rank=rank, world_size=world, margin=(1.0, 0.0, 0.0), scale=1.0)
    _, g32 = pfc.forward_backward(x16.astype("float32"), labels, grad_scale=scale)
    _, g16 = pfc.forward_backward(x16, labels, grad_scale=scale)
    _, unscaled = pfc.forward_backward(x16, labels)
    g32, g16 = g32.asnumpy(), g16.astype("float32").asnumpy()
    zeros32, zeros16 = int((g32.astype(np.float16) == 0).sum()), int((g16 == 0).sum())
    flushed = int((unscaled.astype("float32").asnumpy() == 0).sum())
    assert zeros16 <= zeros32, (zeros16, zeros32)
    assert flushed > g32.size // 2, f"the test's gradients are not small enough: {flushed}"
    error = rel(g16, g32)
    assert error < 2e-3, error
    return (f"zeros: scaled float16 {zeros16}, scaled float32 {zeros32}, float16 cast "
            f"before scaling {flushed} of {g32.size}; relative error {error:.1e}")


class AboveLimits(AssertionError):
    """A case's errors, measured after all its collectives, above their limits: the
    next case can run. Any other failure ends the process (and with it the launch),
    since the other ranks may wait in a collective this rank will not reach."""


def run_case(case: str, rank: int, world: int) -> str:
    """The line this rank prints for `case`; raises when its errors are above limits."""
    if case == "loss-scale":
        return f"PASS rank {rank}/{world} {case}: {run_loss_scale(rank, world)}"
    if case.endswith("nan-center"):
        k = SUBCENTERS if "sub3" in case else 1
        return f"PASS rank {rank}/{world} {case}: {run_nan_center(rank, world, k)}"
    if case in ("bad-label", "nonfinite", "width"):
        return f"REJECTED rank {rank}: {run_bad_input(case, rank, world)}"
    if "gemm16" in case and (refused := bfloat16_gemms_refused()):
        return f"PASS rank {rank}/{world} {case}: this CPU has no bfloat16 GEMMs: {refused}"
    grad_limit = next((v for k, v in ROUNDING.items() if k in case), TOLERANCE)
    center_limit = ROUNDING["fp16"] if "fp16" in case else TOLERANCE  # float16 storage
    errors = run_steps(case, rank, world)
    limits = {"loss": TOLERANCE, "grad": grad_limit, "weight": center_limit,
              "statistics": TOLERANCE, "filtered": TOLERANCE,
              "update": 100 * center_limit, "state_steps": 0.0,  # counts are exact
              **{k: center_limit for k in errors if k.startswith("state_") and k != "state_steps"}}
    if "gemm16" in case:
        limits.update({k: GEMM16["loss" if k == "loss" else "rest"] for k in limits
                       if k in ("loss", "grad", "weight", "update") or
                       (k.startswith("state_") and k != "state_steps")})
    failed = {k: v for k, v in errors.items() if k in limits and not v <= limits[k]}
    failed.update({k: v for k, v in errors.items() if k.startswith(("z=", "|z|")) and v == 0})
    report = " ".join(f"{k}={v:.2e}" if isinstance(v, float) else f"{k}={v}"
                      for k, v in errors.items())
    if failed:
        raise AboveLimits(f"rank {rank}/{world} {case}: errors above limits: {report}")
    return f"PASS rank {rank}/{world} {case}: {report}"


def bfloat16_gemms_refused() -> str | None:
    """pfc_gemm='bfloat16''s refusal on a CPU without bfloat16 arithmetic (AVX2, or
    DNNL_MAX_CPU_ISA below AVX512_CORE_BF16), None where it computes them; the refusal
    is asserted, so the case tests something on every CPU."""
    if effective_isa(onednn_library()) & ISA_BFLOAT16:
        return None
    try:
        choose("bfloat16", on_gpu=False)
    except GemmChoiceError as refusal:
        assert "without bfloat16 arithmetic" in str(refusal), refusal
        return str(refusal)
    raise AssertionError("pfc_gemm='bfloat16' was taken on a CPU without bfloat16")


def main() -> None:
    """Runs every case named; one whose errors are above limits prints FAIL and the
    next one runs, and the exit code says so."""
    hvd.init()
    rank, world = hvd.rank(), hvd.size()
    failed = False
    for case in sys.argv[1:]:
        try:
            print(run_case(case, rank, world), flush=True)
        except AboveLimits as error:
            print(f"FAIL rank {rank}/{world} {case}: {error}", flush=True)
            failed = True
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
