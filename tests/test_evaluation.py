"""Verification math, .bin reading, ONNX export/parity/checks, and their errors."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import mxnet as mx
import numpy as np
import onnx
import pytest
from conftest import python_module, run
from onnx import TensorProto, helper, numpy_helper

from partial_fc_mx.backbones import get_model
from partial_fc_mx.data.recordio import DataError
from partial_fc_mx.data.transforms import encode_jpeg
from partial_fc_mx.evaluation.validator import Validator
from partial_fc_mx.evaluation.verification import (
    NonFiniteEmbeddings,
    best_threshold,
    embed,
    load_bin,
    pair_similarities,
    tar_at_far,
    ten_fold_accuracy,
    verify,
)
from partial_fc_mx.run import checkpoint
from partial_fc_mx.run.export import (
    ExportError,
    check_onnx,
    export_onnx,
    load_backbone,
    onnx_session,
    parity,
)


def test_known_accuracy_from_constructed_similarities():
    rng = np.random.default_rng(0)
    issame = np.array([True, False] * 100)
    similarity = np.where(issame, rng.uniform(0.6, 1.0, 200), rng.uniform(-0.2, 0.4, 200))
    assert ten_fold_accuracy(similarity, issame).accuracy == 1.0
    flipped = np.flatnonzero(issame)[::10]  # 10 genuine pairs made to look like strangers
    similarity[flipped] = 0.0
    result = ten_fold_accuracy(similarity, issame)
    assert result.accuracy == pytest.approx(0.95) and 0.4 <= result.threshold <= 0.6


def test_threshold_is_the_best_cut_and_folds_never_see_their_own_pairs():
    rng = np.random.default_rng(1)
    similarity, issame = rng.normal(size=300), rng.random(300) < 0.5
    brute = max(np.unique(np.concatenate([similarity - 1e-9, similarity + 1e-9])),
                key=lambda t: np.sum((similarity > t) == issame))
    cut = best_threshold(similarity, issame)
    assert np.sum((similarity > cut) == issame) == np.sum((similarity > brute) == issame)
    folds = np.array_split(np.arange(300), 10)
    expected = np.mean([np.mean((similarity[f] > best_threshold(
        np.delete(similarity, f), np.delete(issame, f))) == issame[f]) for f in folds])
    assert ten_fold_accuracy(similarity, issame).accuracy == pytest.approx(expected)


def test_tar_at_far_counts_and_refuses_unresolvable_rates():
    impostors = np.linspace(0, 0.5, 2000)
    genuine = np.linspace(0.49, 1.0, 1000)
    similarity = np.concatenate([impostors, genuine])
    issame = np.concatenate([np.zeros(2000, bool), np.ones(1000, bool)])
    threshold = np.sort(impostors)[::-1][2]  # 2 impostors above = FAR 1e-3
    assert tar_at_far(similarity, issame, 1e-3) == pytest.approx(np.mean(genuine > threshold))
    assert tar_at_far(similarity, issame, 1e-4) is None  # needs 10,000 impostor pairs
    assert set(ten_fold_accuracy(similarity, issame).tar_at_far) == {1e-3}


def test_embeddings_sum_the_mirror_image_and_are_normalized():
    images = np.zeros((2, 3, 112, 112), np.float32)
    images[:, :, :, 0] = 1.0  # a bright left column; its mirror is bright on the right
    forward = lambda b: np.stack([b[:, 0, 0, 0], b[:, 0, 0, -1]], axis=1)  # noqa: E731
    np.testing.assert_allclose(embed(forward, images), np.full((2, 2), 2 ** -0.5))


def write_bin(path: Path, images: list, issame: list) -> Path:
    path.write_bytes(pickle.dumps((images, issame)))
    return path


def test_bin_files_are_read_and_bad_ones_named(tmp_path):
    face = encode_jpeg(np.full((112, 112, 3), 128, np.uint8))
    issame = [True, False] * 5
    good = load_bin(write_bin(tmp_path / "good.bin", [face] * 20, issame))
    assert good.images.shape == (20, 3, 112, 112) and good.issame.tolist() == issame
    (tmp_path / "text.bin").write_text("hello")
    with pytest.raises(DataError, match=r"text\.bin is not an insightface \.bin"):
        load_bin(tmp_path / "text.bin")
    with pytest.raises(DataError, match=r"odd\.bin holds 21 images for 10 pairs"):
        load_bin(write_bin(tmp_path / "odd.bin", [face] * 21, issame))
    with pytest.raises(DataError, match=r"broken\.bin: image 1 cannot be decoded"):
        load_bin(write_bin(tmp_path / "broken.bin", [face, b"junk"] * 10, issame))


def test_each_distinct_face_is_embedded_once_with_the_same_result(tmp_path):
    """Pair sets reuse faces; embedding each distinct one once must not change any
    similarity: the result equals embedding all 2K images."""
    rng = np.random.default_rng(3)
    faces = [encode_jpeg(rng.integers(0, 256, (112, 112, 3), np.uint8)) for _ in range(6)]
    picks = rng.integers(0, 6, 40)
    issame = (picks[0::2] % 3 == picks[1::2] % 3).tolist()
    dataset = load_bin(write_bin(tmp_path / "reused.bin", [faces[i] for i in picks], issame))
    assert dataset.images.shape == (40, 3, 112, 112)
    assert len(dataset.distinct) == len(set(picks.tolist()))
    projection = rng.standard_normal((3 * 112 * 112, 8)).astype(np.float32)
    seen = []

    def forward(batch):
        seen.append(len(batch))
        return batch.reshape(len(batch), -1) @ projection

    result = verify(forward, dataset)
    assert sum(seen) == 2 * len(dataset.distinct)  # each face and its mirror image, once
    every_image = embed(forward, dataset.images)
    per_image = embed(forward, dataset.images[dataset.distinct])[dataset.where]
    np.testing.assert_allclose(per_image, every_image, rtol=1e-5, atol=1e-5)  # same order
    flat = dataset.images.reshape(40, -1)
    identical = (flat[:, None, :] == flat[None, :, :]).all(axis=2)
    np.testing.assert_array_equal(identical, picks[:, None] == picks[None, :])
    expected = ten_fold_accuracy(pair_similarities(every_image), np.asarray(issame))
    assert result.accuracy == expected.accuracy and result.threshold == pytest.approx(
        expected.threshold, abs=1e-5)


def test_a_set_whose_embeddings_are_not_finite_is_not_scored_and_says_so(tmp_path):
    """In eval mode a network a few steps old can overflow: `verify` (the step-0
    evaluation, `eval`) names the set instead of scoring meaningless similarities; the
    validator scores the other sets and keeps no best model of that step."""
    rng = np.random.default_rng(6)
    faces = [encode_jpeg(rng.integers(0, 256, (112, 112, 3), np.uint8)) for _ in range(4)]
    flat = [encode_jpeg(np.full((112, 112, 3), level, np.uint8)) for level in (0, 255)]
    picks = rng.integers(0, 4, 40)
    issame = (picks[0::2] == picks[1::2]).tolist()
    faces_set = load_bin(write_bin(tmp_path / "faces.bin", [faces[i] for i in picks], issame))
    flat_set = load_bin(write_bin(tmp_path / "flat.bin", [flat[i % 2] for i in picks], issame))
    projection = rng.standard_normal((3 * 112 * 112, 8)).astype(np.float32)

    def overflowing_on_flat_images(batch):
        pixels = batch.reshape(len(batch), -1)
        out = pixels @ projection
        out[pixels.std(axis=1) == 0] = np.inf
        return out

    with pytest.raises(NonFiniteEmbeddings, match=r"^flat: the embeddings of 2 of its 2 images "
                                                  r"are not finite \(inf or NaN\), so the "
                                                  r"model is not scored"):
        verify(overflowing_on_flat_images, flat_set)
    validator = Validator([faces_set, flat_set], tmp_path)
    validator.accuracy = {"faces": 0.5, "flat": 0.9}  # an earlier step's
    results = validator.evaluate(overflowing_on_flat_images, step=4)
    assert list(results) == ["faces"] and list(validator.unscored) == ["flat"]
    assert list(validator.accuracy) == ["faces"]  # not flat's score of an earlier step
    saved = []
    assert validator.keep_if_best(4, saved.append) is None and saved == []
    validator.evaluate(lambda batch: batch.reshape(len(batch), -1) @ projection, step=6)
    assert validator.unscored == {} and validator.keep_if_best(6, saved.append) is not None


def test_the_validator_keeps_the_best_model_and_its_record_across_a_resume(tmp_path):
    """Only a better mean accuracy after step 0 replaces backbone-best-*; the record
    follows the model; a resume takes the checkpoint's best or the record's, whichever
    is better, and ignores a record it cannot read."""
    rng = np.random.default_rng(5)
    faces = [encode_jpeg(rng.integers(0, 256, (112, 112, 3), np.uint8)) for _ in range(4)]
    picks = rng.integers(0, 4, 40)
    sets = [load_bin(write_bin(tmp_path / f"{name}.bin", [faces[i] for i in picks],
                               (picks[0::2] == picks[1::2]).tolist())) for name in "ab"]
    validator = Validator(sets, tmp_path)
    projection = rng.standard_normal((3 * 112 * 112, 8)).astype(np.float32)

    def forward(batch):
        return batch.reshape(len(batch), -1) @ projection

    results = validator.evaluate(forward, step=0)
    assert list(results) == ["a", "b"] and results["a"] == verify(forward, sets[0])
    assert validator.accuracy == {"a": results["a"].accuracy, "b": results["b"].accuracy}
    saved = []
    assert validator.keep_if_best(0, saved.append) is None and saved == []  # untrained
    validator.accuracy = {"a": 0.6, "b": 0.8}
    assert validator.keep_if_best(2, saved.append) == pytest.approx(0.7)
    assert saved == [tmp_path / "backbone-best"]
    record = tmp_path / "backbone-best.json"
    assert json.loads(record.read_text()) == {"accuracy": pytest.approx(0.7), "step": 2}
    validator.accuracy = {"a": 0.9, "b": 0.5}  # equal mean: not better
    assert validator.keep_if_best(4, saved.append) is None and len(saved) == 1
    step_0 = {"a": results["a"].accuracy, "b": results["b"].accuracy}  # before training
    assert validator.state_dict() == {"best_accuracy": pytest.approx(0.7), "best_step": 2,
                                      "evaluated_step": None,  # the trainer sets it
                                      "before_training": step_0}

    resumed = Validator([], tmp_path)
    resumed.load_state_dict({"best_accuracy": 0.65, "best_step": 1})  # an older format
    assert (resumed.best_accuracy, resumed.best_step) == (pytest.approx(0.7), 2)  # record's
    assert resumed.before_training == {}
    resumed.load_state_dict(validator.state_dict())
    assert resumed.before_training == step_0
    resumed.load_state_dict({"best_accuracy": 0.75, "best_step": 3})
    assert (resumed.best_accuracy, resumed.best_step) == (0.75, 3)  # the checkpoint's
    record.write_text("{half a rec")
    resumed.load_state_dict({"best_accuracy": 0.65, "best_step": 1})
    assert (resumed.best_accuracy, resumed.best_step) == (0.65, 1)


@pytest.mark.parametrize("pairs", [0, 1, 9])
def test_bin_files_with_too_few_pairs_for_ten_folds_are_refused(tmp_path, pairs):
    face = encode_jpeg(np.full((112, 112, 3), 128, np.uint8))
    path = write_bin(tmp_path / "few.bin", [face] * (2 * pairs), [True] * pairs)
    with pytest.raises(DataError, match=rf"few\.bin holds {pairs} pairs; the 10-fold protocol "
                                        "needs at least 10"):
        load_bin(path)


def test_bin_files_in_the_layouts_insightface_wrote_are_read(tmp_path):
    """Python 2 pickles (protocol 2: bytes via _codecs.encode), images as uint8 arrays,
    issame as a numpy array."""
    face = encode_jpeg(np.full((112, 112, 3), 128, np.uint8))
    issame = np.array([True, False] * 5)
    as_arrays = [np.frombuffer(face, np.uint8)] * 20
    for name, content, protocol in (("py2.bin", ([face] * 20, issame.tolist()), 2),
                                    ("arrays.bin", (as_arrays, issame), 4),
                                    ("arrays5.bin", (as_arrays, issame), 5)):
        (tmp_path / name).write_bytes(pickle.dumps(content, protocol=protocol))
        loaded = load_bin(tmp_path / name)
        assert loaded.images.shape == (20, 3, 112, 112), name
        assert loaded.issame.tolist() == issame.tolist(), name


class CreatesAFile:
    """A pickle payload: unpickling it would call os.system and create a file."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.target}",)


