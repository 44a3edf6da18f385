"""RecordIO reading and packing, the loader's sharding and decoding, and bad data."""

from __future__ import annotations

import pickle
import re
import struct
import sys
from pathlib import Path

import cv2
import mxnet as mx
import numpy as np
import pytest
from conftest import horovodrun_gloo, mpirun, python_module, run

from partial_fc_mx.data.loader import FaceLoader, RandomLoader
from partial_fc_mx.data.network_input import to_network_input
from partial_fc_mx.data.recordio import MAGIC, DataError, RecordDataset
from partial_fc_mx.data.transforms import decode_face, encode_jpeg
from partial_fc_mx.prep.orl import prepare_orl, read_pgm
from partial_fc_mx.prep.pack import pack_folder, pack_list, write_records
from partial_fc_mx.prep.synthetic import identity_images, prepare_synthetic


def random_face(rng, size=(112, 112)) -> np.ndarray:
    return rng.integers(0, 255, (*size, 3), dtype=np.uint8)


def smooth_face(rng) -> np.ndarray:
    """Face-like in the way that matters to JPEG: smooth, not noise."""
    coarse = rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)
    return cv2.resize(coarse, (112, 112), interpolation=cv2.INTER_CUBIC)


def pack_random(directory: Path, num_classes: int, per_class: int, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    samples = ((label, encode_jpeg(random_face(rng))) for label in range(num_classes)
               for _ in range(per_class))
    write_records(directory, samples, num_classes)
    return directory


def test_folder_round_trip_keeps_labels_and_pixels(tmp_path):
    rng = np.random.default_rng(1)
    originals = {}
    for person in ("alice", "bob", "carol"):
        (tmp_path / "faces" / person).mkdir(parents=True)
        for k in range(3):
            image = smooth_face(rng)
            suffix = ".png" if k == 0 else ".jpg"
            cv2.imwrite(str(tmp_path / "faces" / person / f"{k}{suffix}"), image)
            originals[(person, k)] = image[:, :, ::-1]  # cv2 wrote BGR
    (tmp_path / "faces" / "bob" / "broken.jpg").write_bytes(b"\xff\xd8 not really")
    cv2.imwrite(str(tmp_path / "faces" / "carol" / "big.png"), random_face(rng, (150, 120)))
    report = pack_folder(tmp_path / "faces", tmp_path / "rec")
    assert (report.images, report.classes) == (9, 3)
    assert sorted(Path(p).name for p, _ in report.skipped) == ["big.png", "broken.jpg"]
    assert "120x150, not 112x112" in dict((Path(p).name, w) for p, w in report.skipped)["big.png"]
    dataset = RecordDataset(tmp_path / "rec")
    assert len(dataset) == 9 and dataset.num_classes == 3
    for record_id, ((person, k), original) in zip(dataset.image_ids, sorted(originals.items())):
        record = dataset.records.read(int(record_id))
        assert record.label == ["alice", "bob", "carol"].index(person)
        image, resized = decode_face(record.image)
        assert not resized
        error = np.abs(image.astype(int) - original.astype(int)).mean()
        assert error == 0 if k == 0 else error < 2  # PNG exact, JPEG within its loss
    cropped = pack_folder(tmp_path / "faces", tmp_path / "rec2", crop=True)
    assert cropped.images == 10 and [Path(p).name for p, _ in cropped.skipped] == ["broken.jpg"]


def test_list_file_packing(tmp_path):
    rng = np.random.default_rng(2)
    lines = []
    for i, label in enumerate([1, 0, 1, 2]):
        cv2.imwrite(str(tmp_path / f"{i}.jpg"), random_face(rng))
        lines.append(f"{i}\t{label}\t{i}.jpg")
    (tmp_path / "train.lst").write_text("\n".join(lines) + "\n")
    report = pack_list(tmp_path / "train.lst", tmp_path, tmp_path / "rec")
    dataset = RecordDataset(tmp_path / "rec")
    labels = [dataset.records.read(int(i)).label for i in dataset.image_ids]
    assert report.images == 4 and labels == [0, 1, 1, 2] and dataset.num_classes == 3


def test_file_without_header_record_and_with_label_arrays(tmp_path):
    """As MXNet's im2rec writes: keys from 0, label arrays, no header, no property."""
    rng = np.random.default_rng(3)
    writer = mx.recordio.MXIndexedRecordIO(str(tmp_path / "train.idx"),
                                           str(tmp_path / "train.rec"), "w")
    for i in range(6):
        header = mx.recordio.IRHeader(2, [float(i % 3), 7.0], i, 0)
        writer.write_idx(i, mx.recordio.pack(header, encode_jpeg(random_face(rng))))
    writer.close()
    with pytest.raises(DataError, match="property is missing and no num_classes was given"):
        RecordDataset(tmp_path)
    dataset = RecordDataset(tmp_path, num_classes=3)
    assert dataset.image_ids.tolist() == [0, 1, 2, 3, 4, 5] and not dataset.has_header
    assert [dataset.records.read(i).label for i in range(6)] == [0, 1, 2, 0, 1, 2]


def test_records_split_at_magic_words_are_rejoined(tmp_path):
    payload = b"abcd" + struct.pack("<I", MAGIC) * 3 + b"tail!"
    writer = mx.recordio.MXIndexedRecordIO(str(tmp_path / "train.idx"),
                                           str(tmp_path / "train.rec"), "w")
    writer.write_idx(0, mx.recordio.pack(mx.recordio.IRHeader(0, 1.0, 0, 0), payload))
    writer.close()
    dataset = RecordDataset(tmp_path, num_classes=2)
    assert dataset.records.read(0).image == payload


def test_sharding_is_disjoint_covering_equal_and_reshuffled(tmp_path):
    dataset = RecordDataset(pack_random(tmp_path / "rec", 10, 10))  # 100 images
    loaders = [FaceLoader(dataset, 8, rank=r, world_size=3, seed=5) for r in range(3)]
    assert {len(loader) for loader in loaders} == {4}  # 100 // 24; 4 images dropped
    epoch0 = [loader.record_ids(0) for loader in loaders]
    ids = np.concatenate([e.ravel() for e in epoch0])
    assert len(ids) == 96 and len(np.unique(ids)) == 96 and set(ids) <= set(range(1, 101))
    epoch1 = np.concatenate([loader.record_ids(1).ravel() for loader in loaders])
    assert not np.array_equal(ids, epoch1)
    again = FaceLoader(dataset, 8, rank=1, world_size=3, seed=5).record_ids(0)
    assert np.array_equal(again, epoch0[1])


def test_batches_decode_normalize_and_mirror(tmp_path):
    rng = np.random.default_rng(4)
    gray = rng.integers(0, 255, (112, 112), dtype=np.uint8)
    ok, png = cv2.imencode(".png", gray)
    samples = [(0, png.tobytes()), (1, encode_jpeg(random_face(rng, (100, 90))))]
    write_records(tmp_path / "rec", samples, 2)
    dataset = RecordDataset(tmp_path / "rec")
    loader = FaceLoader(dataset, 2, mirror=False, seed=0)
    batch = next(loader.epoch(0))
    assert batch.images.shape == (2, 3, 112, 112) and batch.images.dtype == np.float32
    assert batch.labels.dtype == np.int64 and sorted(batch.labels.tolist()) == [0, 1]
    gray_row = batch.images[batch.labels.tolist().index(0)]
    assert np.array_equal(gray_row[0], gray_row[1]) and np.array_equal(gray_row[1], gray_row[2])
    np.testing.assert_allclose(gray_row[0], (gray.astype(np.float32) - 127.5) / 128)
    assert loader.stats.resized == 1
    flipped, _ = decode_face(png.tobytes(), mirror=True)
    assert np.array_equal(flipped[:, :, 0], gray[:, ::-1])
    assert to_network_input(np.full((1, 2, 2, 3), 255, np.uint8)).max() == (255 - 127.5) / 128


def test_mirroring_flips_about_half_the_images(tmp_path):
    dataset = RecordDataset(pack_random(tmp_path / "rec", 4, 50))
    plain = FaceLoader(dataset, 50, mirror=False, seed=1)
    mirrored = FaceLoader(dataset, 50, mirror=True, seed=1)
    flips = 0
    for a, b in zip(plain.epoch(0), mirrored.epoch(0)):
        same = [np.array_equal(x, y) for x, y in zip(a.images, b.images)]
        flips += sum(not s for s in same)
        assert all(s or np.array_equal(x[:, :, ::-1], y)
                   for s, x, y in zip(same, a.images, b.images))
    assert 60 < flips < 140  # of 200


def test_random_loader_has_the_shapes_and_no_decoding():
    loader = RandomLoader(4, 1000, num_images=14)  # 3 batches, 2 images dropped
    batches = list(loader.epoch(0))
    assert len(batches) == 3 and batches[0].images.shape == (4, 3, 112, 112)
    assert all(0 <= label < 1000 for b in batches for label in b.labels)


# ----- bad input -----

def test_missing_files_are_named(tmp_path):
    directory = pack_random(tmp_path / "rec", 3, 2)
    (directory / "train.idx").unlink()
    with pytest.raises(DataError, match=r"train\.idx is missing: the index file"):
        RecordDataset(directory)
    with pytest.raises(DataError, match="dataset directory .*nowhere does not exist"):
        RecordDataset(tmp_path / "nowhere")


def test_truncated_file_names_the_record(tmp_path):
    directory = pack_random(tmp_path / "rec", 3, 4)
    data = (directory / "train.rec").read_bytes()
    dataset = RecordDataset(directory)
    last_image = int(dataset.image_ids[-1])
    offset = dataset.records.offsets[last_image]
    (directory / "train.rec").write_bytes(data[:offset + 20])
    loader = FaceLoader(RecordDataset(directory), 12, mirror=False)
    with pytest.raises(DataError, match=rf"train\.rec is truncated: record {last_image} at "
                                        rf"byte {offset} runs past the end"):
        list(loader.epoch(0))


def corrupt_record(directory: Path, record_id: int) -> None:
    """Overwrite the JPEG bytes of one record in place with garbage."""
    dataset = RecordDataset(directory)
    offset = dataset.records.offsets[record_id] + 8 + 24 + 4  # magic, length, IRHeader
    with open(directory / "train.rec", "r+b") as f:
        f.seek(offset)
        f.write(b"\x00" * 64)


def test_corrupt_image_fails_or_is_skipped_and_counted(tmp_path):
    directory = pack_random(tmp_path / "rec", 4, 4)
    corrupt_record(directory, 7)
    loader = FaceLoader(RecordDataset(directory), 16, mirror=False)
    with pytest.raises(DataError, match=r"cannot be decoded \(not a valid JPEG/PNG\): .*train"
                                        r"\.rec: record 7\. .*skip_corrupt=True"):
        list(loader.epoch(0))
    skipping = FaceLoader(RecordDataset(directory), 16, mirror=False, skip_corrupt=True)
    batches = list(skipping.epoch(0))
    assert len(batches) == 1 and batches[0].images.shape[0] == 16
    assert skipping.stats.skipped == [7]


@pytest.mark.parametrize("bad_label", [5, -1])
def test_labels_outside_the_classes_name_the_record(tmp_path, bad_label):
    directory = pack_random(tmp_path / "rec", 5, 2)
    writer = mx.recordio.MXIndexedRecordIO(str(tmp_path / "x.idx"), str(tmp_path / "x.rec"), "w")
    dataset = RecordDataset(directory)
    for i in sorted(dataset.records.offsets):
        raw = dataset.records.read_bytes(i)
        if i == 3:
            header, image = mx.recordio.unpack(raw)
            raw = mx.recordio.pack(header._replace(label=float(bad_label)), image)
        writer.write_idx(i, raw)
    writer.close()
    (tmp_path / "x.rec").replace(directory / "train.rec")
    (tmp_path / "x.idx").replace(directory / "train.idx")
    loader = FaceLoader(RecordDataset(directory), 10)
    with pytest.raises(DataError, match=rf"record 3 has label {float(bad_label)}, outside the "
                                        r"classes 0\.\.4"):
        list(loader.epoch(0))


def test_property_disagreement_and_empty_or_small_datasets(tmp_path):
    directory = pack_random(tmp_path / "rec", 3, 2)
    with pytest.raises(DataError, match="says 3 classes but num_classes is 4"):
        RecordDataset(directory, num_classes=4)
    with pytest.raises(DataError, match="has 6 images, fewer than one global batch"):
        FaceLoader(RecordDataset(directory), 4, world_size=2)
    with pytest.raises(DataError, match="no readable images; nothing was written"):
        write_records(tmp_path / "empty", iter([]), 3)
    assert not (tmp_path / "empty").exists()  # no empty folder that looks like output


def test_cli_reports_and_exit_codes(tmp_path):
    directory = pack_random(tmp_path / "rec", 3, 3)
    good = run(python_module("inspect", str(directory), "--scan"))
    assert good.returncode == 0, good.stdout
    assert "9 images, 3 classes, images per class min 3 / median 3 / max 3" in good.stdout
    corrupt_record(directory, 2)
    bad = run(python_module("inspect", str(directory), "--scan"))
    assert bad.returncode == 1 and "1 corrupt image(s), records [2]" in bad.stdout
    missing = run(python_module("pack", str(tmp_path / "nope"), str(tmp_path / "out")))
    assert missing.returncode == 2
    assert "nope does not exist; pack needs one subfolder per person" in missing.stdout
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("layout, message", [
    ({}, "is empty; pack needs one subfolder per person"),
    ({"a.png": 1, "b.png": 1, "notes.txt": 1},
     "holds 2 picture(s) but no subfolders; pack needs one subfolder per person"),
])
def test_a_folder_without_a_subfolder_per_person_says_so(tmp_path, layout, message):
    source = tmp_path / "faces"
    source.mkdir()
    for name in layout:
        (source / name).write_bytes(b"x")
    result = run(python_module("pack", str(source), str(tmp_path / "out")))
    assert result.returncode == 2 and f"{source} {message}" in result.stdout, result.stdout
    assert not (tmp_path / "out").exists()


# ----- the datasets made here -----

def test_orl_faces_are_repaired_split_and_verifiable(tmp_path):
    report = prepare_orl(str(tmp_path / "orl"), heldout=10, pairs=300)
    assert sorted(Path(p).parent.name + "/" + Path(p).name for p in report.damaged) == \
        ["s8/10.pgm", "s9/8.pgm"]
    assert report.train.classes == 30 and len(report.heldout_people) == 10
    damaged_people = {8, 9}
    expected = 10 * 30 - len(damaged_people - set(report.heldout_people))
    assert report.train.images == expected
    images, issame = pickle.loads((tmp_path / "orl" / "orl_heldout.bin").read_bytes())
    assert len(images) == 2 * len(issame) == 1200 and sum(issame) == 300
    assert decode_face(images[0])[0].shape == (112, 112, 3)


def test_orl_splits_are_chosen_by_the_seed_and_all_genuine_pairs_fit(tmp_path):
    splits = [prepare_orl(str(tmp_path / f"orl{seed}"), seed=seed) for seed in (0, 1, 0)]
    assert splits[0].heldout_people == splits[2].heldout_people
    assert splits[0].heldout_people != splits[1].heldout_people
    for split in splits[:2]:  # 10 people x 10 images: 450 genuine pairs, fewer if damaged
        damaged = len({8, 9} & set(split.heldout_people))
        assert split.pairs == 2 * (450 - 9 * damaged)


def test_pgm_crlf_damage_is_repaired_or_refused():
    payload = bytes(range(256)) * 40 + bytes(10304 - 10240)
    clean = b"P5\n92 112\n255\n" + payload
    assert read_pgm(clean) is not None
    damaged = clean.replace(b"\n", b"\r\n")  # what the conversion did
    assert np.array_equal(read_pgm(damaged), read_pgm(clean))
    assert read_pgm(clean[:-1]) is None


def test_synthetic_identities_are_reproducible_and_distinct(tmp_path):
    made = prepare_synthetic(str(tmp_path / "syn"), num_classes=40, per_class=3, heldout=20,
                             pairs=50, seed=3)
    assert (made.train.images, made.train.classes, made.pairs) == (120, 40, 100)
    assert identity_images(3, 5, 2) == identity_images(3, 5, 2)
    faces = [[decode_face(b)[0].astype(float) for b in identity_images(3, c, 3)]
             for c in range(10)]
    within = np.mean([np.abs(f[0] - f[1]).mean() for f in faces])
    between = np.mean([np.abs(faces[c][0] - faces[c + 1][0]).mean() for c in range(9)])
    assert within < 0.6 * between
    dataset = RecordDataset(tmp_path / "syn")
    labels = [dataset.records.read(int(i)).label for i in dataset.image_ids]
    assert labels == [c for c in range(40) for _ in range(3)]


def test_kin_makes_families_of_look_alikes():
    """`kin` blends a family's picture into its members' own: family mates (ids
    family_size by family_size) get closer than strangers, and at 0 are none. Each
    identity's mean view, so that its variation does not hide the likeness."""
    def mates_over_strangers(kin: float) -> float:
        mean_view = {c: np.mean([decode_face(b)[0].astype(float)
                                 for b in identity_images(5, c, 6, 0.6, kin, 4)], axis=0)
                     for c in range(12)}

        def distance(pairs: list) -> float:
            return np.mean([np.abs(mean_view[a] - mean_view[b]).mean() for a, b in pairs])

        return (distance([(0, 1), (0, 3), (4, 5), (5, 7), (8, 11), (9, 10), (1, 2), (6, 7)])
                / distance([(3, 4), (0, 4), (7, 8), (1, 9), (2, 6), (5, 11), (3, 8), (2, 10)]))

    assert mates_over_strangers(0.8) < 0.85 and mates_over_strangers(0.0) > 0.9


def test_shared_synthetic_identities_look_alike_by_that_fraction():
    """`shared` blends one common picture into every prototype: identities get closer
    (the study's harder set), their own variation stays, and 0 changes nothing."""
    def mean_image_distance(shared: float) -> tuple:
        faces = [[decode_face(b)[0].astype(float) for b in identity_images(5, c, 2, shared)]
                 for c in range(12)]
        within = np.mean([np.abs(f[0] - f[1]).mean() for f in faces])
        between = np.mean([np.abs(faces[c][0] - faces[c + 1][0]).mean() for c in range(11)])
        return within, between

    assert identity_images(5, 2, 2, 0.0) == identity_images(5, 2, 2)
    assert identity_images(5, 2, 2, 0.8) == identity_images(5, 2, 2, 0.8)
    assert identity_images(5, 2, 2, 0.8) != identity_images(5, 2, 2)
    (within0, between0), (within8, between8) = mean_image_distance(0), mean_image_distance(0.8)
    assert between8 < 0.7 * between0 and within8 > 0.6 * within0
    assert within8 / between8 > within0 / between0 + 0.2
    refused = run(python_module("pack-synthetic", "x", "--shared", "1"))
    assert refused.returncode == 2 and "--shared: 1 is not in [0, 1)" in refused.stdout


# ----- several processes -----

@pytest.mark.parametrize("launcher", ["horovodrun", "mpirun"])
def test_ranks_shards_are_disjoint_and_cover_the_epoch(tmp_path, launcher):
    directory = pack_random(tmp_path / "rec", 50, 1)  # label == image: 50 images, 2 dropped
    args = [sys.executable, "tests/data_worker.py", str(directory), "shard"]
    result = (horovodrun_gloo(2, args) if launcher == "horovodrun" else mpirun(2, args))
    assert result.returncode == 0, result.stdout[-3000:]
    assert "SHARDS OK world=2 per-rank=24 of 50" in result.stdout


def test_a_corrupt_record_on_one_rank_stops_every_rank_with_the_same_error(tmp_path):
    directory = pack_random(tmp_path / "rec", 8, 4)
    corrupt_record(directory, 11)
    result = mpirun(2, [sys.executable, "tests/data_worker.py", str(directory), "corrupt"],
                    timeout=120)
    assert result.returncode == 0, result.stdout[-3000:]
    messages = [(directory / f"error.rank{rank}").read_text() for rank in range(2)]
    assert messages[0] == messages[1]
    assert re.search(r"cannot be decoded \(not a valid JPEG/PNG\): \S+train\.rec: record 11\.",
                     messages[0]), messages[0]


def test_ranks_whose_datasets_differ_stop_together_at_the_epoch_end(tmp_path):
    """Rank 0's copy has 40 images (5 global batches of 4 x 2), rank 1's 56 (7): after
    5 steps rank 0 has no batch; both must raise, naming each rank's count."""
    pack_random(tmp_path / "r0", 10, 4)
    pack_random(tmp_path / "r1", 14, 4)
    result = mpirun(2, [sys.executable, "tests/data_worker.py", str(tmp_path), "uneven"],
                    timeout=120)
    assert result.returncode == 0, result.stdout[-3000:]
    messages = [(tmp_path / f"error.rank{rank}").read_text() for rank in range(2)]
    assert messages[0] == messages[1], messages
    assert "the ranks disagree about the end of the epoch: rank 0 has 5 batches, rank 1 has " \
           "6+ batches. Their copies of the dataset differ" in messages[0]
