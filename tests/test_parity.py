"""The parity harness (docs/parity.md) on a few steps: the data both toolkits train on,
the order they read it in, the one evaluator, and our arm training for real under
mpirun. arcface_torch's arm needs torch and an insightface checkout: it is a
documented command (docs/parity.md), not a test."""

from __future__ import annotations

import json
import math
import re
import shlex
import sys
import time
from argparse import Namespace
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, kill_group, mpirun, mpirun_command, run, start

from partial_fc_mx.data.loader import FaceLoader
from partial_fc_mx.data.network_input import to_network_input
from partial_fc_mx.data.transforms import decode_face
from partial_fc_mx.errors import UserError
from partial_fc_mx.parity import center_trace, resume
from partial_fc_mx.parity.__main__ import (
    ARMS,
    EVALUATION_PATIENCE_S,
    Result,
    begin_or_go_on,
    difference,
    launch,
    plot,
    run_arm,
    same_recipe,
    scored,
    table,
)
from partial_fc_mx.parity.ours_resume import (
    PACKAGE,
    code_digest,
    loaded_code,
    progress_file,
    read_progress,
    trained_by,
)
from partial_fc_mx.parity.recipe import (
    Recipe,
    check_network,
    command_line,
    evaluation_steps,
    parse,
    write_log,
)
from partial_fc_mx.parity.scoring import all_pairs, score
from partial_fc_mx.parity.task import FAMILY, Task, as_input, load_task, rank_rows, write_task
from partial_fc_mx.prep.synthetic import identity_images

SMALL = Task(classes=60, per_class=4, heldout=40, heldout_per_class=3, pairs=60)
IMAGES = Task(classes=10, per_class=2, heldout=10, heldout_per_class=2, pairs=10,
              kind="images", shared=0.5, kin=0.5)


@pytest.fixture(scope="module")
def small_task(tmp_path_factory) -> Path:
    return write_task(SMALL, tmp_path_factory.mktemp("parity"))


@pytest.fixture(scope="module")
def images_task(tmp_path_factory) -> Path:
    return write_task(IMAGES, tmp_path_factory.mktemp("parity-images"))


def test_the_images_task_holds_the_look_alike_faces_as_our_loader_decodes_them(
        images_task, tmp_path):
    data = load_task(images_task)
    assert images_task.name == "images10x2-shared0.5-kin0.5-heldout10x2-seed0"
    assert data["train_x"].shape == (20, 112, 112, 3) and data["train_x"].dtype == np.uint8
    np.testing.assert_array_equal(data["train_y"], np.arange(10).repeat(2))
    np.testing.assert_array_equal(data["heldout_y"], np.arange(10).repeat(2))
    fourth = [decode_face(jpeg)[0] for jpeg in identity_images(0, 3, 2, IMAGES.shared,
                                                             IMAGES.kin, FAMILY)]
    np.testing.assert_array_equal(data["train_x"][6:8], np.stack(fourth))
    first_heldout = [decode_face(jpeg)[0] for jpeg in identity_images(0, 10, 2, IMAGES.shared,
                                                                    IMAGES.kin, FAMILY)]
    np.testing.assert_array_equal(data["heldout_x"][:2], np.stack(first_heldout))
    again = load_task(write_task(IMAGES, tmp_path))  # from the seed alone
    np.testing.assert_array_equal(again["train_x"], data["train_x"])


def test_both_arms_read_the_inputs_our_trainer_reads(images_task, small_task):
    images = np.asarray(load_task(images_task)["train_x"][:3])
    batch = as_input(images)
    np.testing.assert_array_equal(batch, to_network_input(images))  # our loader's
    assert batch.shape == (3, 3, 112, 112) and batch.dtype == np.float32
    np.testing.assert_allclose(batch[1, :, 5, 7], (images[1, 5, 7] - 127.5) / 128)
    assert batch.flags.c_contiguous  # else torch computes channels-last
    vectors = load_task(small_task)["train_x"][:3]
    copy = as_input(vectors)
    assert copy.flags.writeable and np.array_equal(copy, vectors)  # torch takes it as is


def test_the_torch_arm_imports_neither_mxnet_nor_opencv():
    """arcface_torch's environment has torch and numpy only."""
    done = run([sys.executable, "-c", "import sys; sys.modules['mxnet'] = None; "
                "sys.modules['cv2'] = None; import partial_fc_mx.parity.anchor"])
    assert done.returncode == 0, done.stdout


