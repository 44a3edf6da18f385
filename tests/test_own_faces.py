"""Bring your own faces: alignment from 5 landmarks, packing with it, .bin sets from
your own pairs, the IJB-B/C 1:1 protocol, and `check` without a config."""

from __future__ import annotations

import re
from pathlib import Path

import cv2
import numpy as np
import pytest
from conftest import python_module, run

from partial_fc_mx.data import DataError
from partial_fc_mx.data.align import ARCFACE_TEMPLATE, align_face, similarity_transform
from partial_fc_mx.data.network_input import to_network_input
from partial_fc_mx.data.recordio import RecordDataset
from partial_fc_mx.data.transforms import decode_face
from partial_fc_mx.evaluation import ijb
from partial_fc_mx.evaluation.verification import load_bin
from partial_fc_mx.prep.pack import pack_folder, pack_list


def smooth_face(rng) -> np.ndarray:
    coarse = rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)
    return cv2.resize(coarse, (112, 112), interpolation=cv2.INTER_CUBIC)


def random_similarity(rng) -> np.ndarray:
    """2 x 3: scale 1.5-2.5, rotation within 30 degrees, into a 320 x 300 canvas."""
    scale, angle = rng.uniform(1.5, 2.5), np.deg2rad(rng.uniform(-30, 30))
    rotation = scale * np.array([[np.cos(angle), -np.sin(angle)],
                                 [np.sin(angle), np.cos(angle)]])
    center = np.array([56.0, 56.0])
    shift = np.array([150.0, 160.0]) + rng.uniform(-20, 20, 2) - rotation @ center
    return np.hstack([rotation, shift[:, None]])


