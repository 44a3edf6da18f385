"""A folder of people's photos as users have one (mixed sizes, a broken file, an empty
person folder, a hidden folder): what `pack` keeps, what it says it left out, and the
people it holds out for a verification set of unseen identities."""

from __future__ import annotations

import re
from pathlib import Path

import cv2
import numpy as np
import pytest
from conftest import python_module, run

from partial_fc_mx.data import DataError
from partial_fc_mx.data.recordio import RecordDataset
from partial_fc_mx.data.verification_set import read_verification_bin
from partial_fc_mx.prep.heldout import choose_people, pack_folder_holding_out
from partial_fc_mx.prep.pack import pack_folder, pack_list


def photo_folders(root: Path, small: int, large: int, per_person: int = 3, seed: int = 0) -> Path:
    """`small` people of 92x112 PNGs (p00..), `large` of 200x240 JPEGs, one broken
    file, an empty person folder (zz_empty) and a hidden folder (.cache)."""
    rng = np.random.default_rng(seed)
    for index in range(small + large):
        person = root / f"p{index:02d}"
        person.mkdir(parents=True)
        width, height, suffix = (92, 112, ".png") if index < small else (200, 240, ".jpg")
        for k in range(per_person):
            coarse = rng.integers(0, 255, (6, 6, 3), dtype=np.uint8)
            cv2.imwrite(str(person / f"{k}{suffix}"), cv2.resize(coarse, (width, height)))
    (root / "p00" / "broken.jpg").write_bytes(b"\xff\xd8 not a picture")
    (root / "zz_empty").mkdir()
    (root / ".cache").mkdir()
    cv2.imwrite(str(root / ".cache" / "0.png"), np.zeros((112, 112, 3), np.uint8))
    return root


@pytest.mark.parametrize("small, large", [(4, 3), (2, 6)])
def test_a_folder_of_wrong_sizes_names_the_sizes_found(tmp_path, small, large):
    source = photo_folders(tmp_path / "faces", small, large)
    with pytest.raises(DataError, match=rf"sizes found: .*92x112: {3 * small}") as raised:
        pack_folder(source, tmp_path / "rec")  # no --resize: only 112x112 would do
    assert f"200x240: {3 * large}" in str(raised.value) and "--resize" in str(raised.value)
    assert not (tmp_path / "rec").exists()


def test_unusable_sizes_and_empty_people_do_not_enter_property(tmp_path):
    source = tmp_path / "faces"
    for empty in ("zz_empty", ".cache"):
        (source / empty).mkdir(parents=True)
    cv2.imwrite(str(source / ".cache" / "0.png"), np.zeros((112, 112, 3), np.uint8))
    for index, size in enumerate([(112, 112), (112, 112), (92, 112), (200, 240)]):
        person = source / f"q{index}"
        person.mkdir()
        for k in range(2):
            cv2.imwrite(str(person / f"{k}.png"), np.full((*size[::-1], 3), 40 * k, np.uint8))
    report = pack_folder(source, tmp_path / "rec")
    dataset = RecordDataset(tmp_path / "rec")
    assert (report.images, report.classes, dataset.num_classes) == (4, 2, 2)
    labels = sorted({dataset.records.read(int(i)).label for i in dataset.image_ids})
    assert labels == [0, 1]
    lines = "\n".join(report.summary())
    assert "sizes found: 92x112: 2, 200x240: 2" in lines
    assert "3 class(es) have no image and are not in the dataset (q2, q3, zz_empty)" \
        in lines and "the other 2 are numbered 0..1" in lines
    assert ".cache" not in report.names  # a hidden folder is not a person


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_heldout_people_are_not_trained_and_give_pairs(tmp_path, seed):
    source = photo_folders(tmp_path / "faces", small=5, large=7, per_person=4, seed=seed)
    held = pack_folder_holding_out(source, tmp_path / "rec", count=4, pairs=20, seed=seed,
                                   resize=True)
    people = sorted(p.name for p in source.iterdir() if not p.name.startswith("."))
    assert len(held.people) == 4 and set(held.people) <= set(people)
    trained = held.train.names
    assert not set(trained) & set(held.people) and set(trained) | set(held.people) == set(people)
    dataset = RecordDataset(tmp_path / "rec")
    with_pictures = [p for p in trained if p != "zz_empty"]
    assert dataset.num_classes == held.train.classes == len(with_pictures)
    images, issame = read_verification_bin(tmp_path / "rec" / "heldout.bin")
    assert len(images) == 2 * len(issame) == 2 * held.pairs
    assert issame.sum() == (~issame).sum() > 0
    # the held-out pictures are the people's own: none of them is in the training data
    trained_bytes = {dataset.records.read(int(i)).image for i in dataset.image_ids}
    assert not trained_bytes & set(images)
    again = pack_folder_holding_out(source, tmp_path / "rec2", count=4, pairs=20, seed=seed,
                                    resize=True)
    assert again.people == held.people  # the seed decides, nothing else