def test_the_study_gives_each_task_its_recipe():
    from argparse import Namespace

    from partial_fc_mx.parity.__main__ import (
        ARMS,
        IMAGES_HELDOUT,
        IMAGES_KIN,
        IMAGES_SHARED,
        arm_recipe,
        recipe_changes,
        task_of,
    )

    latent = Namespace(kind="latent", epochs=None, network="mbf")
    assert recipe_changes(latent) == {"epochs": Recipe.epochs}
    assert task_of("latent", 3000, 8, 1) == Task(3000, 8, seed=1)
    images = Namespace(kind="images", epochs=None, network="r18")
    changes = recipe_changes(images)
    assert changes["network"] == "r18" and changes["embedding_size"] == 512
    assert changes["prelu"] == "kernel" and "prelu" not in recipe_changes(latent)
    base = Recipe(Path("/t"), Path("/o"))
    for name in ("ours-exact-prelu-kernel", "ours-exact", "arcface_torch"):
        made = arm_recipe(ARMS[name], base, 1, 0.1, images)
        assert (made.seed, made.sample_rate, made.network) == (1, 0.1, "r18")
    assert arm_recipe(ARMS["ours-exact-prelu-kernel"], base, 0, 1.0, latent).prelu == "kernel"
    assert arm_recipe(ARMS["ours-exact"], base, 0, 1.0, latent).prelu == "mxnet"
    assert recipe_changes(Namespace(kind="images", epochs=2, network="mbf"))["epochs"] == 2
    assert task_of("images", 3000, 8, 0).heldout == IMAGES_HELDOUT
    images_task = task_of("images", 3000, 8, 0)
    assert (images_task.shared, images_task.kin) == (IMAGES_SHARED, IMAGES_KIN)
    assert "shared" not in task_of("latent", 3000, 8, 0).name  # its runs keep their folders
    for other in (replace(images_task, shared=0.7), replace(images_task, kin=0.5)):
        assert other.name != images_task.name
    with pytest.raises(SystemExit, match="task kind 'video'"):
        write_task(Task(10, kind="video"), Path("/nonexistent"))
    for wrong, field in ((Task(10, kind="images", shared=1.0), "shared"),
                         (Task(10, shared=0.8), "shared"), (Task(10, kin=0.5), "kin"),
                         (Task(10, kind="images", kin=-0.1), "kin")):
        with pytest.raises(SystemExit, match=f"{field}={getattr(wrong, field)}: the fraction"):
            write_task(wrong, Path("/nonexistent"))


def test_a_network_that_cannot_read_the_task_is_refused(images_task, small_task):
    check_network(Recipe(images_task, Path("/o"), network="mbf"), 4)
    check_network(Recipe(small_task, Path("/o")), 2)
    with pytest.raises(SystemExit, match="--network mlp trains on the scale"):
        check_network(Recipe(images_task, Path("/o")), 4)
    with pytest.raises(SystemExit, match="--network r18 trains on an images task"):
        check_network(Recipe(small_task, Path("/o"), network="r18"), 2)


def test_pairs_of_another_draw_are_drawn_again_and_their_scores_too(small_task, tmp_path):
    """A task made before the pair draw changed keeps its data and gets new pairs; the
    scores kept for the old pairs are not reused."""
    import json
    import shutil

    task = tmp_path / small_task.name
    shutil.copytree(small_task, task)
    made = json.loads((task / "task.json").read_text())
    np.save(task / "pairs.npy", np.zeros((120, 2), np.int64))
    (task / "task.json").write_text(json.dumps({**made, "pairs_version": 1}))
    out = tmp_path / "run"
    out.mkdir()
    np.save(out / "embeddings-000004.npy", load_task(task)["heldout_x"])
    recipe = Recipe(task, out)
    (out / "scores.json").write_text(json.dumps({"pairs": "old", "scores": {
        "embeddings-000004.npy": [0.5, 0.0, [0.0, 0.0]]}}))
    assert write_task(SMALL, tmp_path) == task
    again = load_task(task)
    np.testing.assert_array_equal(again["pairs"], load_task(small_task)["pairs"])
    np.testing.assert_array_equal(again["train_x"], load_task(small_task)["train_x"])
    [(step, fresh)] = scored(recipe)
    assert step == 4 and fresh.accuracy != 0.5


def test_a_family_never_spans_training_and_held_out_identities(tmp_path):
    with pytest.raises(SystemExit, match="multiples of 10"):
        write_task(Task(classes=65), tmp_path)


def test_the_task_is_made_again_from_its_seed_alone(small_task, tmp_path):
    again = write_task(SMALL, tmp_path)
    other = write_task(Task(**{**vars(SMALL), "seed": 1}), tmp_path)
    first, second, third = load_task(small_task), load_task(again), load_task(other)
    for name, array in first.items():
        np.testing.assert_array_equal(array, second[name], err_msg=name)
    assert not np.array_equal(first["train_x"], third["train_x"])
    assert first["train_x"].shape == (60 * 4, 64) and first["train_x"].dtype == np.float32
    np.testing.assert_array_equal(first["train_y"], np.arange(60).repeat(4))
    assert first["heldout_x"].shape == (40 * 3, 64)