def in_the_wild(face: np.ndarray, transform: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the face warped into a larger picture, its 5 landmarks there)."""
    picture = cv2.warpAffine(face, transform, (300, 320), flags=cv2.INTER_CUBIC)
    landmarks = ARCFACE_TEMPLATE @ transform[:, :2].T + transform[:, 2]
    return picture, landmarks


# ----- alignment -----
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_face_moved_by_a_known_similarity_is_restored_to_the_template(seed):
    rng = np.random.default_rng(seed)
    face = smooth_face(rng)
    transform = random_similarity(rng)
    picture, landmarks = in_the_wild(face, transform)
    estimated = similarity_transform(landmarks, ARCFACE_TEMPLATE)
    grid = np.stack(np.meshgrid(np.arange(0, 112, 8.0), np.arange(0, 112, 8.0)), -1).reshape(-1, 2)
    there = grid @ transform[:, :2].T + transform[:, 2]
    back = there @ estimated[:, :2].T + estimated[:, 2]
    assert np.abs(back - grid).max() < 1e-6  # every pixel lands within far less than a pixel
    restored = align_face(picture, landmarks, "test")
    inner = (slice(8, 104), slice(8, 104))
    error = np.abs(restored[inner].astype(int) - face[inner].astype(int)).mean()
    assert error < 3, error  # interpolation only (a misplaced face differs by ~40)
    shifted = align_face(picture, landmarks + [2.0, 0.0], "test")  # 2 px off: visible
    assert np.abs(shifted[inner].astype(int) - face[inner].astype(int)).mean() > error + 1


@pytest.mark.parametrize("points, message", [
    ([[10, 10], [20, 20], [30, 30], [40, 40], [50, 50]], "lie on a line"),
    ([[10, 10]] * 5, "lie on a line"),
    ([[10, 10], [400, 20], [30, 60], [20, 80], [60, 80]], "landmark(s) [1] at [[400.0, 20.0]] "
                                                          "lie outside the 300x320 picture"),
    ([[10, 10], [40, 20], [30, -1], [20, 80], [60, 80]], "landmark(s) [2]"),
])
def test_landmarks_outside_the_picture_or_on_a_line_are_refused_naming_the_file(
        tmp_path, points, message):
    rng = np.random.default_rng(3)
    (tmp_path / "faces" / "ann").mkdir(parents=True)
    picture, good = in_the_wild(smooth_face(rng), random_similarity(rng))
    for name in ("good", "bad"):
        cv2.imwrite(str(tmp_path / "faces" / "ann" / f"{name}.png"), picture)
    rows = {"ann/good.png": good, "ann/bad.png": np.array(points, float)}
    landmarks = tmp_path / "landmarks.txt"
    landmarks.write_text("".join(f"{name} {' '.join(f'{v:.3f}' for v in p.ravel())}\n"
                                 for name, p in rows.items()))
    with pytest.raises(DataError) as error:
        pack_folder(tmp_path / "faces", tmp_path / "rec", landmarks=landmarks)
    assert str(tmp_path / "faces" / "ann" / "bad.png") in str(error.value)
    assert message in str(error.value)
    assert not (tmp_path / "rec" / "train.rec").exists()


# ----- packing -----
def test_an_insightface_list_with_landmarks_packs_aligned_faces(tmp_path):
    """face2rec2's layout: aligned, path, label, 4 bbox numbers, x1..x5, y1..y5; a line
    marked aligned packs its 112x112 picture as it is, whatever its points say."""
    rng = np.random.default_rng(4)
    faces, lines = [], []
    for i, label in enumerate([1, 0, 1]):
        face = smooth_face(rng)
        picture, points = in_the_wild(face, random_similarity(rng))
        cv2.imwrite(str(tmp_path / f"{i}.png"), picture)
        columns = ["0", f"{i}.png", str(label), "0", "0", "300", "320",
                   *(f"{v:.4f}" for v in points[:, 0]), *(f"{v:.4f}" for v in points[:, 1])]
        lines.append("\t".join(columns))
        faces.append((label, face, align_face(picture, points, "expected")))
    plain = smooth_face(rng)
    cv2.imwrite(str(tmp_path / "plain.png"), plain)
    lines.append("\t".join(["1", "plain.png", "2", "0", "0", "112", "112", *["5"] * 10]) + "\t")
    faces.append((2, plain, plain))
    (tmp_path / "train.lst").write_text("\n".join(lines) + "\n")
    report = pack_list(tmp_path / "train.lst", tmp_path, tmp_path / "rec")
    assert (report.images, report.classes, report.skipped) == (4, 3, [])
    dataset = RecordDataset(tmp_path / "rec")
    packed = [dataset.records.read(int(i)) for i in dataset.image_ids]
    expected = sorted(faces, key=lambda f: f[0])  # grouped by label, stable
    for record, (label, original, aligned) in zip(packed, expected):
        image, resized = decode_face(record.image)
        assert record.label == label and not resized
        rgb = cv2.cvtColor(aligned, cv2.COLOR_BGR2RGB)
        assert np.abs(image.astype(int) - rgb.astype(int)).mean() < 2  # JPEG's loss
        inner = (slice(8, 104), slice(8, 104))
        original_rgb = cv2.cvtColor(original, cv2.COLOR_BGR2RGB)
        assert np.abs(image[inner].astype(int) - original_rgb[inner].astype(int)).mean() < 4


def test_a_folder_with_a_landmarks_file_packs_aligned_faces_and_a_wrong_file_is_refused(
        tmp_path):
    rng = np.random.default_rng(13)
    faces, rows = {}, []
    for person in ("ann", "bo"):
        (tmp_path / "faces" / person).mkdir(parents=True)
        for k in range(2):
            face = smooth_face(rng)
            picture, points = in_the_wild(face, random_similarity(rng))
            cv2.imwrite(str(tmp_path / "faces" / person / f"{k}.png"), picture)
            faces[(person, k)] = align_face(picture, points, "expected")
            rows.append(f"./{person}/{k}.png " + " ".join(f"{v:.4f}" for v in points.ravel())
                        + " 0.99")
    landmarks = tmp_path / "landmarks.txt"
    landmarks.write_text("\n".join(rows) + "\n")
    result = run(python_module("pack", str(tmp_path / "faces"), str(tmp_path / "rec"),
                               "--landmarks", str(landmarks), "--verbose"))
    assert result.returncode == 0, result.stdout
    assert "4 images of 2 classes (4 aligned from landmarks), 0 skipped" in result.stdout
    dataset = RecordDataset(tmp_path / "rec")
    for record_id, key in zip(dataset.image_ids, sorted(faces)):
        image, _ = decode_face(dataset.records.read(int(record_id)).image)
        expected = cv2.cvtColor(faces[key], cv2.COLOR_BGR2RGB)
        assert np.abs(image.astype(int) - expected.astype(int)).mean() < 2
    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_text("\n".join(f"faces/{row[2:]}" for row in rows) + "\n")
    refused = run(python_module("pack", str(tmp_path / "faces"), str(tmp_path / "rec2"),
                                "--landmarks", str(elsewhere), "--resize"))
    assert refused.returncode == 2
    assert (f"error: none of the 4 paths in {elsewhere} names a picture under "
            f"{tmp_path / 'faces'} (e.g. 'faces/ann/0.png')") in refused.stdout


def make_folder(root: Path, rng, size=(112, 92), people=2, each=3) -> None:
    for person in range(people):
        (root / f"p{person}").mkdir(parents=True)
        for k in range(each):
            cv2.imwrite(str(root / f"p{person}" / f"{k}.pgm"),
                        rng.integers(0, 255, size, dtype=np.uint8))


def test_the_packer_says_why_it_skipped_and_which_option_fixes_it(tmp_path):
    rng = np.random.default_rng(5)
    make_folder(tmp_path / "faces", rng)
    (tmp_path / "faces" / "p1" / "broken.jpg").write_bytes(b"\xff\xd8 not an image")
    nothing = run(python_module("pack", str(tmp_path / "faces"), str(tmp_path / "out")))
    assert nothing.returncode == 2, nothing.stdout
    said = nothing.stdout
    assert "nothing was written" in said
    assert re.search(r"6 skipped as not 112x112 \(e\.g\. \S+p0/0\.pgm, \S+p0/1\.pgm; "
                     r"sizes found: 92x112: 6\); fix: "
                     r"align it from 5 landmarks .*--resize .*--crop", said), said
    assert re.search(r"1 skipped as not a decodable image \(e\.g\. \S+broken\.jpg\); fix: "
                     r"re-encode it", said), said
    assert not (tmp_path / "out" / "train.rec").exists()
    assert not list((tmp_path / "out").glob(".*partial"))
    resized = run(python_module("pack", str(tmp_path / "faces"), str(tmp_path / "out"),
                                "--resize"))
    assert resized.returncode == 0, resized.stdout
    assert "6 images of 2 classes, 1 skipped" in resized.stdout
    assert "1 skipped as not a decodable image" in resized.stdout
    assert "skipped " + str(tmp_path / "faces") not in resized.stdout  # listed with --verbose
    listed = run(python_module("pack", str(tmp_path / "faces"), str(tmp_path / "out2"),
                               "--resize", "--verbose"))
    assert f"  skipped {tmp_path / 'faces' / 'p1' / 'broken.jpg'}: not a decodable image" \
        in listed.stdout
    dataset = RecordDataset(tmp_path / "out")
    image, was_resized = decode_face(dataset.records.read(int(dataset.image_ids[0])).image)
    assert image.shape == (112, 112, 3) and not was_resized


# ----- verification sets from your own pairs -----
def test_make_bin_round_trips_lfw_and_plain_pairs(tmp_path):
    rng = np.random.default_rng(6)
    names = ("Ann_Lee", "Bo_Chen", "Cy_Diaz")
    for name in names:
        (tmp_path / "lfw" / name).mkdir(parents=True)
        for n in (1, 2, 3):
            cv2.imwrite(str(tmp_path / "lfw" / name / f"{name}_{n:04d}.jpg"), smooth_face(rng))
    same = [(name, a, b) for name in names for a, b in ((1, 2), (2, 3))]
    different = [(names[i], a, names[(i + 1) % 3], b) for i in range(3) for a, b in ((1, 3),
                                                                                    (2, 1))]
    lfw = tmp_path / "pairs.txt"
    lfw.write_text("2\t6\n" + "".join("\t".join(map(str, p)) + "\n"
                                      for p in [*same, *different]))
    result = run(python_module("make-bin", str(lfw), str(tmp_path / "lfw.bin"), "--root",
                               str(tmp_path / "lfw")))
    assert result.returncode == 0, result.stdout
    assert "lfw.bin: 12 pairs" in result.stdout
    read = load_bin(tmp_path / "lfw.bin")
    assert read.issame.tolist() == [True] * 6 + [False] * 6
    order = [f"{n}/{n}_{k:04d}.jpg" for n, a, b in same for k in (a, b)]
    order += [f"{n1}/{n1}_{a:04d}.jpg" if k == 0 else f"{n2}/{n2}_{b:04d}.jpg"
              for n1, a, n2, b in different for k in (0, 1)]
    expected = to_network_input(np.stack([cv2.cvtColor(cv2.imread(
        str(tmp_path / "lfw" / name)), cv2.COLOR_BGR2RGB) for name in order]))
    np.testing.assert_array_equal(read.images, expected)  # the JPEG bytes, kept as they are
    plain = tmp_path / "plain.txt"
    plain.write_text("".join(f"{n}/{n}_0001.jpg {m}/{m}_0002.jpg {int(n == m)}\n"
                             for n in names for m in names[:2])
                     + "Cy_Diaz/Cy_Diaz_0003.jpg Ann_Lee/Ann_Lee_0003.jpg 0\n"
                     + "Cy_Diaz/Cy_Diaz_0003.jpg Ann_Lee/Ann_Lee_0001.jpg 0\n"
                     + "Cy_Diaz/Cy_Diaz_0003.jpg Cy_Diaz/Cy_Diaz_0001.jpg 1\n"
                     + "Bo_Chen/Bo_Chen_0003.jpg Bo_Chen/Bo_Chen_0001.jpg 1\n")
    assert run(python_module("make-bin", str(plain), str(tmp_path / "plain.bin"), "--root",
                             str(tmp_path / "lfw"))).returncode == 0
    assert load_bin(tmp_path / "plain.bin").issame.tolist() == [
        True, False, False, True, False, False, False, False, True, True]
    missing = tmp_path / "missing.txt"
    missing.write_text("Ann_Lee\t1\t2\n" * 10 + "Ann_Lee\t1\t9\n")
    failed = run(python_module("make-bin", str(missing), str(tmp_path / "missing.bin"),
                               "--root", str(tmp_path / "lfw")))
    assert failed.returncode == 2
    assert f"error: {missing} line 11: {tmp_path / 'lfw'}/Ann_Lee/Ann_Lee_0009.jpg: " \
        "unreadable" in failed.stdout
    assert not (tmp_path / "missing.bin").exists()
    few = tmp_path / "few.txt"
    few.write_text("Ann_Lee\t1\t2\n" * 9)
    refused = run(python_module("make-bin", str(few), str(tmp_path / "few.bin"), "--root",
                                str(tmp_path / "lfw")))
    assert refused.returncode == 2 and "lists 9 pairs; a .bin needs at least 10" in refused.stdout


# ----- IJB-B / IJB-C -----
def write_ijb(root: Path, rng, templates: int = 24, target: str = "IJBC") -> Path:
    """An IJB-shaped release: pictures of 8 people in the wild with their landmarks;
    templates of 1-3 media of 1-3 pictures; every template pair listed."""
    meta, crops = root / target / "meta", root / target / "loose_crop"
    meta.mkdir(parents=True)
    crops.mkdir(parents=True)
    prefix = target.lower()
    common = smooth_face(rng).astype(float)  # people alike, as faces are: TARs below 1
    people = [0.7 * common + 0.3 * smooth_face(rng) for _ in range(8)]
    faces, points, owner, picture = [], [], [], 0
    for template in range(templates):
        person = template % len(people)
        owner.append(person)
        for media in range(int(rng.integers(1, 4))):
            for _ in range(int(rng.integers(1, 4))):
                picture += 1
                noisy = np.clip(people[person] + rng.normal(0, 40, (112, 112, 3)), 0, 255)
                image, landmarks = in_the_wild(noisy.astype(np.uint8), random_similarity(rng))
                cv2.imwrite(str(crops / f"{picture}.jpg"), image)
                tid, mid = 100 + 7 * template, 5000 + 10 * template + media
                faces.append(f"{picture}.jpg {tid} {mid}")
                score = rng.uniform(0.5, 1.0)
                points.append(f"{picture}.jpg " + " ".join(f"{v:.3f}" for v in landmarks.ravel())
                              + f" {score:.4f}")
    (meta / f"{prefix}_face_tid_mid.txt").write_text("\n".join(faces) + "\n")
    (meta / f"{prefix}_name_5pts_score.txt").write_text("\n".join(points) + "\n")
    pairs = [f"{100 + 7 * a} {100 + 7 * b} {int(owner[a] == owner[b])}"
             for a in range(templates) for b in range(a + 1, templates)]
    (meta / f"{prefix}_template_pair_label.txt").write_text("\n".join(pairs) + "\n")
    return root


def direct_tars(root: Path, forward, target: str = "IJBC", detector_score: bool = True) -> tuple:
    """The protocol computed the plain way, picture by picture and pair by pair."""
    meta, crops, prefix = root / target / "meta", root / target / "loose_crop", target.lower()
    rows = [line.split() for line in (meta / f"{prefix}_name_5pts_score.txt").read_text()
            .splitlines()]
    faces = [line.split() for line in (meta / f"{prefix}_face_tid_mid.txt").read_text()
             .splitlines()]
    media: dict = {}
    for (name, *values), (_, tid, mid) in zip(rows, faces):
        face = align_face(cv2.imread(str(crops / name)), np.array(values[:10], float), name)
        batch = to_network_input(cv2.cvtColor(face, cv2.COLOR_BGR2RGB)[None])
        feature = (forward(batch) + forward(np.ascontiguousarray(batch[..., ::-1])))[0]
        weight = float(values[10]) if detector_score else 1.0
        media.setdefault(int(tid), {}).setdefault(int(mid), []).append(
            feature.astype(np.float64) * weight)
    template = {}
    for tid, groups in media.items():
        total = sum(np.mean(group, axis=0) for group in groups.values())
        template[tid] = total / np.linalg.norm(total)
    scores, labels = [], []
    for line in (meta / f"{prefix}_template_pair_label.txt").read_text().splitlines():
        a, b, label = map(int, line.split())
        scores.append(float(template[a] @ template[b]))
        labels.append(label)
    scores, labels = np.array(scores), np.array(labels)
    tars = {}
    thresholds = np.unique(scores)[::-1]
    for far in ijb.FARS:
        best, best_gap = None, np.inf
        for threshold in thresholds:  # of equally near points, the lowest threshold
            gap = abs(np.mean(scores[labels == 0] >= threshold) - far)
            if gap <= best_gap:
                best, best_gap = np.mean(scores[labels == 1] >= threshold), gap
        tars[far] = float(best)
    return scores, labels, tars


def projection_forward(seed: int = 0, dim: int = 16):
    projection = np.random.default_rng(seed).standard_normal((3 * 112 * 112, dim))
    return lambda batch: (batch.reshape(len(batch), -1) @ projection).astype(np.float32)


@pytest.mark.parametrize("seed, detector_score", [(7, True), (8, False)])
def test_ijb_tar_at_far_equals_a_direct_computation(tmp_path, seed, detector_score):
    root = write_ijb(tmp_path / "ijb", np.random.default_rng(seed))
    forward = projection_forward(seed)
    layout = ijb.Layout.of(root, "IJBC")
    pictures = ijb.read_pictures(layout)
    seen = []
    features = ijb.template_features(pictures, layout, forward, detector_score=detector_score,
                                     batch_size=5, workers=2, progress=seen.append)
    assert sum(seen) == len(pictures.names) and features.shape == (24, 16)
    pairs = ijb.read_pairs(pictures.template_ids, layout.pairs)
    scores, labels = ijb.score_pairs(features, pairs), pairs.labels
    expected_scores, expected_labels, expected_tars = direct_tars(root, forward,
                                                                 detector_score=detector_score)
    np.testing.assert_allclose(scores, expected_scores, atol=1e-5)
    assert labels.tolist() == expected_labels.tolist()
    assert ijb.tar_at_fars(ijb.roc_curve(scores, labels)) == expected_tars
    assert len(set(expected_tars.values())) > 1  # the FARs resolve different points


def test_tar_at_far_counts_the_genuine_pairs_between_two_impostors():
    """arcface_torch's rule: of the ROC points equally near the FAR, the highest TAR."""
    scores = np.array([0.9, 0.5, 0.8, 0.7, 0.3])
    labels = np.array([0, 0, 1, 1, 1])
    roc = ijb.roc_curve(scores, labels)
    assert roc.far.tolist() == [0.5, 0.5, 0.5, 1.0, 1.0]
    assert ijb.tar_at_fars(roc, (0.5, 0.2, 0.9)) == {0.5: 2 / 3, 0.2: 2 / 3, 0.9: 1.0}
    with pytest.raises(DataError, match="both genuine"):
        ijb.roc_curve(scores, np.ones(5, int))