def test_a_crafted_bin_is_refused_without_running_its_payload(tmp_path, work_dir):
    target = tmp_path / "pwned"
    face = encode_jpeg(np.full((112, 112, 3), 128, np.uint8))
    crafted = write_bin(tmp_path / "crafted.bin", [face] * 19 + [CreatesAFile(target)],
                        [True] * 10)
    pickle.loads(pickle.dumps(CreatesAFile(tmp_path / "control")))  # the payload works
    assert (tmp_path / "control").exists()
    with pytest.raises(DataError, match=r"crafted\.bin is not an insightface \.bin.*"
                                        r"references posix\.system.*refused without running"):
        load_bin(crafted)
    assert not target.exists()
    result = run(python_module("eval", "--model", str(work_dir), "--bin", str(crafted)))
    assert result.returncode == 2 and "references posix.system" in result.stdout
    assert not target.exists()


@pytest.fixture(scope="module")
def work_dir(tmp_path_factory) -> Path:
    """A real backbone exported as training does (checkpoint.save_backbone) and as ONNX."""
    directory = tmp_path_factory.mktemp("work")
    net = get_model("tiny", embedding_size=64)
    net.initialize(mx.init.Xavier())
    net.hybridize()
    with mx.autograd.record():  # some BatchNorm statistics that are not the defaults
        net(mx.nd.random.normal(shape=(8, 3, 112, 112)))
    checkpoint.save_backbone(net, directory / "backbone")
    export_onnx(directory)
    return directory


