"""The preflight, single-process and under both launchers, and its failure lines."""

from __future__ import annotations

import re
from pathlib import Path

import mxnet as mx
import numpy as np
import pytest
from conftest import REPO, horovodrun_gloo, mpirun, python_module, run, slurm_job

from partial_fc_mx.data.transforms import encode_jpeg
from partial_fc_mx.prep.pack import write_records


def write_dataset(directory: Path, num_classes: int, per_class: int = 2) -> Path:
    """A small real dataset written by the packer (random 112 x 112 JPEGs)."""
    rng = np.random.default_rng(0)
    samples = ((label, encode_jpeg(rng.integers(0, 255, (112, 112, 3), dtype=np.uint8)))
               for label in range(num_classes) for _ in range(per_class))
    write_records(directory, samples, num_classes)
    return directory


def write_config(tmp_path: Path, rec: Path, num_classes: int, extra: str = "") -> Path:
    path = tmp_path / "cfg.py"
    path.write_text(f"rec = {str(rec)!r}\nnum_classes = {num_classes}\n"
                    f"embedding_size = 64\nbatch_size = 8\n{extra}")
    return path


@pytest.fixture
def dataset(tmp_path):
    return write_dataset(tmp_path / "data", num_classes=5)


def test_good_setup_passes_and_reports_the_build(tmp_path, dataset):
    result = run(python_module("check", str(write_config(tmp_path, dataset, 5))))
    assert result.returncode == 0, result.stdout
    out = result.stdout
    assert "OK: no problems found" in out
    assert f"MXNet {mx.__version__}" in out and "oneDNN yes" in out
    assert "Horovod 0.28.1: built with MXNet, MPI, Gloo" in out
    assert "MPI: Open MPI" in out
    assert "processes: 1 on 1 host(s)" in out and "device cpu(0)" in out
    assert re.search(r"free memory [\d.]+ GiB, the run needs about [\d.]+ GiB", out), out
    assert "backbone in float32: fp16=False" in out


def test_missing_dataset_names_the_file(tmp_path, dataset):
    (dataset / "train.idx").unlink()
    result = run(python_module("check", str(write_config(tmp_path, dataset, 5))))
    assert result.returncode == 1
    problem = [line for line in result.stdout.splitlines() if line.startswith("PROBLEM")]
    assert len(problem) == 1 and f"{dataset / 'train.idx'} is missing" in problem[0]
    missing_dir = run(python_module("check", str(write_config(tmp_path, tmp_path / "nowhere", 5))))
    assert missing_dir.returncode == 1
    assert f"dataset directory {tmp_path / 'nowhere'} does not exist" in missing_dir.stdout


def test_a_sample_rate_training_would_refuse_is_a_problem(tmp_path, dataset):
    config = write_config(tmp_path, dataset, 5, extra="sample_rate = 0.1\n")
    result = run(python_module("check", str(config)))
    assert result.returncode == 1, result.stdout
    assert "PROBLEM: rank 0" in result.stdout and "sample_rate=0.1 samples 0 of the 5" in \
        result.stdout and "Use sample_rate >= 0.2" in result.stdout


def test_bad_files_are_named(tmp_path, dataset):
    (dataset / "train.rec").write_bytes(b"not a record file")
    config = write_config(tmp_path, dataset, 5, extra="val_targets = ['lfw']\n")
    out = run(python_module("check", str(config))).stdout
    assert f"{dataset / 'train.rec'}: record 0 at byte 0 does not start with the RecordIO" in out
    assert f"verification set {dataset / 'lfw.bin'} is missing" in out
    assert "2 problem(s) found" in out


def test_property_disagreeing_with_the_config_is_named(tmp_path, dataset):
    (dataset / "property").write_text("7,112,112")
    out = run(python_module("check", str(write_config(tmp_path, dataset, 5)))).stdout
    assert f"{dataset / 'property'} says 7 classes but num_classes is 5" in out