def scored(features, template_ids, pairs_file) -> tuple:
    pairs = ijb.read_pairs(template_ids, pairs_file)
    return ijb.score_pairs(features, pairs), pairs.labels


def test_ijb_pairs_are_read_in_blocks_with_bad_lines_named(tmp_path, monkeypatch):
    root = write_ijb(tmp_path / "ijb", np.random.default_rng(9), templates=10)
    layout = ijb.Layout.of(root / "IJBC", "IJBC")  # the target's own folder works too
    features = np.random.default_rng(0).standard_normal((10, 4)).astype(np.float32)
    ids = ijb.read_pictures(layout).template_ids
    whole = scored(features, ids, layout.pairs)
    lines = layout.pairs.read_text().splitlines()
    # blank lines, CRLF and no newline at the end, read in blocks that end mid-line
    layout.pairs.write_bytes(("\r\n".join(lines[:3] + ["", ""] + lines[3:])).encode())
    for block_bytes in (7, 12, 1000):
        monkeypatch.setattr(ijb, "PAIR_BLOCK_BYTES", block_bytes)
        assert len(ijb.read_pairs(ids, layout.pairs).labels) == 45
        blocks = scored(features, ids, layout.pairs)
        np.testing.assert_array_equal(whole[0], blocks[0])
        np.testing.assert_array_equal(whole[1], blocks[1])
    body = lines[:3] + ["", ""] + lines[3:]  # the bad line is line 8 of the file
    for bad, message in (("100 107 x", "line 8 is not 'template1 template2 label'"),
                         ("100 107", "line 8 is not 'template1 template2 label'"),
                         ("100 999 1", "line 8: template 999 is not in the face list"),
                         ("100 107 2", "line 8: label 2 is not 1")):
        layout.pairs.write_text("\n".join(body[:7] + [bad] + body[7:]) + "\n")
        for block_bytes in (7, 1000):
            monkeypatch.setattr(ijb, "PAIR_BLOCK_BYTES", block_bytes)
            with pytest.raises(DataError, match=re.escape(f"{layout.pairs} {message}")):
                ijb.read_pairs(ids, layout.pairs)
    layout.pairs.write_text("\n\n")
    with pytest.raises(DataError, match=re.escape(f"{layout.pairs} lists no pairs")):
        ijb.read_pairs(ids, layout.pairs)
    assert ijb.score_pairs(features, ijb.Pairs(np.zeros((0, 2), np.int32),
                                               np.zeros(0, np.int32))).shape == (0,)


