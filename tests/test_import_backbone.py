"""import-backbone: models of arcface_torch and insightface become work dirs that train,
evaluate and export, computing what the source computes, or the import says where not.

The ONNX sources are built as arcface_torch's torch2onnx.py writes them (onnx_models.py:
BatchNorms folded into convolutions, or kept); the MXNet-era one is insightface's own
fresnet.py graph (tests/data, with the script that made it) with random weights.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import mxnet as mx
import numpy as np
import pytest
from conftest import REPO, config_file, mpirun, python_module, run, train_args
from mxnet.gluon import nn
from onnx_models import insightface_mxnet_model, mobilefacenet, tiny, vit

from partial_fc_mx.evaluation.verification import cosines, mxnet_forward
from partial_fc_mx.imports.calibration import calibrate
from partial_fc_mx.imports.importer import import_backbone as import_in_process
from partial_fc_mx.imports.layers import BackboneImportError
from partial_fc_mx.imports.mapping import identity_with_bias
from partial_fc_mx.imports.mxnet_source import model_files
from partial_fc_mx.prep.synthetic import prepare_synthetic
from partial_fc_mx.run.export import load_backbone

INSIGHTFACE = REPO / "tests" / "data"
TINY_FOLDED = 10
"""BatchNorms after a convolution in `tiny`: the stem's, and in each of its 3 units the
two of the body and the shortcut's."""


@pytest.fixture(scope="module")
def few_faces(tmp_path_factory) -> Path:
    """32 packed faces for --calibrate: 16 calibrate, 16 measure the agreement (the
    default 256 ORL faces take a minute of forwards for an mbf or a ViT)."""
    faces = tmp_path_factory.mktemp("faces") / "faces"
    prepare_synthetic(str(faces), 8, per_class=4, heldout=2, pairs=2)
    return faces


def import_backbone(source: Path, work: Path, network: str, *extra: str):
    return run(python_module("import-backbone", str(source), str(work), "--network", network,
                             *extra))


def worst_cosine(stdout: str) -> float:
    return float(re.search(r"worst cosine of ([\d.]+) \(>=", stdout).group(1))


def pixels(count: int = 4) -> np.ndarray:
    return np.random.default_rng(7).uniform(0, 255, (count, 3, 112, 112)).astype(np.float32)


def ours(work: Path, images: np.ndarray) -> np.ndarray:
    """The imported work dir's embeddings, as `eval` computes them."""
    return mxnet_forward(load_backbone(work), mx.cpu())((images - 127.5) / 128)


def agreement(got: np.ndarray, expected: np.ndarray) -> tuple[float, float]:
    """(worst cosine, largest difference relative to the largest value), in float64: the
    import is exact up to float32 rounding, so both are checked far tighter than its
    own 0.9999 (a BatchNorm epsilon of 2e-5 taken for 1e-5 in an r18 moves the
    embeddings by 9e-5 of their largest value)."""
    got, expected = got.astype(np.float64), expected.astype(np.float64)
    return (float(cosines(got, expected).min()),
            float(np.abs(got - expected).max() / np.abs(expected).max()))


def onnx_embeddings(path: Path, images: np.ndarray, normalized_inside: bool) -> np.ndarray:
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feed = images if normalized_inside else (images - 127.5) / 127.5  # arcface_torch's
    return np.concatenate([session.run(None, {"data": feed[i:i + 1].astype(np.float32)})[0]
                           for i in range(len(feed))])  # a dynamo export takes 1 at a time


@pytest.mark.parametrize("folded, options", [
    (True, {}), (False, {}), (False, {"conv_bias": True, "features_gamma": True}),
    (True, {"features_folded": True})],
    ids=["folded", "kept", "kept-conv-bias-learned-embedding-scale", "dynamo-folded-embedding"])
