"""`python -m partial_fc_mx clean` on a packed dataset with planted wrong labels: a
K = 3 run trained on it, cleaned under mpirun, killed and restarted, refused on bad
input; and the noise generator the noisy-label study plants its noise with."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import config_file, kill_group, mpirun_command, python_module, run, start

from partial_fc_mx.cleaning import dominant
from partial_fc_mx.data.recordio import RecordDataset
from partial_fc_mx.parity.noise import add_noise, flip_labels, split_identities
from partial_fc_mx.prep.pack import write_records
from partial_fc_mx.prep.synthetic import prepare_synthetic

CLASSES, PER_CLASS, FLIPPED = 30, 10, 0.1


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> dict:
    """30 synthetic identities x 10 images, 10% of each class's images filed under
    another class (the study's generator), packed; a K = 3 run trained on them for 8
    epochs (precision 1.0 and recall 0.70-0.90 over four data and noise seeds, where 25
    epochs gave 0.60-0.80: the longer run starts to learn the wrong labels too)."""
    root = tmp_path_factory.mktemp("clean")
    prepare_synthetic(str(root / "clean"), CLASSES, per_class=PER_CLASS, heldout=10, pairs=50,
                      seed=3)
    source = RecordDataset(root / "clean")
    records = [source.records.read(int(i)) for i in source.image_ids]
    truth = np.array([int(r.label) for r in records])
    noisy = flip_labels(truth, FLIPPED, np.random.default_rng(5))
    order = np.argsort(noisy, kind="stable")  # the packer wants labels grouped
    write_records(root / "noisy", ((int(noisy[i]), records[i].image) for i in order), CLASSES)
    config = config_file(root, root / "noisy", num_classes=CLASSES, batch_size=30,
                         num_epoch=8, margin_list=(1.0, 0.5, 0.0), num_subcenters=3,
                         frequent=50, save_every=0)
    work = root / "work"
    trained = run(python_module("train", str(config), "--work-dir", str(work)), timeout=600)
    assert trained.returncode == 0, trained.stdout[-3000:]
    return {"root": root, "work": work, "data": root / "noisy", "config": config,
            "wrong": noisy[order] != truth[order], "images": [records[i].image for i in order],
            "labels": noisy[order]}


def clean_args(work: Path, out: Path, data: Path, *extra: str) -> list[str]:
    return python_module("clean", str(work), str(out), "--rec", str(data), *extra)


def test_clean_drops_the_wrong_labels_and_copies_the_rest_byte_for_byte(planted, tmp_path):
    """Under mpirun -np 2 (chunks of 64 images spread over the ranks): what is dropped
    is the planted wrong labels (precision), at least half of them are (recall); every
    kept record's image is the source's, byte for byte, under its class's new id."""
    out = tmp_path / "cleaned"
    cleaned = run(mpirun_command(2, clean_args(planted["work"], out, planted["data"],
                                               "--chunk", "64")), timeout=300)
    assert cleaned.returncode == 0, cleaned.stdout[-3000:]
    report = json.loads((out / "clean_report.json").read_text())
    assert f"kept {report['images_kept']} of {CLASSES * PER_CLASS} images" in cleaned.stdout
    kept_data = RecordDataset(out)
    kept = [kept_data.records.read(int(i)) for i in kept_data.image_ids]
    positions = [planted["images"].index(record.image) for record in kept]  # bytes found
    dropped = np.setdiff1d(np.arange(len(planted["images"])), positions)
    wrong = planted["wrong"]
    assert len(dropped) == report["images"] - report["images_kept"] > 0
    precision, recall = wrong[dropped].mean(), wrong[dropped].sum() / wrong.sum()
    assert precision >= 0.8 and recall >= 0.5, (precision, recall, report["angle_histogram"])
    mapping = dict(np.loadtxt(out / "labels.txt", dtype=np.int64).reshape(-1, 2).tolist())
    assert sorted(mapping) == list(range(report["classes_kept"])) == \
        list(range(kept_data.num_classes))
    old_of = {new: old for new, old in mapping.items()}
    assert [old_of[int(r.label)] for r in kept] == planted["labels"][positions].tolist()
    assert sum(report["angle_histogram"].values()) == report["images"]
    assert report["most_affected_classes"][0]["dropped"] >= 1


def test_a_killed_clean_goes_on_without_redoing_its_finished_chunks(planted, tmp_path):
    """SIGKILL to the whole job once some chunks are written; the restart embeds only
    the chunks not there (their files untouched) and writes what an uninterrupted run
    writes."""
    out = tmp_path / "cleaned"
    args = mpirun_command(2, clean_args(planted["work"], out, planted["data"], "--chunk", "16",
                                        "--batch-size", "4"))
    job = start(args)
    chunks = out / ".chunks"
    deadline = time.time() + 240
    while len(list(chunks.glob("chunk_*.npz"))) < 4 and time.time() < deadline:
        time.sleep(0.05)
    kill_group(job)
    done_before = {p.name: p.stat().st_mtime_ns for p in chunks.glob("chunk_*.npz")}
    assert 4 <= len(done_before) < 19, done_before  # 300 images: 19 chunks of 16
    assert not (out / "clean_report.json").exists()
    again = run(args, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:]
    after = {p.name: p.stat().st_mtime_ns for p in chunks.glob("chunk_*.npz")}
    assert len(after) == 19
    assert all(after[name] == stamp for name, stamp in done_before.items())
    whole = tmp_path / "whole"
    assert run(clean_args(planted["work"], whole, planted["data"], "--chunk", "16"),
               timeout=300).returncode == 0
    assert (out / "train.rec").read_bytes() == (whole / "train.rec").read_bytes()
    assert (out / "labels.txt").read_text() == (whole / "labels.txt").read_text()


def test_a_clean_of_another_dataset_or_a_run_without_centers_is_refused(planted, tmp_path):
    other = tmp_path / "other"
    prepare_synthetic(str(other), CLASSES, per_class=PER_CLASS, heldout=10, pairs=50, seed=4)
    refused = run(clean_args(planted["work"], tmp_path / "out", other), timeout=300)
    assert refused.returncode == 2
    assert f"{other} holds {CLASSES} classes and {CLASSES * PER_CLASS} images" in refused.stdout
    assert "give the dataset (or the `rec` list, in its order) the run trained on" in \
        refused.stdout
    assert not (tmp_path / "out" / "train.rec").exists()
    moved = tmp_path / "stale"  # the backbone of another step than the newest checkpoint
    subprocess.run(["cp", "-r", str(planted["work"]), str(moved)], check=True)
    record = json.loads((moved / "backbone.json").read_text())
    (moved / "backbone.json").write_text(json.dumps({**record, "step": 1}))
    stale = run(clean_args(moved, tmp_path / "out2", planted["data"]), timeout=300)
    assert stale.returncode == 2 and "backbone-symbol.json/-0000.params are of step 1" in \
        stale.stdout


def test_an_undecodable_image_is_dropped_and_counted_and_the_input_is_never_the_output(
        planted, tmp_path):
    """An image whose bytes no decoder reads (in place: train.idx, and with it the
    dataset's fingerprint, unchanged) is not scored: dropped and counted. OUT may not be
    the dataset, the work dir, or a folder holding another dataset."""
    data = tmp_path / "data"
    subprocess.run(["cp", "-r", str(planted["data"]), str(data)], check=True)
    dataset = RecordDataset(data)
    record_id = int(dataset.image_ids[7])
    offset, size = dataset.records.offsets[record_id], len(dataset.records.read_bytes(record_id))
    with open(data / "train.rec", "r+b") as rec:  # the image after the 24-byte IRHeader
        rec.seek(offset + 8 + 24)
        rec.write(b"\0" * (size - 24))
    cleaned = run(clean_args(planted["work"], tmp_path / "out", data), timeout=300)
    assert cleaned.returncode == 0, cleaned.stdout[-3000:]
    report = json.loads((tmp_path / "out/clean_report.json").read_text())
    assert report["images_not_scored"] == 1
    assert sum(report["angle_histogram"].values()) == report["images"] - 1
    for out, what in ((data, f"OUT {data} is {data}, an input"),
                      (planted["work"], f"OUT {planted['work']} is {planted['work']}"),
                      (planted["root"] / "clean", "holds a dataset (train.rec) that no "
                                                  "cleaning wrote")):
        refused = run(clean_args(planted["work"], out, data), timeout=300)
        assert refused.returncode == 2 and what in refused.stdout, refused.stdout[-2000:]
    assert (data / "train.rec").stat().st_size == (planted["data"] / "train.rec").stat().st_size


def test_one_center_per_class_is_its_one_sub_center(planted, tmp_path):
    """A K = 1 run: the class center is each class's sub-center, and the report says so."""
    config = config_file(tmp_path, planted["data"], num_classes=CLASSES, max_steps=3)
    work = tmp_path / "work"
    assert run(python_module("train", str(config), "--work-dir", str(work)),
               timeout=300).returncode == 0
    cleaned = run(clean_args(work, tmp_path / "out", planted["data"]), timeout=300)
    assert cleaned.returncode == 0, cleaned.stdout[-3000:]
    assert "trained with one center per class: each class center is its one sub-center" in \
        cleaned.stdout
    assert json.loads((tmp_path / "out/clean_report.json").read_text())["num_subcenters"] == 1


def test_the_dominant_sub_center_is_the_one_most_samples_pick():
    labels = np.array([0, 0, 0, 1, 1])
    cosines = np.array([[0.9, 0.1], [0.2, 0.8], [0.1, 0.7], [0.5, 0.4], [0.3, 0.2]])
    counts = dominant.pick_counts(labels, cosines, 3)
    assert counts.tolist() == [[1, 2], [2, 0], [0, 0]]
    chosen = dominant.dominant(counts)
    assert chosen.tolist() == [1, 0, 0]
    degrees = dominant.angles(labels, cosines, chosen)
    np.testing.assert_allclose(degrees, np.degrees(np.arccos([0.1, 0.8, 0.7, 0.5, 0.3])))
    unscored = np.array([[np.nan] * 3, [np.nan] * 3, [0.1, 0.2, 0.9]])  # no vote
    assert dominant.pick_counts(np.zeros(3, int), unscored, 1).tolist() == [[0, 0, 1]]


def test_the_noise_generator_flips_and_splits_what_it_says_and_keeps_the_truth():
    """flips: each class gives its fraction (on average) to uniformly drawn other
    classes; splits: that fraction of identities in two ids, halves of their samples;
    the same labels from the same seed."""
    truth = np.arange(500).repeat(8)
    flipped = add_noise(truth, "flips0.4", seed=1)
    moved = flipped != truth
    assert abs(moved.mean() - 0.4) < 0.02
    assert np.array_equal(flipped, add_noise(truth, "flips0.4", seed=1))
    per_class = np.bincount(truth[moved], minlength=500)
    assert set(per_class.tolist()) <= {3, 4}  # 3.2 of 8 on average: 3 or 4 each
    split = split_identities(truth, 0.3, np.random.default_rng(2))
    assert split.max() + 1 == 650
    halves = np.bincount(split)
    assert halves[np.unique(truth[split != truth])].tolist() == [4] * 150
    assert (halves[500:] == 4).all()
    assert flip_labels(truth, 0.4, np.random.default_rng(3)).max() < 500
    with pytest.raises(SystemExit, match="flips0.4 or splits0.3"):
        add_noise(truth, "flip40", seed=1)