def test_heldout_people_by_name_and_the_mistakes(tmp_path):
    source = photo_folders(tmp_path / "faces", small=3, large=3, per_person=3)
    people = sorted(p.name for p in source.iterdir() if not p.name.startswith("."))
    assert choose_people(people, 0, ["p01", "p04"], seed=5) == ["p01", "p04"]
    with pytest.raises(DataError, match="'p1' is not a person folder"):
        choose_people(people, 0, ["p1", "p04"], seed=0)
    with pytest.raises(DataError, match="cannot hold out 1 of 7 people"):
        choose_people(people, 1, None, seed=0)
    with pytest.raises(DataError, match="cannot hold out 7 of 7 people"):
        choose_people(people, 7, None, seed=0)
    # held-out people without usable pictures (not 112x112, no --resize): nothing written
    with pytest.raises(DataError, match=r"give 0 pairs, and verification needs 10"):
        pack_folder_holding_out(source, tmp_path / "rec", 0, ["p03", "p04"])
    # two people of 2 pictures give 2 genuine and 2 impostor pairs: too few for 10 folds
    for person in ("r1", "r2"):
        (source / person).mkdir()
        for k in range(2):
            cv2.imwrite(str(source / person / f"{k}.png"), np.full((112, 112, 3), k, np.uint8))
    with pytest.raises(DataError, match=r"\[2, 2\] per person with any\) give 4 pairs"):
        pack_folder_holding_out(source, tmp_path / "rec", 0, ["r1", "r2"])
    assert not (tmp_path / "rec").exists()


@pytest.mark.parametrize("seed", range(6))
def test_people_are_drawn_among_those_with_two_pictures(tmp_path, seed):
    source = photo_folders(tmp_path / "faces", small=0, large=6, per_person=3, seed=seed)
    for name in ("e1", "e2", "e3"):
        (source / name).mkdir()
    cv2.imwrite(str(source / "e3" / "0.png"), np.zeros((112, 112, 3), np.uint8))
    held = pack_folder_holding_out(source, tmp_path / "rec", 3, pairs=20, seed=seed,
                                   resize=True)
    assert len(held.people) == 3 and all(p.startswith("p") for p in held.people)
    assert held.pairs >= 10

def test_pack_command_prints_the_next_step(tmp_path):
    source = photo_folders(tmp_path / "faces", small=4, large=4)
    done = run(python_module("pack", str(source), "rec", "--resize", "--heldout", "3",
                             "--pairs", "10"), cwd=tmp_path)
    assert done.returncode == 0, done.stdout
    classes = int(re.search(r"rec: \d+ images of (\d+) classes", done.stdout)[1])
    assert RecordDataset(tmp_path / "rec").num_classes == classes
    assert 'val_targets = ["heldout"]' in done.stdout and "pairs of 3 people" in done.stdout
    assert (tmp_path / "rec" / "heldout.bin").is_file()
    names = (tmp_path / "rec" / "heldout_people.txt").read_text().split()
    assert len(names) == 3 and all((source / name).is_dir() for name in names)
    assert "all of them in rec/heldout_people.txt" in done.stdout
    listed = run(python_module("pack", "x.lst", "rec2", "--heldout", "2"), cwd=tmp_path)
    assert listed.returncode == 2 and "--heldout are for a folder" in listed.stdout
    # a pack without held-out people removes an earlier one's heldout.bin
    again = run(python_module("pack", str(source), "rec", "--resize"), cwd=tmp_path)
    assert again.returncode == 0 and "removed rec/heldout.bin" in again.stdout
    assert not (tmp_path / "rec" / "heldout.bin").exists()
    assert not (tmp_path / "rec" / "heldout_people.txt").exists()
    for wrong, says in ((["--heldout", "-1"], "-1 is less than 0"),
                        (["--pairs", "4"], "4 is less than 5"),
                        (["--heldout", "2", "--heldout-people", "p01,p02"], "not allowed with")):
        refused = run(python_module("pack", str(source), "rec3", *wrong), cwd=tmp_path)
        assert refused.returncode == 2 and says in refused.stdout, refused.stdout


def test_a_list_with_label_gaps_is_renumbered(tmp_path):
    """A .lst whose labels skip 1 and 3: property counts 3 classes, labels 0..2 in order."""
    faces = tmp_path / "faces"
    faces.mkdir()
    lines = []
    for index, label in enumerate([0, 0, 2, 4, 4]):
        cv2.imwrite(str(faces / f"{index}.png"), np.full((112, 112, 3), 50 * index, np.uint8))
        lines.append(f"{index}\t{label}\t{index}.png")
    (tmp_path / "train.lst").write_text("\n".join(lines) + "\n")
    report = pack_list(tmp_path / "train.lst", faces, tmp_path / "rec")
    dataset = RecordDataset(tmp_path / "rec")
    labels = [dataset.records.read(int(i)).label for i in dataset.image_ids]
    assert dataset.num_classes == report.classes == 3 and labels == [0, 0, 1, 2, 2]
    assert "2 class(es) have no image and are not in the dataset (label 1, label 3)" \
        in "\n".join(report.summary())