def test_an_arcface_torch_onnx_imports_as_the_same_network_and_exports(tmp_path, folded,
                                                                         options):
    source = tiny(tmp_path / "model.onnx", folded=folded, **options)
    work = tmp_path / "work"
    imported = import_backbone(source, work, "tiny")
    assert imported.returncode == 0, imported.stdout[-3000:]
    assert worst_cosine(imported.stdout) >= 0.9999
    worst, relative = agreement(ours(work, pixels()), onnx_embeddings(source, pixels(), False))
    assert worst > 1 - 1e-7 and relative < 2e-5
    calibrated = re.search(r"(\d+) BatchNorms the export had folded", imported.stdout)
    expected_folded = (TINY_FOLDED + options.get("features_folded", 0)) if folded else 0
    assert (int(calibrated.group(1)) if calibrated else 0) == expected_folded
    if calibrated:  # the agreement is read for the user: random weights give less
        assert re.search(r"agree with inference to a worst cosine of [\d.]+, (as for|below "
                         r"the 0\.9 of) real trained models \(0\.93-0\.95 measured\)",
                         imported.stdout), imported.stdout
    meta = json.loads((work / "checkpoints" / "step_000000" / "meta.json").read_text())
    assert meta["backbone_only"] and meta["network"] == "tiny"
    assert meta["embedding_size"] == 512
    assert json.loads((work / "backbone.json").read_text())["step"] == 0
    exported = run(python_module("export", str(work)))  # our ONNX of it equals our MXNet
    assert exported.returncode == 0, exported.stdout[-2000:]


def test_an_arcface_torch_mobilefacenet_onnx_imports_as_mbf(tmp_path, few_faces):
    """Grouped and depthwise convolutions, the GDC's 7 x 7 one, and a fully connected
    layer without a bias, which the exporter writes as MatMul with its weight
    transposed."""
    source = mobilefacenet(tmp_path / "mbf.onnx")
    imported = import_backbone(source, tmp_path / "work", "mbf", "--calibrate", str(few_faces))
    assert imported.returncode == 0, imported.stdout[-3000:]
    worst, relative = agreement(ours(tmp_path / "work", pixels()),
                                onnx_embeddings(source, pixels(), False))
    assert worst > 1 - 1e-7 and relative < 2e-5


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript-opset11", "dynamo-opset18"])
def test_an_arcface_torch_vit_onnx_imports_as_the_same_vit(tmp_path, dynamo, few_faces):
    """A ViT's LayerNorms (spelled out below opset 17, one node from it), its patch
    convolution's bias, its position embedding (a constant added to the tokens) and
    the attention's arithmetic between the weighted layers; the dynamo export's head
    with its BatchNorms folded into the fully connected layers, calibrated with the
    patch masking left out (else the agreement reads the masks, about 0.4). A vit_t
    graph does not fit vit_s, and a LayerNorm epsilon other than ours is refused."""
    source = vit(tmp_path / "vit_t.onnx", dynamo)
    imported = import_backbone(source, tmp_path / "work", "vit_t", "--calibrate",
                               str(few_faces))
    assert imported.returncode == 0, imported.stdout[-3000:]
    worst, relative = agreement(ours(tmp_path / "work", pixels(2)),
                                onnx_embeddings(source, pixels(2), False))
    assert worst > 1 - 1e-7 and relative < 2e-5
    if dynamo:
        assert re.search(r"2 BatchNorms the export had folded .* 16 faces .* agree with "
                         r"inference to a "
                         r"worst cosine of 0\.9[0-9]+", imported.stdout), imported.stdout[-2000:]
        return
    other_eps = vit(tmp_path / "eps.onnx", dynamo, depth=1, norm_eps=1e-6)  # refused
    with pytest.raises(BackboneImportError, match=r"its layer 0, convolution 256x3x9x9 .* "
                       r"does not fit our patch_embed"):  # before the graph's end
        import_in_process(other_eps, tmp_path / "vit_s", "vit_s")
    with pytest.raises(BackboneImportError, match=r"LayerNorm of 256 features .* does not fit "
                       r"our blocks\.0\.norm1 \(LayerNorm\): epsilon 1e-06 where ours is "
                       r"1e-05"):
        import_in_process(other_eps, tmp_path / "eps", "vit_t")


@pytest.mark.parametrize("normalize, refused", [((127.5, 1 / 128), None),
                                                ((100.0, 1 / 128), "mean 100")])
def test_a_graph_normalizing_its_input_imports_when_its_mean_is_127_5(tmp_path, normalize,
                                                                      refused):
    source = tiny(tmp_path / "model.onnx", normalize=normalize)
    imported = import_backbone(source, tmp_path / "work", "tiny")
    if refused is None:
        assert imported.returncode == 0, imported.stdout[-3000:]
        worst, relative = agreement(ours(tmp_path / "work", pixels()),
                                    onnx_embeddings(source, pixels(), True))
        assert worst > 1 - 1e-7 and relative < 2e-5
    else:
        assert imported.returncode == 2
        assert refused in imported.stdout and "only a mean of 127.5" in imported.stdout


