"""Several datasets trained as one (`rec` a list, data/joined.py): one label space with
each dataset's classes after the previous ones', one epoch order sharded as one
dataset's, and the files named in every message."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import config_file, logged, mpirun, python_module, run, train_args
from test_data import corrupt_record, pack_random

from partial_fc_mx.config import ConfigError, load_config
from partial_fc_mx.data import DataError
from partial_fc_mx.data.joined import JoinedDataset
from partial_fc_mx.data.loader import FaceLoader
from partial_fc_mx.prep.synthetic import prepare_synthetic


def two_datasets(tmp_path: Path) -> list[Path]:
    """12 classes x 3 images, then 8 classes x 2: label == image order in each."""
    return [pack_random(tmp_path / "first", 12, 3, seed=1),
            pack_random(tmp_path / "second", 8, 2, seed=2)]


def test_the_second_datasets_classes_follow_the_firsts_and_every_image_comes_once(tmp_path):
    first, second = two_datasets(tmp_path)
    joined = JoinedDataset([first, second], num_classes=20)
    assert (len(joined), joined.num_classes) == (12 * 3 + 8 * 2, 20)
    labels = [int(joined.records.read(int(i)).label) for i in joined.record_ids(np.arange(52))]
    assert labels == sorted([c for c in range(12) for _ in range(3)]
                            + [12 + c for c in range(8) for _ in range(2)])
    seen = []
    for rank in range(2):  # shards of one epoch: disjoint, and all but the remainder
        loader = FaceLoader(joined, 4, rank=rank, world_size=2, mirror=False)
        seen += [int(i) for row in loader.record_ids(epoch=3) for i in row]
    assert len(seen) == len(set(seen)) == 48
    batch = next(iter(FaceLoader(joined, 52, mirror=False).epoch(0)))
    assert sorted(batch.labels.tolist()) == labels


def test_the_class_count_must_be_the_sum_and_each_datasets_labels_stay_its_own(tmp_path):
    first, second = two_datasets(tmp_path)
    with pytest.raises(DataError, match=r"num_classes is 21, but the datasets of `rec` hold 12 "
                                        r"\(.*first\) \+ 8 \(.*second\) = 20 classes"):
        JoinedDataset([first, second], num_classes=21)
    (second / "property").write_text("6,112,112")  # its labels 6, 7 now beyond its classes
    joined = JoinedDataset([first, second])
    with pytest.raises(DataError, match=r"second/train\.rec: record \d+ has label [67]\.0, "
                                        r"outside that dataset's classes 0\.\.5"):
        list(FaceLoader(joined, 4, mirror=False).epoch(0))


def im2rec_dataset(directory: Path, keys: list[int], classes: int | None) -> Path:
    """As MXNet's im2rec writes one: no header record, keys as given (labels cycle over
    `classes`, or 3), and a property file only when `classes` is given."""
    import mxnet as mx
    from test_data import random_face

    from partial_fc_mx.data.transforms import encode_jpeg

    directory.mkdir(parents=True)
    rng = np.random.default_rng(4)
    writer = mx.recordio.MXIndexedRecordIO(str(directory / "train.idx"),
                                           str(directory / "train.rec"), "w")
    for n, key in enumerate(keys):
        header = mx.recordio.IRHeader(0, float(n % (classes or 3)), key, 0)
        writer.write_idx(key, mx.recordio.pack(header, encode_jpeg(random_face(rng))))
    writer.close()
    if classes:
        (directory / "property").write_text(f"{classes},112,112")
    return directory


def test_a_dataset_without_header_joins_and_each_needs_its_class_count(tmp_path):
    first = pack_random(tmp_path / "first", 12, 3, seed=1)
    plain = im2rec_dataset(tmp_path / "plain", list(range(6)), classes=3)
    joined = JoinedDataset([first, plain])
    labels = [joined.records.read(int(i)).label for i in joined.record_ids(np.arange(36, 42))]
    assert labels == [12.0, 13.0, 14.0, 12.0, 13.0, 14.0]
    unstated = im2rec_dataset(tmp_path / "unstated", list(range(6)), classes=None)
    with pytest.raises(DataError, match=r"unstated/property is missing: each dataset of a `rec` "
                                        r"list states its class count there"):
        JoinedDataset([first, unstated])
    far = im2rec_dataset(tmp_path / "far", [0, 1 << 40], classes=3)
    with pytest.raises(DataError, match=r"far/train\.idx has record ids 0\.\.1099511627776, "
                                        r"beyond 0\.\.2\^40 - 1"):
        JoinedDataset([first, far])


def test_a_corrupt_image_is_named_by_its_own_file_and_record(tmp_path):
    first, second = two_datasets(tmp_path)
    corrupt_record(second, 5)
    with pytest.raises(DataError, match=r"cannot be decoded .*: \S*second/train\.rec: record 5\."):
        list(FaceLoader(JoinedDataset([first, second]), 52, mirror=False).epoch(0))


def test_a_config_lists_datasets_and_finds_verification_sets_in_them(tmp_path):
    first, second = two_datasets(tmp_path)
    (second / "own.bin").write_bytes(b"")
    path = config_file(tmp_path, str(first), num_classes=20, val_targets=["own"])
    config = load_config(path, [f"rec=[{str(first)!r}, {str(second)!r}]"])
    assert config.rec == [str(first), str(second)]
    assert config.val_paths() == [second / "own.bin"]
    for bad in ("[]", f"[{str(first)!r}, {str(first) + '/.'!r}]", "['random']", "[3]"):
        with pytest.raises(ConfigError, match=r"rec=.*: a list of datasets names one or more "
                                              r"folders, each once"):
            load_config(path, [f"rec={bad}"])
    with pytest.raises(ConfigError, match=r"a list whose quotes the shell took away: quote the "
                                          r"whole word"):
        load_config(path, [f"rec=[{first},{second}]"])  # what bash leaves of rec=['a','b']
    (first / "own.bin").write_bytes(b"")
    twice = load_config(path, [f"rec=[{str(first)!r}, {str(second)!r}]",
                               f"val_targets=['own', {str(second / 'own.bin')!r}]"])
    with pytest.raises(ConfigError, match=r"name two sets of the same file name"):
        twice.val_paths()


def test_a_resume_over_datasets_of_equal_counts_in_the_other_order_is_refused(tmp_path):
    """Their class and image counts agree both ways round; their train.idx does not."""
    from partial_fc_mx.run.checkpoint import CheckpointError, refuse_other_datasets

    first = pack_random(tmp_path / "first", 8, 3, seed=1)
    second = pack_random(tmp_path / "second", 8, 3, seed=2)
    saved = JoinedDataset([first, second]).composition()
    refuse_other_datasets(tmp_path, saved, JoinedDataset([first, second]).composition())
    with pytest.raises(CheckpointError, match=r"was trained on \S+first \(8 classes, 24 "
                       r"images\) \+ \S+second .*this run's rec is \S+second"):
        refuse_other_datasets(tmp_path, saved, JoinedDataset([second, first]).composition())
    older = [{key: d[key] for key in ("rec", "classes", "images")} for d in saved]
    refuse_other_datasets(tmp_path, older, JoinedDataset([second, first]).composition())


def test_inspect_shows_each_dataset_and_what_they_are_together(tmp_path):
    first, second = two_datasets(tmp_path)
    shown = run(python_module("inspect", str(first), str(second)))
    assert shown.returncode == 0, shown.stdout
    assert f"{first}: 36 images, 12 classes" in shown.stdout
    assert f"{second}: 16 images, 8 classes" in shown.stdout
    assert re.search(r"together \(rec = .*\): 52 images, num_classes = 20\n"
                     rf"  {first}: classes 0\.\.11\n  {second}: classes 12\.\.19", shown.stdout)


def test_two_datasets_train_save_and_resume_on_another_number_of_processes(tmp_path):
    """The preflight and training take the list; a run saved on 2 processes resumes on
    3 over the same joined order, the centers of both datasets' classes kept."""
    big, small = tmp_path / "big", tmp_path / "small"
    prepare_synthetic(str(big), 80, per_class=6, heldout=20, pairs=100, seed=1)
    prepare_synthetic(str(small), 40, per_class=6, heldout=20, pairs=100, seed=2)
    rec = f"rec=[{str(big)!r}, {str(small)!r}]"
    config = config_file(tmp_path, big, num_classes=120, val_targets=["synthetic_heldout"],
                         num_epoch=2, save_every=10)
    work = tmp_path / "work"
    checked = run(python_module("check", str(config), rec))
    assert checked.returncode == 0, checked.stdout[-3000:]
    assert f"data: {[str(big), str(small)]}, 120 classes" in checked.stdout
    first = mpirun(2, train_args(config, work, rec, "max_steps=10"))
    assert first.returncode == 0, first.stdout[-3000:]
    assert json.loads((work / "checkpoints" / "step_000010" / "meta.json").read_text())[
        "num_classes"] == 120
    resumed = mpirun(3, train_args(config, work, rec, "--resume-from", str(work)))
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    reordered = f"rec=[{str(small)!r}, {str(big)!r}]"  # the same sum, other class ids
    refused = mpirun(2, train_args(config, work, reordered, "--resume-from", str(work)))
    assert refused.returncode == 1
    assert re.search(r"was trained on \S+big \(80 classes, 480 images\) \+ \S+small \(40 "
                     r"classes, 240 images\); this run's rec is \S+small .*: its class ids "
                     r"would stand for other people", refused.stdout), refused.stdout[-3000:]
    log = logged(work)
    assert f"resuming from {work / 'checkpoints' / 'step_000010'}" in log["text"]
    assert f"training tiny on {[str(big), str(small)]}: 120 classes" in log["text"]
    last = log["steps"][-1]  # both epochs of the 1,440 images, less what fits no batch
    assert last["epoch"] == 1 and 1440 - 72 < last["images"] <= 1440, last