def test_ijb_landmarks_are_checked_before_embedding_and_loose_ones_warped(tmp_path):
    """Points on a line stop the run before any picture is read; points just outside a
    loose crop are warped as insightface does."""
    root = write_ijb(tmp_path / "ijb", np.random.default_rng(12), templates=4)
    layout = ijb.Layout.of(root, "IJBC")
    rows = layout.landmarks.read_text().splitlines()
    name, *values = rows[0].split()
    values[0] = "-3.5"  # the left eye just outside the picture
    rows[0] = " ".join([name, *values])
    layout.landmarks.write_text("\n".join(rows) + "\n")
    pictures = ijb.read_pictures(layout)
    features = ijb.template_features(pictures, layout, projection_forward(), workers=1)
    assert np.isfinite(features).all()
    name, *values = rows[1].split()
    rows[1] = " ".join([name, *[f"{10 * k} {10 * k}" for k in range(5)], values[-1]])
    layout.landmarks.write_text("\n\n".join(rows) + "\n")  # blank lines between
    with pytest.raises(DataError, match=re.escape(f"{layout.landmarks} line 3: the 5 "
                                                  "landmarks") + ".*lie on a line"):
        ijb.read_pictures(layout)


def test_ijb_metadata_that_disagrees_is_named(tmp_path):
    root = write_ijb(tmp_path / "ijb", np.random.default_rng(10), templates=4)
    layout = ijb.Layout.of(root, "IJBC")
    faces = layout.faces.read_text().splitlines()
    faces[1] = "nope.jpg 1 2"
    layout.faces.write_text("\n".join(faces) + "\n")
    with pytest.raises(DataError, match=r"line 2 names nope\.jpg, but .*ijbc_name_5pts_score"
                                        r"\.txt's picture 2 \(line 2 of it names 2\.jpg\)"):
        ijb.read_pictures(layout)
    with pytest.raises(DataError, match=r"IJBB_face_tid_mid|ijbb_face_tid_mid.txt.* missing"):
        ijb.Layout.of(root, "IJBB")
    faces[1] = "2.jpg" + faces[1][len("nope.jpg"):]
    layout.faces.write_text("\n".join(faces) + "\n")
    pictures = ijb.read_pictures(layout)
    ijb.check_pictures_exist(pictures, layout)
    (layout.images / "3.jpg").unlink()
    with pytest.raises(DataError, match=r"1 of the \d+ pictures .* are not in .*loose_crop: "
                                        r"3\.jpg \(line 3\)"):
        ijb.check_pictures_exist(pictures, layout)