@pytest.mark.parametrize("network, embedding, classifier", [
    ("r18", 512, 0), ("mobilefacenet", 128, 0), ("r18", 512, 1000)],
    ids=["r18", "mobilefacenet", "r18-saved-with-fc7"])
def test_an_insightface_mxnet_era_model_imports_as_the_same_network(tmp_path, network,
                                                                    embedding, classifier):
    """fresnet's IResNet and fmobilefacenet's MobileFaceNet (whose embedding layer has a
    bias before its BatchNorm, moved into the BatchNorm's mean); a checkpoint saved in
    training, with the classifier after the embedding, is cut at the embedding."""
    symbol = INSIGHTFACE / f"insightface_{network}-symbol.json"
    insightface_mxnet_model(tmp_path / "model", symbol, classifier=classifier)
    imported = import_backbone(Path(f"{tmp_path / 'model'},0"), tmp_path / "work", network)
    assert imported.returncode == 0, imported.stdout[-3000:]
    assert f"{embedding}-d embeddings" in imported.stdout
    assert "folded" not in imported.stdout  # its BatchNorms are all there
    theirs = mx.gluon.SymbolBlock.imports(str(symbol), ["data"],
                                          str(tmp_path / "model-0000.params"),
                                          allow_missing=False, ignore_extra=True)
    worst, relative = agreement(ours(tmp_path / "work", pixels()),
                                theirs(mx.nd.array(pixels())).asnumpy())
    assert worst > 1 - 1e-7 and relative < 2e-5


def test_a_wrong_network_is_refused_at_the_first_layer_that_does_not_fit(tmp_path):
    insightface_mxnet_model(tmp_path / "model", INSIGHTFACE / "insightface_r18-symbol.json")
    wrong = import_backbone(tmp_path / "model-symbol.json", tmp_path / "other", "r34")
    assert wrong.returncode == 2
    assert re.search(r"its layer \d+, convolution 128x64x3x3 .* does not fit our "
                     r"features\.\d+\.body\.1", wrong.stdout), wrong.stdout[-2000:]
    assert not (tmp_path / "other" / "checkpoints").exists()


def test_the_epoch_of_an_mxnet_model_is_the_one_named(tmp_path):
    (tmp_path / "m-symbol.json").write_text("{}")
    for epoch in (0, 10):
        (tmp_path / f"m-{epoch:04d}.params").write_bytes(b"")
    assert model_files(tmp_path / "m-0010.params")[1].name == "m-0010.params"
    assert model_files(f"{tmp_path / 'm'},10")[1].name == "m-0010.params"
    assert model_files(tmp_path / "m-symbol.json,0")[1].name == "m-0000.params"
    with pytest.raises(BackboneImportError, match=r"several epochs .*: name one, e\.g\. "
                                                  r".*m,10"):
        model_files(tmp_path / "m-symbol.json")


def test_a_graph_that_computes_otherwise_is_refused_naming_the_first_layer_that_differs(
        tmp_path):
    source = tiny(tmp_path / "model.onnx", scale_after="layer1.0.prelu")
    imported = import_backbone(source, tmp_path / "work", "tiny")
    assert imported.returncode == 2
    assert ("the first layer that differs is our features.3.body.5 against its "
            "'/layer1/layer1.0/conv2/Conv_output_0'") in imported.stdout, imported.stdout[-2000:]
    assert not (tmp_path / "work" / "checkpoints").exists()


def test_a_source_whose_own_activations_overflow_is_named_so_not_called_another_network(
        tmp_path):
    source = tiny(tmp_path / "model.onnx", scale_after="layer1.0.prelu", scale_by=3e38)
    imported = import_backbone(source, tmp_path / "work", "tiny")
    assert imported.returncode == 2
    assert re.search(r"model\.onnx: the source's own outputs are not finite \(inf or NaN\) "
                     r"from its '/layer1/layer1\.0/\S+' \(our features\.\S+\) on",
                     imported.stdout), imported.stdout[-2000:]
    assert "is not the model's architecture" not in imported.stdout
    assert "RuntimeWarning" not in imported.stdout
    assert not (tmp_path / "work" / "checkpoints").exists()


def test_a_file_that_is_no_model_is_named(tmp_path):
    (tmp_path / "x.onnx").write_bytes(b"not a protobuf")
    imported = import_backbone(tmp_path / "x.onnx", tmp_path / "work", "tiny")
    assert imported.returncode == 2 and "x.onnx is not a readable ONNX file" in imported.stdout
    missing = import_backbone(tmp_path / "nothing", tmp_path / "work", "tiny")
    assert missing.returncode == 2 and "nothing-symbol.json does not exist" in missing.stdout