def test_onnx_matches_mxnet_with_a_dynamic_batch(work_dir):
    assert parity(work_dir) <= 1e-4
    model = onnx.load(str(work_dir / "backbone.onnx"))
    onnx.checker.check_model(model)
    assert len(model.graph.input) == 1  # weights are initializers, not inputs
    session = onnx_session(work_dir / "backbone.onnx")
    x = np.random.default_rng(0).standard_normal((3, 3, 112, 112), dtype=np.float32)
    out = session.run(None, {session.get_inputs()[0].name: x})[0]
    expected = load_backbone(work_dir)(mx.nd.array(x)).asnumpy()
    assert out.shape == (3, 64) and np.abs(out - expected).max() <= 1e-4


def test_parity_sees_a_wrong_scale_and_export_and_parity_refuse_non_finite_embeddings(
        work_dir, tmp_path):
    for name in ("backbone-symbol.json", "backbone-0000.params", "backbone.onnx"):
        shutil.copy(work_dir / name, tmp_path / name)
    model = onnx.load(str(tmp_path / "backbone.onnx"))  # the same model, output x 2
    output = model.graph.output[0]
    model.graph.initializer.append(numpy_helper.from_array(np.array(2, np.float32), "two"))
    model.graph.node.append(helper.make_node("Mul", [output.name, "two"], ["doubled"]))
    output.name = "doubled"
    onnx.save(model, str(tmp_path / "backbone.onnx"))
    assert parity(tmp_path) == pytest.approx(1.0, rel=1e-3)  # normalized, they agree
    params = mx.nd.load(str(tmp_path / "backbone-0000.params"))
    params[sorted(params)[0]][:] = np.nan
    mx.nd.save(str(tmp_path / "backbone-0000.params"), params)
    with pytest.raises(ExportError, match="embeddings of random inputs are not finite"):
        parity(tmp_path)
    before = (tmp_path / "backbone.onnx").read_bytes()
    with pytest.raises(ExportError, match="not finite .*backbone.onnx was not written"):
        export_onnx(tmp_path)  # the overflowing model is not exported over the last one
    assert (tmp_path / "backbone.onnx").read_bytes() == before