def test_the_pairs_are_what_they_say_and_both_kinds_fill_every_fold(small_task):
    data = load_task(small_task)
    labels, pairs, issame = data["heldout_y"], data["pairs"], data["issame"]
    assert issame.sum() == (~issame).sum() == 60
    np.testing.assert_array_equal(labels[pairs[:, 0]] == labels[pairs[:, 1]], issame)
    assert (pairs[:, 0] != pairs[:, 1]).all()  # a genuine pair is two samples
    impostors = labels[pairs[~issame]]
    same_family = impostors[:, 0] // FAMILY == impostors[:, 1] // FAMILY
    assert 30 <= same_family.sum() < 45  # half, and some of the others by chance (4 families)
    mates = impostors[same_family]
    assert set(mates[:, 1] % FAMILY) == set(range(FAMILY))  # any member, the first too
    for fold in np.array_split(issame, 10):
        assert fold.any() and not fold.all()


class Positions:
    """A dataset whose record id is the position in its order: what FaceLoader reads."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def record_ids(self, order: np.ndarray) -> np.ndarray:
        return order


@pytest.mark.parametrize("world", [1, 2, 3])
def test_both_arms_read_the_samples_in_our_loaders_order(world):
    for epoch in (0, 3):
        loader = FaceLoader(Positions(1000), 16, rank=0, world_size=world, seed=5)
        for rank in range(world):
            loader.rank = rank
            np.testing.assert_array_equal(rank_rows(1000, 16 * world, 5, epoch, rank, world),
                                          loader.record_ids(epoch))


def test_all_pairs_and_the_scores_of_perfect_and_useless_embeddings():
    rng = np.random.default_rng(0)
    labels = np.arange(30).repeat(4)
    embeddings = rng.standard_normal((120, 8)).astype(np.float32)
    similarity, same = all_pairs(embeddings, labels)
    unit = embeddings / np.linalg.norm(embeddings, axis=1, keepdims=True)
    i, j = np.triu_indices(120, 1)
    np.testing.assert_allclose(similarity, (unit[i] * unit[j]).sum(1), atol=1e-6)
    np.testing.assert_array_equal(same, labels[i] == labels[j])
    pairs = np.stack([i, j], 1)[::7]
    issame = labels[pairs[:, 0]] == labels[pairs[:, 1]]
    perfect = np.eye(30, dtype=np.float32)[labels] + 0.01 * embeddings[:, :1]
    assert score(perfect, labels, pairs, issame).accuracy == 1.0
    useless = score(embeddings, labels, pairs, issame)
    assert useless.accuracy < 0.97  # chance: the share of impostor pairs
    assert useless.tar[1e-3] < 0.2
    assert np.isnan(score(embeddings * np.nan, labels, pairs, issame).accuracy)


def test_a_recipe_survives_its_command_line():
    recipe = Recipe(Path("/t"), Path("/o"), seed=3, sample_rate=0.1, center_update="lazy",
                    power=1.0)
    assert parse(command_line(recipe), "x", "") == recipe
    with pytest.raises(SystemExit):  # a typo never runs the default silently
        parse([*command_line(recipe), "--seeding", "per_rank"], "x", "")
    assert evaluation_steps(930, 10)[-1] == 930 and len(evaluation_steps(930, 10)) == 10
    assert evaluation_steps(3, 10) == [1, 2, 3]


def result(accuracy: float, steps: tuple[int, ...] = (10,), seed: int = 0) -> Result:
    """A run of `seed` scored `accuracy` (and 0.1 less TAR at 1e-3) at each of `steps`."""
    from partial_fc_mx.parity.scoring import Score

    return Result(seed, [(step, Score(accuracy, 0.01, {1e-3: accuracy - 0.1, 1e-4: 0.5}))
                   for step in steps], 1.0, 5)


def test_the_table_gives_each_arm_mean_and_spread_and_the_difference_with_its_error():
    cells = {(3000, 0.1): {"ours-exact": [result(0.90), result(0.92, seed=1)],
                           "arcface_torch": [result(0.88), result(0.90, seed=1)]}}
    text = table(cells, ["ours-exact", "arcface_torch"])
    assert "| 3,000 | 0.1 | ours-exact | 2 | 0.9100 ± 0.0141 |" in text
    assert "| ours-exact − arcface_torch | 2 | +0.0200 ± 0.0141 (paired ± 0.0000) |" in text
    # the anchor's seed 1 not finished yet: the difference is seed 0's, said to be one
    half_run = table({(3000, 0.1): {"ours-exact": [result(0.92, seed=1), result(0.90)],
                                    "arcface_torch": [result(0.85)]}},
                     ["ours-exact", "arcface_torch"])
    assert "| ours-exact − arcface_torch | 1 | +0.0500 (one seed) |" in half_run
    # listed in other orders, the seeds are still paired with each other
    reordered = table({(3000, 0.1): {"ours-exact": [result(0.92, seed=1), result(0.90)],
                                     "arcface_torch": [result(0.85), result(0.91, seed=1)]}},
                      ["ours-exact", "arcface_torch"])
    assert "| 2 | +0.0300 ± 0.0316 (paired ± 0.0200) |" in reordered
    assert difference([0.9], [0.8]) == "+0.1000 (one seed)"
    one_seed = table({(3000, 1.0): {"ours-exact": [result(0.90)]}}, ["ours-exact"])
    assert "| 3,000 | 1 | ours-exact | 1 | 0.9000 | 0.8000 | 0.5000 |" in one_seed  # no ± 0
    diverged = table({(3000, 1.0): {"ours-exact": [result(0.9), result(math.nan)]}},
                     ["ours-exact"])
    assert "| ours-exact | 2 | diverged | diverged |" in diverged
    cells[(3000, 0.1)]["ours-exact-power1"] = [result(0.95), result(0.95, seed=1)]
    cells[(3000, 0.1)]["arcface_torch-power1"] = [result(0.93), result(0.93, seed=1)]
    text = table(cells, ["ours-exact", "arcface_torch", "ours-exact-power1",
                         "arcface_torch-power1"])
    assert "| ours-exact-power1 − arcface_torch-power1 | 2 | +0.0200 ± 0.0000" in text
    assert "ours-exact-power1 − arcface_torch |" not in text  # not across powers


def test_each_task_draws_its_curves_into_a_figure_of_its_own(tmp_path):
    """Both tasks have a 3,000-identity cell: the images task's curves must not replace
    the scale task's figure that docs/parity.md shows."""
    cells = {(3000, 0.1): {"ours-exact": [result(0.9, steps=(10, 20))]}, (3000, 1.0): {}}
    plot(cells, ["ours-exact"], tmp_path, "latent")
    assert not (tmp_path / "c3000-r1.png").exists()  # nothing finished: no empty figure
    scale_figure = (tmp_path / "c3000-r0.1.png").read_bytes()
    plot(cells, ["ours-exact"], tmp_path, "images")
    assert (tmp_path / "images-c3000-r0.1.png").is_file()
    assert (tmp_path / "c3000-r0.1.png").read_bytes() == scale_figure


