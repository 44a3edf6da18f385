"""Checkpoints: verifiable, durable, resumable after damage and after kills mid-save,
never executing what they hold; and what a resume keeps (real processes)."""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
import signal
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
from conftest import (
    config_file,
    finish,
    kill_group,
    logged,
    mpirun,
    mpirun_command,
    rank_pids,
    run,
    start,
    train_args,
)

from partial_fc_mx.durable import file_record
from partial_fc_mx.run import checkpoint


@pytest.fixture(scope="module")
def trained(tmp_path_factory, synthetic) -> Path:
    """A 2-process run with checkpoints at steps 2 and 4, evaluated every 2 steps."""
    directory = tmp_path_factory.mktemp("trained")
    config = config_file(directory, synthetic, max_steps=4, save_every=2, keep_checkpoints=5,
                         verbose=2, val_targets=["synthetic_heldout"])
    result = mpirun(2, train_args(config, directory / "work"), timeout=600)
    assert result.returncode == 0, result.stdout[-3000:]
    return directory / "work"


def copy_of(work: Path, tmp_path: Path) -> Path:
    target = tmp_path / "work"
    shutil.copytree(work, target)
    return target


def resume_one_step(tmp_path: Path, data: Path, work: Path, resume_from: Path | None = None,
                    **keys) -> tuple:
    """Resume `work` (or `resume_from`) on one process for two more steps; (result, log)."""
    config = config_file(tmp_path, data, name="resume.py", max_steps=6, save_every=100, **keys)
    out = tmp_path / "resumed"
    result = run(train_args(config, out, "--resume-from", str(resume_from or work)), timeout=300)
    return result, (logged(out) if (out / "training.log").exists() else None)


def test_every_file_is_listed_with_its_size_and_checksum(trained):
    for saved in checkpoint.checkpoints(trained):
        files = json.loads((saved / "meta.json").read_text())["files"]
        on_disk = {p.name for p in saved.iterdir()} - {"meta.json"}
        assert set(files) == on_disk == {
            "backbone.params", "backbone_optimizer.npz", "rank_0_softmax_weight.npy",
            "rank_0_softmax_weight_mom.npy", "rank_0_sampler.json", "rank_1_softmax_weight.npy",
            "rank_1_softmax_weight_mom.npy", "rank_1_sampler.json"}
        for name, record in files.items():
            assert file_record(saved / name) == record
        assert checkpoint.verify(saved) == []


@pytest.mark.parametrize("damage, message", [
    ("truncate", r"rank_1_softmax_weight\.npy has \d+ bytes, meta\.json says \d+ \(truncated\?\)"),
    ("flip", r"rank_1_softmax_weight\.npy does not match its checksum in meta\.json"),
    ("delete", r"rank_1_softmax_weight\.npy is missing"),
    ("meta", r"meta\.json is damaged"),
])
def test_a_damaged_newest_checkpoint_is_skipped_with_the_file_named(tmp_path, synthetic, trained,
                                                                     damage, message):
    work = copy_of(trained, tmp_path)
    newest = work / "checkpoints" / "step_000004"
    target = newest / "rank_1_softmax_weight.npy"
    data = target.read_bytes()
    if damage == "truncate":
        target.write_bytes(data[:-100])
    elif damage == "flip":
        target.write_bytes(data[:-8] + bytes(b ^ 0xFF for b in data[-8:]))
    elif damage == "delete":
        target.unlink()
    else:
        meta = newest / "meta.json"
        meta.write_text(meta.read_text()[:200])
    result, log = resume_one_step(tmp_path, synthetic, work)
    assert result.returncode == 0, result.stdout[-3000:]
    assert re.search(rf"skipped checkpoint {newest}: .*{message}", log["text"]), log["text"]
    assert f"resuming from {work / 'checkpoints' / 'step_000002'}" in log["text"]
    assert log["steps"][0]["step"] == 3
    # asked for by name, a damaged checkpoint is an error, not a silent fallback
    (tmp_path / "named").mkdir()
    named, _ = resume_one_step(tmp_path / "named", synthetic, work, resume_from=newest)
    assert named.returncode == 1 and re.search(message, named.stdout), named.stdout[-2000:]