def test_checker_reports_the_figures_and_budgets(work_dir):
    path = work_dir / "backbone.onnx"
    report = check_onnx(path, runs=5)
    assert report.output_shape == [1, 64] and report.input_shape[1:] == [3, 112, 112]
    assert report.size_mb == pytest.approx(path.stat().st_size / 2**20)
    assert report.latency_ms > 0 and report.warnings == []
    strict = check_onnx(path, runs=5, max_mb=0.001, max_ms=1e-6)
    assert len(strict.warnings) == 2 and "exceeds the budget 0.001 MB" in strict.warnings[0]


def test_wrong_onnx_input_and_missing_backbone_are_clear_errors(tmp_path):
    graph = helper.make_graph(
        [helper.make_node("Flatten", ["x"], ["y"])], "small",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 64, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3 * 64 * 64])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]),
              str(tmp_path / "small.onnx"))
    with pytest.raises(DataError, match=r"takes tensor\(float\) of shape \[1, 3, 64, 64\]; "
                                        "expected float N x 3 x 112 x 112"):
        check_onnx(tmp_path / "small.onnx")
    with pytest.raises(DataError, match="has no backbone-symbol.json: not a work dir"):
        export_onnx(tmp_path)
    with pytest.raises(DataError, match="does not exist"):
        onnx_session(tmp_path / "none.onnx")