def test_eval_ijb_from_the_command_line_with_an_onnx_backbone(tmp_path):
    import mxnet as mx

    from partial_fc_mx.backbones import get_model
    from partial_fc_mx.evaluation.verification import onnx_forward
    from partial_fc_mx.run.export import export_onnx, onnx_session

    work = tmp_path / "work"
    work.mkdir()
    net = get_model("tiny", embedding_size=32)
    net.initialize(mx.init.Xavier())
    net.hybridize()
    net(mx.nd.zeros((1, 3, 112, 112)))
    net.export(str(work / "backbone"), epoch=0)
    onnx_file = export_onnx(work)
    root = write_ijb(tmp_path / "ijb", np.random.default_rng(11), templates=16)
    result = run(python_module("eval-ijb", "--model", str(onnx_file), "--root", str(root),
                               "--target", "IJBC", "--out", str(tmp_path / "out"),
                               "--batch-size", "7"))
    assert result.returncode == 0, result.stdout[-3000:]
    _, _, tars = direct_tars(root, onnx_forward(onnx_session(onnx_file)))
    row = re.search(r"^backbone\.onnx\s+\|(.*)$", result.stdout, flags=re.MULTILINE)
    assert row, result.stdout
    assert [float(v) for v in row.group(1).split("|")] == pytest.approx(
        [100 * tars[far] for far in ijb.FARS], abs=0.006)
    assert (tmp_path / "out" / "ijbc_roc.png").stat().st_size > 10_000
    scores, labels = ijb.load_scores(tmp_path / "out" / "ijbc_scores.npz")
    assert len(scores) == 16 * 15 // 2 and set(labels.tolist()) == {0, 1}
    compared = run(python_module("roc", str(tmp_path / "out" / "ijbc_scores.npz"),
                                 str(tmp_path / "out" / "ijbc_scores.npz"), "--out",
                                 str(tmp_path / "both.png")))
    assert compared.returncode == 0 and (tmp_path / "both.png").is_file()
    assert len(re.findall(r"^out/ijbc_scores( \(2\))?\s+\|", compared.stdout,
                          flags=re.MULTILINE)) == 2


# ----- the preflight without a config -----
def test_check_without_a_config_checks_the_environment_alone():
    result = run(python_module("check"))
    assert result.returncode == 0, result.stdout
    assert re.search(r"^MXNet 1\.9\.1: CUDA (yes|no)", result.stdout, flags=re.MULTILINE)
    assert "processes: 1 on 1 host(s)" in result.stdout
    assert "the environment alone was checked" in result.stdout
    assert "OK: no problems found" in result.stdout
    refused = run(python_module("check", "lr=0.1"))
    assert refused.returncode == 2 and "need a config file" in refused.stdout