def test_impossible_memory_is_refused_with_the_figures(tmp_path, dataset):
    config = write_config(tmp_path, dataset, 5)
    result = run(python_module("check", str(config), "num_classes=2000000000",
                               "embedding_size=512"))
    assert result.returncode == 1
    # 2e9 rows x (512 x 4 bytes x (weight + momentum) + the exact update's 8-byte step
    # count) = 7644.30 GiB on one process
    assert "this process needs about" in result.stdout
    assert "centers and their optimizer state 7644.30 GiB" in result.stdout
    fits = run(python_module("check", str(config), "num_classes=2000000000", "embedding_size=512",
                             "fp16_centers=True"))
    assert "centers and their optimizer state 3829.60 GiB" in fits.stdout
    # AdamW: float32 mean and variance and a float32 count per row: 2e9 x (512 x 12 + 4)
    adamw = run(python_module("check", str(config), "num_classes=2000000000",
                              "embedding_size=512", "center_optimizer=adamw"))
    assert "centers and their optimizer state 11451.54 GiB" in adamw.stdout


def test_bad_config_is_a_clear_error(tmp_path, dataset):
    result = run(python_module("check", str(write_config(tmp_path, dataset, 5)), "batchsize=3"))
    assert result.returncode == 2
    assert "unknown config key 'batchsize'" in result.stdout and "batch_size" in result.stdout


def test_mpirun_two_processes_are_reported_and_all_fail_together(tmp_path, dataset):
    config = str(write_config(tmp_path, dataset, 5))
    good = mpirun(2, python_module("check", config))
    assert good.returncode == 0, good.stdout
    assert "processes: 2 on 1 host(s)" in good.stdout and "launched by mpirun" in good.stdout
    assert "controller in use: MPI" in good.stdout
    assert "rank 0: host" in good.stdout and "rank 1: host" in good.stdout
    (dataset / "train.rec").unlink()
    bad = mpirun(2, python_module("check", config))
    assert bad.returncode != 0
    problems = [line for line in bad.stdout.splitlines() if line.startswith("PROBLEM")]
    assert len(problems) == 1, problems  # one line per problem, naming both ranks
    assert "rank 0 (" in problems[0] and "rank 1 (" in problems[0]
    assert f"{dataset / 'train.rec'} is missing" in problems[0]


def test_horovodrun_gloo_through_config_sh(tmp_path, dataset):
    """Launched from the user's folder: the config and its `rec` are relative to it."""
    write_config(tmp_path, Path(dataset.name), 5)
    config_sh = str(Path(__file__).resolve().parent.parent / "config.sh")
    result = horovodrun_gloo(3, ["bash", config_sh], cwd=tmp_path,
                             env={"CONFIG": "cfg.py", "PFC_COMMAND": "check"})
    assert result.returncode == 0, result.stdout
    assert "controller in use: Gloo" in result.stdout
    assert "processes: 3 on 1 host(s)" in result.stdout
    assert "launched by horovodrun" in result.stdout


def test_run_sh_says_why_its_preflight_stopped(tmp_path):
    """A preflight that prints PROBLEM lines is summed up by them; one that stops
    before (a config that does not exist) is not said to have found PROBLEM lines."""
    import os

    repo = Path(__file__).resolve().parent.parent
    broken = tmp_path / "broken.py"
    broken.write_text(f"rec = {str(tmp_path / 'no_data')!r}\nnum_classes = 2\n"
                      "network = 'tiny'\nbatch_size = 2\n")
    said = {}
    for config, expected in (("nowhere.py", "the preflight stopped before it could check "
                                            "everything"),
                             (str(broken), "the preflight found the PROBLEM lines above")):
        env = {**os.environ, "CONFIG": config, "NP": "1"}
        result = run(["bash", str(repo / "run.sh")], env=env, timeout=300, cwd=tmp_path)
        assert result.returncode == 1 and expected in result.stdout, result.stdout[-3000:]
        said[Path(config).name] = result.stdout
    assert "PROBLEM:" in said["broken.py"] and "PROBLEM:" not in said["nowhere.py"]
    # a relative CONFIG is looked for in the folder run.sh was started in
    assert f"looked for {tmp_path / 'nowhere.py'}" in said["nowhere.py"]