def test_checkpoints_past_step_999999_are_ordered_by_number(tmp_path, synthetic, trained):
    """A checkpoint renamed to step 999998 (and its meta set to match) is resumed; the
    saves of steps 999999 .. 1000002 prune by number: the newest two stay."""
    work = copy_of(trained, tmp_path)
    old = work / "checkpoints" / "step_000004"
    renamed = work / "checkpoints" / "step_999998"
    old.rename(renamed)
    meta = json.loads((renamed / "meta.json").read_text())
    (renamed / "meta.json").write_text(json.dumps({**meta, "step": 999998}))
    config = config_file(tmp_path, synthetic, name="long.py", max_steps=8, save_every=1,
                         keep_checkpoints=2)
    result = mpirun(2, train_args(config, work, "--resume-from", str(work)), timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]
    assert f"resuming from {renamed}" in result.stdout
    assert [p.name for p in checkpoint.checkpoints(work)] == ["step_1000001", "step_1000002"]
    assert json.loads((work / "checkpoints" / "step_1000002" / "meta.json").read_text())[
        "step"] == 1000002


class CreatesAFile:
    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self):
        return os.system, (f"touch {self.target}",)


def replace_listed_file(saved: Path, name: str, content: bytes) -> None:
    """Swap a file and update meta.json to match, as an attacker would."""
    (saved / name).write_bytes(content)
    meta = json.loads((saved / "meta.json").read_text())
    meta["files"][name] = {"bytes": len(content), "crc32": zlib.crc32(content)}
    (saved / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("name", ["backbone_optimizer.npz", "rank_0_softmax_weight.npy"])
def test_a_crafted_state_file_is_refused_and_runs_nothing(tmp_path, synthetic, trained, name):
    work = copy_of(trained, tmp_path)
    target = tmp_path / "pwned"
    payload = pickle.dumps(CreatesAFile(target))
    if name.endswith(".npy"):  # an object array: np.load would unpickle it if allowed
        buffer = tmp_path / "object.npy"
        np.save(buffer, np.array([CreatesAFile(target)], dtype=object), allow_pickle=True)
        payload = buffer.read_bytes()
    replace_listed_file(work / "checkpoints" / "step_000004", name, payload)
    result, _ = resume_one_step(tmp_path, synthetic, work / "checkpoints" / "step_000004")
    assert result.returncode == 1, result.stdout[-3000:]
    assert f"error: {work / 'checkpoints' / 'step_000004' / name}" in result.stdout
    assert ("not an optimizer state file" if name.endswith(".npz") else
            "holds no plain array of numbers") in result.stdout, result.stdout[-2000:]
    assert not target.exists()


@pytest.mark.parametrize("record, best, replaced", [
    ("meta.json", 1.01, False),           # the checkpoint keeps the best accuracy
    ("older meta.json", 1.01, False),     # where checkpoints before validators kept it
    ("backbone-best.json", 1.01, False),  # a best found after the last checkpoint
    ("meta.json", 0.0, True),             # and a better model does replace it
])
def test_a_resume_replaces_the_best_model_only_by_a_better_one(tmp_path, synthetic, trained,
                                                               record, best, replaced):
    work = copy_of(trained, tmp_path)
    newest = work / "checkpoints" / "step_000004"
    meta = json.loads((newest / "meta.json").read_text())
    kept = meta["validator"]
    assert kept["best_step"] in (2, 4) and 0 < kept["best_accuracy"] <= 1
    on_disk = json.loads((work / "backbone-best.json").read_text())
    assert on_disk == {"accuracy": kept["best_accuracy"], "step": kept["best_step"]}
    if record == "meta.json":
        meta["validator"]["best_accuracy"] = best
    elif record == "older meta.json":
        meta = {**{k: v for k, v in meta.items() if k != "validator"}, **kept,
                "best_accuracy": best}
    if record.endswith("meta.json"):  # the checkpoint alone knows the best
        (newest / "meta.json").write_text(json.dumps(meta))
        (work / "backbone-best.json").unlink()
    else:
        (work / "backbone-best.json").write_text(json.dumps({"accuracy": best, "step": 3}))
    model = work / "backbone-best-0000.params"
    before = model.read_bytes()
    config = config_file(tmp_path, synthetic, name="more.py", max_steps=8, save_every=4,
                         verbose=2, val_targets=["synthetic_heldout"])
    result = mpirun(2, train_args(config, work, "--resume-from", str(work)), timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]
    text = (work / "training.log").read_text().split("resuming from")[1]
    assert "[synthetic_heldout][6]Accuracy-Flip" in text
    assert ("best mean" in text) == replaced and (model.read_bytes() != before) == replaced
    final = json.loads((work / "checkpoints" / "step_000008" / "meta.json").read_text())
    if not replaced:
        assert final["validator"]["best_accuracy"] == 1.01
    else:
        assert final["validator"]["best_step"] in (6, 8) and final["validator"]["best_accuracy"] > 0


def test_resuming_an_older_checkpoint_moves_the_newer_ones_aside(tmp_path, synthetic, trained):
    """Its saves must be the newest: pruning would otherwise delete them in favour of
    the abandoned step 4, and a later resume would pick step 4."""
    work = copy_of(trained, tmp_path)
    config = config_file(tmp_path, synthetic, name="again.py", max_steps=4, save_every=1,
                         keep_checkpoints=2)
    older = work / "checkpoints" / "step_000002"
    result = mpirun(2, train_args(config, work, "--resume-from", str(older)), timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]
    aside = [p for p in work.iterdir() if p.name.startswith("checkpoints-before-")]
    assert len(aside) == 1 and [p.name for p in aside[0].iterdir()] == ["step_000004"]
    assert f"past step 2 of another run: moved them to {aside[0]}" in result.stdout
    assert [p.name for p in checkpoint.checkpoints(work)] == ["step_000003", "step_000004"]
    assert json.loads((work / "checkpoints" / "step_000004" / "meta.json").read_text())[
        "images_seen"] == 4 * 48


def test_a_checkpoint_of_the_first_format_loads_weights_but_does_not_resume(
        tmp_path, synthetic, trained):
    """Before checksums, meta.json listed no files and the optimizer state was a pickle."""
    work = copy_of(trained, tmp_path)
    old = work / "checkpoints" / "step_000004"
    meta = json.loads((old / "meta.json").read_text())
    del meta["files"]
    (old / "meta.json").write_text(json.dumps(meta))
    (old / "backbone_optimizer.npz").unlink()
    (old / "trainer.states").write_bytes(pickle.dumps(CreatesAFile(tmp_path / "pwned")))
    resumed, _ = resume_one_step(tmp_path, synthetic, old, resume_from=old)
    assert resumed.returncode == 1 and "meta.json is damaged or from an older version" in \
        resumed.stdout and "can be used with --load-from" in resumed.stdout
    config = config_file(tmp_path, synthetic, name="load.py", max_steps=1)
    loaded = run(train_args(config, tmp_path / "loaded", "--load-from", str(old)))
    assert loaded.returncode == 0, loaded.stdout[-3000:]
    assert f"loaded the weights of {old}" in loaded.stdout
    assert not (tmp_path / "pwned").exists()


def test_a_resume_that_changes_the_center_update_says_so(tmp_path, synthetic, trained):
    """Checkpoints hold current rows, so another rule may continue; the log says it, and
    for a checkpoint of before the rule was recorded, what the default was then."""
    work = copy_of(trained, tmp_path)
    saved = work / "checkpoints" / "step_000004"
    meta = json.loads((saved / "meta.json").read_text())
    assert meta["center_update"] == "exact"  # "auto" with SGD's centers
    same, log = resume_one_step(tmp_path, synthetic, work)
    assert same.returncode == 0 and "center_update" not in log["text"]
    other, log = resume_one_step(tmp_path, synthetic, work, center_update="lazy")
    assert other.returncode == 0, other.stdout[-3000:]
    assert (f"{saved} was trained with center_update='exact'; this run continues with "
            "center_update='lazy'") in log["text"]
    del meta["center_update"]
    (saved / "meta.json").write_text(json.dumps(meta))
    older, log = resume_one_step(tmp_path, synthetic, work)
    assert older.returncode == 0, older.stdout[-3000:]
    assert ("was saved before the update rule was recorded (the default then: 'lazy'); this "
            "run continues with center_update='exact'") in log["text"]


def test_a_resume_keeps_the_centers_optimizer_and_reads_the_second_format_as_sgd(
        tmp_path, synthetic, trained):
    """The states saved are those of one optimizer: resuming with another one would
    train something else than was asked. --load-from starts the new one afresh.
    meta.json of the second format names no center optimizer: its states are SGD's."""
    work = copy_of(trained, tmp_path)
    saved = work / "checkpoints" / "step_000004"
    meta = json.loads((saved / "meta.json").read_text())
    assert (meta["center_optimizer"], meta["center_states"]) == ("sgd", ["mom"])
    other, _ = resume_one_step(tmp_path, synthetic, work, center_optimizer="adamw")
    assert other.returncode == 1
    assert (f"{saved} was trained with center_optimizer='sgd'; this run has "
            "center_optimizer='adamw'") in other.stdout and "--load-from" in other.stdout
    config = config_file(tmp_path, synthetic, name="load.py", max_steps=1,
                         center_optimizer="adamw")
    loaded = run(train_args(config, tmp_path / "loaded", "--load-from", str(saved)))
    assert loaded.returncode == 0, loaded.stdout[-3000:]
    del meta["center_optimizer"], meta["center_states"]
    meta["format"] = 2
    (saved / "meta.json").write_text(json.dumps(meta))
    resumed, log = resume_one_step(tmp_path, synthetic, work)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert sorted(log["losses"]) == [5, 6, 7, 8]  # 2 steps of 48 images, on 1 process


@pytest.mark.parametrize("field, value, problem", [
    ("center_states", ["../../outside"], "is not a plain file or state name"),
    ("center_states", None, "damaged or from an older version"),
    ("files", {"/etc/passwd": {"bytes": 1, "crc32": 0}}, "is not a plain file or state name"),
    ("format", 99, "was written by a newer version of partial_fc_mx (format 99"),
])
def test_a_crafted_meta_json_names_no_file_outside_and_is_skipped(tmp_path, trained, field,
                                                                 value, problem):
    work = copy_of(trained, tmp_path)
    saved = work / "checkpoints" / "step_000004"
    meta = json.loads((saved / "meta.json").read_text())
    meta[field] = value
    (saved / "meta.json").write_text(json.dumps(meta))
    problems = checkpoint.verify(saved)
    assert len(problems) == 1 and problem in problems[0], problems


def test_a_resume_needs_the_states_its_optimizer_keeps(tmp_path, synthetic, trained):
    """An SGD checkpoint whose meta.json lists no momentum would resume with the
    momentum silently zeroed: refused, on every rank (printed once), naming the states."""
    work = copy_of(trained, tmp_path)
    saved = work / "checkpoints" / "step_000004"
    meta = json.loads((saved / "meta.json").read_text())
    meta["center_states"] = []
    (saved / "meta.json").write_text(json.dumps(meta))
    result = mpirun(2, train_args(config_file(tmp_path, synthetic, max_steps=6),
                                  tmp_path / "resumed", "--resume-from", str(saved)),
                    timeout=300)
    assert result.returncode != 0
    message = f"{saved} holds the center states []; sgd keeps ['mom']"
    assert result.stdout.count(f"error: {message}") == 1, result.stdout[-3000:]


def test_a_new_run_moves_an_earlier_runs_checkpoints_aside(tmp_path, synthetic, trained):
    work = copy_of(trained, tmp_path)
    config = config_file(tmp_path, synthetic, name="again.py", max_steps=1, save_every=1)
    result = run(train_args(config, work), timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]
    aside = [p for p in work.iterdir() if p.name.startswith("checkpoints-before-")]
    assert len(aside) == 1 and f"moved them to {aside[0]}" in result.stdout
    assert sorted(p.name for p in aside[0].iterdir()) == ["step_000002", "step_000004"]
    assert [p.name for p in checkpoint.checkpoints(work)] == ["step_000001"]


def test_a_step_already_there_is_moved_aside_and_leftovers_of_killed_saves_go(tmp_path):
    root = tmp_path / "checkpoints"
    (root / "step_000005").mkdir(parents=True)
    (root / "step_000005" / "old").write_text("old")
    partial = root / ".step_000005.partial"
    partial.mkdir()
    (partial / "new").write_text("new")
    checkpoint.publish(partial, root / "step_000005")
    assert [p.name for p in (root / "step_000005").iterdir()] == ["new"]
    aside = [p for p in root.iterdir() if p.name.startswith("step_000005.replaced-")]
    assert len(aside) == 1 and (aside[0] / "old").read_text() == "old"
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["step_000005"]
    for leftover in (".step_000006.partial", ".step_000001.deleting"):
        (root / leftover).mkdir()
    checkpoint.remove_stale(root)
    assert sorted(p.name for p in root.iterdir()) == sorted(["step_000005", aside[0].name])


# ----- kill -9 during a save -----
CRASH_LOOPS = int(os.environ.get("PFC_CRASH_LOOPS", "2"))
"""Kills in the CI run (one rank, then the whole job);
`PFC_CRASH_LOOPS=20 pytest tests/test_checkpoint.py -k kill` for the full loop
(docs/tests.md)."""


def wait_for_a_save_in_progress(work: Path, deadline: float) -> Path | None:
    """The partial folder of a save under way after at least one checkpoint is
    complete, once there is one; None at the deadline."""
    root = work / "checkpoints"
    while time.time() < deadline:
        if checkpoint.checkpoints(work):  # first: the partial folder may be the first save's
            partial = list(root.glob(".step_*.partial"))
            if partial and partial[0].is_dir():
                return partial[0]
        time.sleep(0.01)
    return None


def test_kill_9_during_saves_always_leaves_a_checkpoint_that_verifies_and_resumes(tmp_path):
    """Random (not image) data with 200,000 classes, so every save writes 100 MB of
    centers; a save every step. One rank, or the whole job, is killed at a random
    moment of a save; every checkpoint left must verify and the newest must resume. The
    first kill follows the save's partial folder at once, so at least one save is
    certainly cut off: the test asserts that it was, or it would not test its name."""
    rng = random.Random(0)
    cut_off = 0  # kills that left the save they followed unfinished (never published)
    config = config_file(tmp_path, "random", num_classes=200_000, num_image=1_000_000,
                         batch_size=8, sample_rate=0.05, save_every=1, keep_checkpoints=2,
                         num_epoch=1, val_targets=[])
    for attempt in range(CRASH_LOOPS):
        work = tmp_path / f"work{attempt}"
        job = start(mpirun_command(2, train_args(config, work)))
        try:
            partial = wait_for_a_save_in_progress(work, time.time() + 120)
            assert partial, "no save started"
            time.sleep(0 if attempt == 0 else rng.uniform(0, 0.3))
            if attempt % 2:
                kill_group(job)  # the whole job, launcher included
            else:
                os.kill(rng.choice(rank_pids(f"train {config} --work-dir {work}")),
                        signal.SIGKILL)
            finish(job, timeout=60)
        finally:
            kill_group(job)
        deadline = time.time() + 60  # killed processes may take a moment to be gone
        while rank_pids(f"train {config} --work-dir {work}") and time.time() < deadline:
            time.sleep(0.1)
        saved = checkpoint.checkpoints(work)
        published = partial.parent / partial.name.removeprefix(".").removesuffix(".partial")
        cut_off += partial.is_dir() and published not in saved
        assert saved, f"attempt {attempt}: no checkpoint left"
        for path in saved:
            assert checkpoint.verify(path) == [], f"attempt {attempt}: {path} is damaged"
        more = config_file(tmp_path, "random", name="more.py", num_classes=200_000,
                           num_image=1_000_000, batch_size=8, sample_rate=0.05,
                           max_steps=checkpoint.step_of(saved[-1]) + 1, val_targets=[])
        resumed = run(train_args(more, work, "--resume-from", str(work)), timeout=300)
        assert resumed.returncode == 0, resumed.stdout[-3000:]
        assert f"resuming from {saved[-1]}" in resumed.stdout
        assert logged(work)["steps"][-1]["step"] == checkpoint.step_of(saved[-1]) + 2
        assert not list((work / "checkpoints").glob(".step_*")), "a stale partial save is left"
    print(f"{cut_off} of {CRASH_LOOPS} kills cut a save off before its rename")
    assert cut_off >= 1, "no kill landed in the middle of a save"


def test_center_blocks_are_saved_as_one_npy_of_their_rows(tmp_path):
    """A shard stored in blocks is written as np.save writes the joined rows (a
    resume at any world size reads it as before), a part at a time."""
    import io

    import mxnet as mx

    from partial_fc_mx.run.checkpoint import JoinedRows, save_rows

    rng = np.random.default_rng(0)
    whole = rng.normal(size=(23, 5)).astype(np.float16)
    blocks = [mx.nd.array(whole[a:b], dtype="float16") for a, b in ((0, 7), (7, 14), (14, 23))]
    written, expected = io.BytesIO(), io.BytesIO()
    save_rows(written, blocks)
    np.save(expected, whole)
    assert written.getvalue() == expected.getvalue()
    joined = JoinedRows([whole[:4], whole[4:9], whole[9:]])
    assert joined.shape == (23, 5)
    for rows in (slice(0, 23), slice(3, 12), slice(9, 9), slice(20, 40)):
        assert np.asarray(joined[rows]).tobytes() == whole[rows].tobytes(), rows
    assert np.asarray(joined[3:12][2:5]).tobytes() == whole[5:8].tobytes()  # views of views
    assert isinstance(joined[3:12].parts[0], np.ndarray) and joined[3:12].shape == (9, 5)