def test_fine_tuning_starts_from_the_imported_backbone_with_fresh_centers(tmp_path, synthetic):
    source, imported_dir = tiny(tmp_path / "model.onnx", embedding=64), tmp_path / "imported"
    imported = import_backbone(source, imported_dir, "tiny", "--calibrate", str(synthetic))
    assert imported.returncode == 0, imported.stdout[-3000:]
    assert f"statistics from 128 faces of {synthetic}" in imported.stdout
    again = import_backbone(source, imported_dir, "tiny")
    assert again.returncode == 2 and "holds checkpoints of a run already" in again.stdout
    work = tmp_path / "work"
    config = config_file(tmp_path, synthetic, max_steps=2, lr=1e-9)
    checked = run(python_module("check", str(config), "--load-from", str(imported_dir)))
    assert checked.returncode == 0, checked.stdout[-3000:]  # run.sh's preflight takes it
    assert f"{imported_dir / 'checkpoints' / 'step_000000'} verifies" in checked.stdout
    tuned = mpirun(2, train_args(config, work, "--load-from", str(imported_dir)))
    assert tuned.returncode == 0, tuned.stdout[-3000:]
    log = (work / "training.log").read_text()
    assert f"loaded the weights of {imported_dir / 'checkpoints' / 'step_000000'}" in log
    before = mx.nd.load(str(imported_dir / "checkpoints" / "step_000000" / "backbone.params"))
    after = mx.nd.load(str(work / "checkpoints" / "step_000002" / "backbone.params"))
    for name in ("features.0.weight", "head.body.3.weight"):  # lr ~ 0: what was loaded
        np.testing.assert_allclose(after[name].asnumpy(), before[name].asnumpy(), atol=1e-6)
    centers = np.load(work / "checkpoints" / "step_000002" / "rank_0_softmax_weight.npy")
    assert np.isfinite(centers).all() and 0.005 < centers.std() < 0.02  # drawn: N(0, 0.01)
    resumed = run(train_args(config, work, "--resume-from", str(imported_dir)))
    assert resumed.returncode == 1
    assert "holds an imported backbone only: train from it with --load-from" in resumed.stdout
    other = run(train_args(config, work, "embedding_size=128", "--load-from", str(imported_dir)))
    assert other.returncode == 1
    assert "holds a backbone of 64-d embeddings" in other.stdout, other.stdout[-2000:]


@pytest.mark.parametrize("learned_scale, weight_std, low, agreement", [
    (True, 2.0, 0, (0.9, 0.9999)), (False, 0.3, 128, (0.8, 0.9))],
    ids=["learned-scale", "scale-fixed-at-1"])
def test_calibration_keeps_inference_and_makes_training_agree_with_it(learned_scale, low,
                                                                     weight_std, agreement):
    """A BatchNorm that stands for a folded one (the identity plus a bias) gets its
    input's statistics: inference is unchanged, and a batch's own statistics in
    training now give what inference gives, where before they did not. One whose scale
    is fixed at 1 (the embedding's) is only centred: it agrees where its input's spread
    is near 1, as after the BatchNorm an export folded away."""
    rng = np.random.default_rng(0)
    net = nn.HybridSequential()
    net.add(nn.Conv2D(8, 3, padding=1, use_bias=False),
            nn.BatchNorm(epsilon=1e-5, scale=learned_scale))
    net.initialize()
    net.infer_shape(mx.nd.zeros((1, 3, 112, 112)))
    net[0].weight.set_data(mx.nd.array(rng.normal(0, weight_std, (8, 3, 3, 3))))
    identity_with_bias(net[1], rng.normal(0, 0.5, 8))
    images = rng.integers(low, 256, (16, 112, 112, 3), dtype=np.uint8)
    x = mx.nd.array((images.transpose(0, 3, 1, 2) - 127.5) / 128)

    def outputs():
        inference = net(x).asnumpy()
        with mx.autograd.train_mode():
            training = net(x).asnumpy()
        return inference, training

    before, training_before = outputs()
    assert cosines(before, training_before).min() < agreement[0]
    calibrate(net, ["1"], images)
    after, training_after = outputs()
    np.testing.assert_allclose(after, before, rtol=1e-4, atol=1e-4 * np.abs(before).max())
    assert cosines(after, training_after).min() > agreement[1]