def test_slurm_script_finds_the_repository_when_submitted_from_elsewhere(tmp_path):
    """sbatch runs a copy of the script from Slurm's spool: submitted from the user's
    folder it must be told where the repository is, and says so; told, srun starts
    the repository's config.sh (a stub srun records what it was given)."""
    repo = Path(__file__).resolve().parent.parent
    env = slurm_job(tmp_path, nodes=("nodea",), per_node=1)
    script = str(repo / "setup-utils" / "slurm.sbatch")
    lost = run(["bash", script], env=env, cwd=tmp_path)
    assert lost.returncode == 2 and f"no config.sh in {tmp_path}" in lost.stdout
    told = run(["bash", script, "lr=0.2"], env={**env, "PFC_REPO": str(repo),
                                                "CONFIG": "mine.py"}, cwd=tmp_path)
    assert told.returncode == 0, told.stdout
    calls = (tmp_path / "srun.log").read_text().splitlines()
    launch = f"srun --mpi=pmix --kill-on-bad-exit=1 -N 1 -n 1 -w nodea bash {repo}/config.sh"
    assert calls == [f"{launch} lr=0.2 CONFIG=mine.py PFC_COMMAND=check",
                     f"{launch} lr=0.2 CONFIG=mine.py PFC_COMMAND="]


def test_kernels_that_cannot_be_built_are_a_problem_of_the_preflight(tmp_path):
    """Partial FC's CPU kernels are built on first use: a host without a compiler
    hears it from the preflight, not from its first training step."""
    env = {"CXX": str(tmp_path / "no-compiler"), "PARTIAL_FC_MX_KERNELS": str(tmp_path / "k")}
    result = run(python_module("check"), env=env)
    assert result.returncode == 1, result.stdout
    problems = [line for line in result.stdout.splitlines() if line.startswith("PROBLEM")]
    assert len(problems) == 1 and "need a C++ compiler: install g++" in problems[0], problems


def test_a_config_named_from_another_folder_is_the_repositorys_said_once(tmp_path, synthetic):
    """README's `CONFIG=configs/...` from a folder of one's own, under a launcher of 2:
    the repository's config is taken and said once; a config found nowhere is one error."""
    args = ["configs/orl.py", f"rec={synthetic}", "num_classes=120", "val_targets=[]"]
    result = mpirun(2, python_module("check", *args), cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]
    note = (f"config configs/orl.py is not in {tmp_path}: using the repository's "
            f"{REPO / 'configs' / 'orl.py'}")
    assert result.stdout.count(note) == 1, result.stdout[-3000:]
    missing = mpirun(2, python_module("check", "configs/nowhere.py"), cwd=tmp_path, timeout=300)
    assert missing.returncode == 2
    said = re.findall(r"^error: (.*)$", missing.stdout, flags=re.MULTILINE)
    assert len(said) == 1 and said[0].startswith(
        "config configs/nowhere.py: no such config file"), missing.stdout[-3000:]


def test_ranks_that_read_different_configs_are_stopped(tmp_path, synthetic):
    """Rank 0's folder holds its own configs/orl.py, rank 1's does not (folders that
    differ between hosts): rank 1 would take the repository's. One message, both files."""
    mine, other = tmp_path / "mine", tmp_path / "other"
    (mine / "configs").mkdir(parents=True)
    other.mkdir()
    (mine / "configs" / "orl.py").write_text("_base_ = 'orl.py'\nbatch_size = 4\n")
    args = python_module("train", "configs/orl.py", f"rec={synthetic}", "num_classes=120",
                         "val_targets=[]", "max_steps=1")
    result = run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-x", "PATH",
                  "-np", "1", "-wdir", str(mine), *args, ":",
                  "-np", "1", "-wdir", str(other), *args], timeout=300)
    assert result.returncode == 2, result.stdout[-3000:]
    said = re.findall(r"^error: (.*)$", result.stdout, flags=re.MULTILINE)
    assert len(said) == 1, result.stdout[-3000:]
    assert said[0].startswith("the ranks read different configs: rank(s) 0 (")
    assert f"{mine / 'configs' / 'orl.py'} (values " in said[0]
    assert "rank(s) 1 (" in said[0] and f"{REPO / 'configs' / 'orl.py'} (values " in said[0]
    assert not (mine / "work_dirs").exists() and not (other / "work_dirs").exists()