def test_our_arm_trains_for_real_and_its_embeddings_are_scored(small_task, tmp_path):
    out = tmp_path / "ours"
    recipe = Recipe(small_task, out, sample_rate=0.5, epochs=2, batch_size=16,
                    hidden=32, embedding_size=16, evaluations=2)
    done = mpirun(2, [sys.executable, "-m", "partial_fc_mx.parity.ours",
                      *command_line(recipe)], timeout=180)
    assert done.returncode == 0, done.stdout
    log = json.loads((out / "log.json").read_text())
    steps = (60 * 4 // 32) * 2
    assert log["steps"] == steps and log["toolkit"] == "ours"
    assert all(np.isfinite(log["loss"])) and log["loss"][0] > 0
    assert sorted(p.name for p in out.glob("embeddings-*.npy")) == [
        f"embeddings-{steps // 2:06d}.npy", f"embeddings-{steps:06d}.npy"]
    first, last = scored(recipe)
    assert first[0] == steps // 2 and last[0] == steps
    assert 0.5 <= last[1].accuracy <= 1.0
    assert json.loads((out / "scores.json").read_text())  # kept: not scored twice


def test_a_recorded_dense_run_replays_to_its_own_rows_and_exact_keeps_them(
        small_task, tmp_path):
    """center_trace: the dense replay is the run's arithmetic again (0 difference), and
    the exact update fed the run's own gradients keeps its rows to rounding."""
    trace = tmp_path / "trace"
    recipe = Recipe(small_task, tmp_path / "ours", sample_rate=0.5, epochs=2,
                    batch_size=16, hidden=32, embedding_size=16, evaluations=2,
                    center_update="dense")
    done = mpirun(2, [sys.executable, "-m", "partial_fc_mx.parity.center_trace", "record",
                      str(trace), "--rows-every", "7", *command_line(recipe)], timeout=180)
    assert done.returncode == 0, done.stdout
    figures = list(center_trace.replay(trace))
    steps = (60 * 4 // 32) * 2
    assert [(row["shard"], row["step"]) for row in figures] == [
        (start, step) for start in (0, 30) for step in (7, steps)]
    for row in figures:
        assert row["dense weight"] == row["dense momentum"] == 0.0, row
        assert row["exact weight"] < 1e-5 and row["exact momentum"] < 1e-5, row


def test_a_trace_of_anything_but_a_fresh_dense_run_is_refused_on_every_rank(
        small_task, tmp_path):
    recipe = Recipe(small_task, tmp_path / "ours", epochs=1, batch_size=16, hidden=32,
                    embedding_size=16, center_update="exact")
    done = mpirun(2, [sys.executable, "-m", "partial_fc_mx.parity.center_trace", "record",
                      str(tmp_path / "trace"), *command_line(recipe)], timeout=120)
    assert done.returncode != 0
    assert "--center-update is exact: record a dense run" in done.stdout
    assert not (tmp_path / "trace").exists()
    (tmp_path / "ours").mkdir()
    (tmp_path / "ours" / "log.json").write_text("{}")
    done = mpirun(2, [sys.executable, "-m", "partial_fc_mx.parity.center_trace", "record",
                      str(tmp_path / "trace"),
                      *command_line(replace(recipe, center_update="dense"))], timeout=120)
    assert done.returncode != 0 and f"{tmp_path / 'ours'} is not empty" in done.stdout


def test_an_exact_run_brought_current_at_one_step_parts_from_its_plain_run_by_rounding(
        small_task, tmp_path):
    """center_trace current-at: the same steps up to the one named, after which every
    row takes the steps it missed at once; the same arithmetic, so the run ends where
    the plain one does up to rounding."""
    plain = Recipe(small_task, tmp_path / "plain", sample_rate=0.5, epochs=2,
                   batch_size=16, hidden=32, embedding_size=16, evaluations=1,
                   center_update="exact")
    rounded = replace(plain, out=tmp_path / "rounded")
    done = mpirun(2, [sys.executable, "-m", "partial_fc_mx.parity.ours",
                      *command_line(plain)], timeout=180)
    assert done.returncode == 0, done.stdout
    done = mpirun(2, [sys.executable, "-m", "partial_fc_mx.parity.center_trace",
                      "current-at", "3", *command_line(rounded)], timeout=180)
    assert done.returncode == 0, done.stdout
    assert sorted(re.findall(r"centers (\d+)-(\d+) brought current after step 3",
                             done.stdout)) == [("0", "29"), ("30", "59")]
    losses = [json.loads((recipe.out / "log.json").read_text())["loss"]  # every 10 steps
              for recipe in (plain, rounded)]
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-4)
    ends = [np.load(next(recipe.out.glob("embeddings-*.npy"))) for recipe in (plain, rounded)]
    np.testing.assert_allclose(ends[1], ends[0], rtol=1e-3, atol=1e-4)
    assert not np.array_equal(ends[1], ends[0])  # rounded otherwise: the hook ran
    done = mpirun(2, [sys.executable, "-m", "partial_fc_mx.parity.center_trace",
                      "current-at", "3", *command_line(replace(
                          plain, out=tmp_path / "dense", center_update="dense"))],
                  timeout=120)
    assert done.returncode != 0
    assert "--center-update is dense: this changes the rounding of an exact run" in done.stdout
    assert not (tmp_path / "dense").exists()
    done = mpirun(2, [sys.executable, "-m", "partial_fc_mx.parity.center_trace",
                      "current-at", "15", *command_line(replace(plain,
                                                                out=tmp_path / "late"))],
                  timeout=120)
    assert done.returncode != 0
    assert "step 15 is beyond this run's last, 14" in done.stdout, done.stdout
    assert not (tmp_path / "late").exists()
    with pytest.raises(SystemExit):  # before any process starts training
        center_trace.main(["current-at", "0", *command_line(plain)])


def test_every_rank_of_our_arm_waits_out_rank_0s_evaluation_before_a_stall_warning(
        small_task, tmp_path):
    """The launcher's own processes, with the arm swapped for a print of the setting."""
    command = launch(ARMS["ours-exact"], Recipe(small_task, tmp_path), 2, Namespace())
    ranks = [*command[:command.index(sys.executable)], sys.executable, "-c",
             "import os; os.write(1, b'patience %s\\n' % "  # one write: lines stay whole
             "os.environb[b'HOROVOD_STALL_CHECK_TIME_SECONDS'])"]
    done = run(ranks, timeout=60, env={"HOROVOD_STALL_CHECK_TIME_SECONDS": "60",  # not ours
                                       "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout
    assert done.stdout.split().count("patience") == 2
    assert set(re.findall(r"patience (\d+)", done.stdout)) == {str(EVALUATION_PATIENCE_S)}
    assert EVALUATION_PATIENCE_S >= 5 * 60  # rank 0 embeds the held-out set for minutes


def test_our_arm_killed_mid_run_goes_on_from_its_last_checkpoint_as_if_never_stopped(
        small_task, tmp_path):
    """SIGKILLed (every process) right after its first checkpoint, the arm started again
    on its folder ends as a run never stopped: the same embeddings at every evaluation
    and the same losses, bit for bit (both bring every center row current at each save;
    sample_rate 0.5, so the sampler's stream must go on where it stood). Started first
    without the checkpoint's progress file, then on another number of processes, it
    refuses the checkpoint."""
    def recipe(name: str) -> Recipe:
        return Recipe(small_task, tmp_path / name, sample_rate=0.5, epochs=50, batch_size=16,
                      hidden=32, embedding_size=16, evaluations=3)  # 7 steps an epoch

    def arm(out: str, processes: int = 2) -> list[str]:
        return mpirun_command(processes, [sys.executable, "-m", "partial_fc_mx.parity.ours",
                                          *command_line(recipe(out))])

    straight = run(arm("straight"), timeout=300)
    assert straight.returncode == 0, straight.stdout[-3000:]
    saves = resume.ours_folder(tmp_path / "killed") / "checkpoints"
    job = start(arm("killed"), None, REPO)
    while not (saves / "step_000117" / "meta.json").is_file() and job.poll() is None:
        time.sleep(0.01)
    kill_group(job)
    job.wait()
    job.output.close()
    assert not (tmp_path / "killed" / "log.json").is_file(), "it finished before the kill"
    step = max(int(path.name.split("_")[1]) for path in saves.glob("step_*"))
    assert step in (117, 233), step  # both mid-epoch; 233 if the poll was slow
    progress = resume.ours_folder(tmp_path / "killed") / f"progress-{step:06d}.json"
    progress.rename(progress.with_suffix(".away"))  # a checkpoint without its progress
    lost = run(arm("killed"), timeout=300)
    assert lost.returncode != 0
    assert f"cannot go on from {progress}: it does not load (FileNotFoundError" in lost.stdout
    progress.with_suffix(".away").rename(progress)
    other = run(arm("killed", processes=1), timeout=300)  # another global batch: refused
    assert other.returncode != 0
    assert "it was trained by another number of processes" in other.stdout, other.stdout[-3000:]
    again = run(arm("killed"), timeout=300)
    assert again.returncode == 0, again.stdout[-3000:]
    assert f"going on from step {step}" in again.stdout
    logs = [json.loads((tmp_path / name / "log.json").read_text())
            for name in ("straight", "killed")]
    assert logs[1]["resumed_at"] == [step] and logs[0]["resumed_at"] == []
    assert logs[1]["loss"] == logs[0]["loss"] and len(logs[0]["loss"]) == 35
    for step in (117, 233, 350):
        name = f"embeddings-{step:06d}.npy"
        assert np.array_equal(np.load(tmp_path / "killed" / name),
                              np.load(tmp_path / "straight" / name)), name
    assert not resume.ours_folder(tmp_path / "killed").exists()  # a finished run keeps none


def test_our_arm_goes_on_only_from_a_checkpoint_its_recipe_processes_and_code_trained(
        tmp_path):
    """The progress saved beside a checkpoint names what trained it (not its folder):
    another recipe, number of processes or code, or a damaged file, stops the arm with
    the file and the fix."""
    recipe = Recipe(Path("/t"), tmp_path / "run", sample_rate=0.1)
    trained = trained_by(recipe, 2)
    path = progress_file(tmp_path, 2)

    def saved(**changes) -> Path:
        path.write_text(json.dumps({"losses": [2.0, 1.0], "seconds": [0.1, 0.1], "wall": 1.0,
                                    "resumed_at": [], "trained_by": trained} | changes))
        return path

    moved = replace(recipe, out=Path("/moved"))
    assert read_progress(saved(), 2, moved, trained)["losses"] == [2.0, 1.0]
    refused = [("another recipe", saved, replace(recipe, sample_rate=1.0), trained),
               ("another number of processes", saved, recipe, trained_by(recipe, 3)),
               ("another code", lambda: saved(trained_by=trained | {"code": "0" * 64}),
                recipe, trained),
               ("it holds 1 losses for 2 steps", lambda: saved(losses=[2.0]), recipe, trained),
               ("it lacks some of", lambda: path.write_text("{}"), recipe, trained),
               ("it lacks some of", lambda: saved(trained_by=None), recipe, trained),
               ("it does not load", lambda: path.write_text('{"losses": [2.0], "rec'),
                recipe, trained)]
    for problem, write, run_recipe, run_trained in refused:
        write()
        with pytest.raises(UserError, match=re.escape(problem)) as refusal:
            read_progress(path, 2, run_recipe, run_trained)
        assert f"cannot go on from {path}" in str(refusal.value)
        assert f"remove {tmp_path} to train this run from the beginning" in str(refusal.value)


def test_the_code_a_checkpoint_names_is_what_the_process_runs(tmp_path):
    """The hash covers every file given, by path and bytes; the files are this
    package's imported modules (ours.py among them) and the kernels' sources."""
    files = [tmp_path / "a.py", tmp_path / "b.cc"]
    for path in files:
        path.write_text("x = 1\n")
    before = code_digest(files, tmp_path)
    assert code_digest(files[::-1], tmp_path) == before
    files[1].write_text("x = 2\n")
    assert code_digest(files, tmp_path) != before
    files[1].rename(tmp_path / "c.cc")
    assert code_digest([files[0], tmp_path / "c.cc"], tmp_path) != code_digest(files[:1],
                                                                                tmp_path)
    import partial_fc_mx.parity.ours  # noqa: F401  (the arm's process has)
    loaded = {str(path.relative_to(PACKAGE)) for path in loaded_code()}
    assert {"parity/ours.py", "train.py", "pfc/kernels/rows.cc", "pfc/kernels/prelu.cc",
            "pfc/kernels/common.h"} <= loaded
    assert not {path for path in loaded if "__pycache__" in path or path.endswith(".pyc")}


def test_our_arm_trains_a_backbone_on_the_images_task(images_task, tmp_path):
    out = tmp_path / "ours"
    recipe = Recipe(images_task, out, sample_rate=0.5, epochs=1, batch_size=3,
                    embedding_size=512, evaluations=1, network="mbf")  # evaluated 3+3+...+2
    done = mpirun(2, [sys.executable, "-m", "partial_fc_mx.parity.ours",
                      *command_line(recipe)], timeout=300)
    assert done.returncode == 0, done.stdout
    log = json.loads((out / "log.json").read_text())
    assert log["steps"] == 20 // 6 and all(np.isfinite(log["loss"]))
    embeddings = np.load(out / "embeddings-000003.npy")
    assert embeddings.shape == (20, 512) and np.isfinite(embeddings).all()


def test_a_finished_run_is_reused_only_for_its_own_recipe():
    recipe = Recipe(Path("/t"), Path("/o"), sample_rate=0.1)
    saved = {k: str(v) for k, v in vars(recipe).items()}
    older = {k: v for k, v in saved.items() if k != "seeding"}  # logged before it existed
    assert same_recipe(saved, recipe) and same_recipe(older, recipe)
    assert not same_recipe(saved, Recipe(Path("/t"), Path("/o"), sample_rate=1.0))
    assert not same_recipe(older, Recipe(Path("/t"), Path("/o"), sample_rate=0.1,
                                         seeding="per-rank"))
    before_prelu = {k: v for k, v in saved.items() if k != "prelu"}  # trained LeakyReLU's
    assert same_recipe(before_prelu, recipe)
    assert not same_recipe(before_prelu, Recipe(Path("/t"), Path("/o"), sample_rate=0.1,
                                                prelu="kernel"))


def test_an_interrupted_run_of_the_same_recipe_is_kept_and_any_other_emptied(tmp_path):
    recipe = Recipe(Path("/t"), tmp_path / "run", sample_rate=0.1)
    recipe.out.mkdir()
    (recipe.out / "embeddings-000093.npy").write_bytes(b"a run of before recipe.json")
    begin_or_go_on(recipe)
    assert [path.name for path in recipe.out.iterdir()] == ["recipe.json"]
    state = resume.state_file(recipe.out, 93, 0)
    state.write_bytes(b"state")
    ours = resume.ours_folder(recipe.out) / "checkpoints" / "step_000093"
    ours.mkdir(parents=True)
    begin_or_go_on(recipe)  # started again: goes on
    assert state.is_file() and ours.is_dir()
    begin_or_go_on(replace(recipe, seed=1))  # another recipe in the folder: from scratch
    assert not state.exists() and not resume.ours_folder(recipe.out).exists()
    assert json.loads((recipe.out / "recipe.json").read_text())["seed"] == "1"


def test_a_finished_run_found_with_its_state_files_is_scored_and_they_are_removed(
        small_task, tmp_path):
    """A run stopped between writing its log and removing its state files (each rank's
    whole training state: 100 MB at 100,000 identities) is finished: the study scores
    it and removes them."""
    recipe = Recipe(small_task, tmp_path / "run", sample_rate=0.1, embedding_size=16)
    recipe.out.mkdir()
    held_out = SMALL.heldout * SMALL.heldout_per_class
    np.save(recipe.out / "embeddings-000003.npy",
            np.random.default_rng(0).normal(size=(held_out, 16)).astype(np.float32))
    write_log(recipe, "arcface_torch", [1.0], [0.1], 60.0, 3)
    for rank in (0, 1):
        resume.state_file(recipe.out, 3, rank).write_bytes(b"state")
    result = run_arm(ARMS["arcface_torch"], recipe, Namespace(report=True))
    assert [step for step, _ in result.scores] == [3] and result.minutes == 1.0
    assert resume.saved(recipe.out) == {} and (recipe.out / "log.json").is_file()


def test_a_run_goes_on_from_the_latest_step_every_rank_saved(tmp_path):
    for step, rank in [(93, 0), (93, 1), (186, 0)]:  # rank 1 stopped before its 186
        resume.state_file(tmp_path, step, rank).write_bytes(b"state")
    (tmp_path / ".resume-000279-rank1.pt.partial").write_bytes(b"half")  # never renamed
    assert resume.latest_complete(tmp_path, world=2) == 93
    assert resume.latest_complete(tmp_path, world=1) == 186
    assert resume.latest_complete(tmp_path, world=3) == 0  # from the beginning
    resume.remove(tmp_path, rank=0, keep=93)  # rank 0 going on from 93
    assert resume.saved(tmp_path) == {93: {0, 1}}
    resume.state_file(tmp_path, 186, 0).write_bytes(b"state")
    resume.remove(tmp_path, rank=0, keep=186)  # rank 0 saved 186
    assert resume.saved(tmp_path) == {93: {1}, 186: {0}}
    resume.remove(tmp_path, rank=1)
    assert resume.saved(tmp_path) == {186: {0}}


@pytest.mark.parametrize("prelu", ["mxnet", "kernel"])
def test_our_arm_trains_the_prelu_its_recipe_names(prelu):
    """"kernel": the trainer's CPU graph (run/cpu_kernels.py); "mxnet": LeakyReLU's."""
    import mxnet as mx

    from partial_fc_mx.config import Config
    from partial_fc_mx.parity.ours import network

    recipe = Recipe(Path("/t"), Path("/o"), hidden=8, embedding_size=4, prelu=prelu)
    net, model = network(recipe, Config(), mx.cpu())
    graph = model(mx.sym.var("data"))
    ops = {node["op"] for node in json.loads(graph.tojson())["nodes"]}
    assert ("pfc_prelu" in ops) == (prelu == "kernel") == ("LeakyReLU" not in ops)
    assert (model is net) == (prelu == "mxnet")


def test_a_kernel_one_rank_cannot_build_stops_every_rank_with_its_message(small_task, tmp_path):
    """Rank 1 has no compiler and no built kernels (a host unlike the others): the arm's
    start-up fails on every rank together, rank 0 saying rank 1's reason, before any
    collective could leave it waiting."""
    recipe = Recipe(small_task, tmp_path / "ours", hidden=32, embedding_size=16, prelu="kernel")
    arm = shlex.join([sys.executable, "-m", "partial_fc_mx.parity.ours", *command_line(recipe)])
    unlike = shlex.join(["export", f"CXX={tmp_path / 'no-compiler'}",
                         f"PARTIAL_FC_MX_KERNELS={tmp_path / 'kernels'}"])
    # Each rank's stderr goes to its own file: mpirun's --tag-output tags chunks, not
    # lines, so two ranks' tracebacks interleave mid-line there.
    said = tmp_path / "said-by-rank"
    script = (f'[ "$OMPI_COMM_WORLD_RANK" = 1 ] && {unlike}; '
              f'exec {arm} 2> {shlex.quote(str(said))}-"$OMPI_COMM_WORLD_RANK"')
    done = mpirun(2, ["bash", "-c", script], timeout=300)
    assert done.returncode != 0, done.stdout[-3000:]
    by_rank = [Path(f"{said}-{rank}") for rank in (0, 1)]
    texts = [path.read_text() if path.is_file() else "<nothing>" for path in by_rank]
    for rank, text in enumerate(texts):  # rank 0 says rank 1's reason, as rank 1 does
        assert "rank 1: partial_fc_mx's CPU kernels need a C++ compiler" in text, \
            f"rank {rank} said:\n{text[-2000:]}\nmpirun said:\n{done.stdout[-2000:]}"
