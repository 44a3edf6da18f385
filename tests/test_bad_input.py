"""Bad values and bad files: one clear error naming the key, file or record, raised on
every rank of a 2-process job and printed once (by rank 0), and no hang (each run has
a time limit)."""

from __future__ import annotations

import pickle
import re
import shutil

import pytest
from conftest import config_file, damage_header, mpirun, python_module, run, train_args


def errors(output: str) -> list[str]:
    return re.findall(r"^error: (.*)$", output, flags=re.MULTILINE)


def assert_stopped_saying_once(result, message: str, code: int) -> None:
    """The job stopped with the error's exit code, the error printed once (by rank 0),
    and no rank died of anything else (no traceback)."""
    said = errors(result.stdout)
    assert result.returncode == code, result.stdout[-3000:]
    assert len(said) == 1, result.stdout[-3000:]
    assert message in said[0], said[0]
    assert "Traceback" not in result.stdout, result.stdout[-3000:]


@pytest.mark.parametrize("override, message", [
    ("verbose=0", "verbose must be > 0 (got 0)"),
    ("frequent=0", "frequent must be > 0 (got 0)"),
    ("scale=0", "margin_list/scale: margin (m1=1.0, m2=0.0, m3=0.35), scale=0.0: need"),
    ("scale=-64", "scale=-64.0: need m1 >= 1"),
    ("margin_list=(0.5,0.0,0.0)", "margin (m1=0.5, m2=0.0, m3=0.0), scale=32.0: need m1 >= 1"),
    ("margin_list=(1.0,4.0,0.0)", "0 <= m2 < pi"),
    ("max_steps=-1", "max_steps must be >= 0 (got -1)"),
    ("network='r999'", "network: unknown network 'r999'; choose one of mbf, mobilefacenet, r100"),
    ("lr=1e39", "lr=1e+39 is beyond float32"),
    ("lr_steps=[0]", "lr_steps=[0] must be positive step counts"),
])
def test_bad_values_are_refused_on_every_rank_before_training(tmp_path, synthetic, override,
                                                              message):
    config = config_file(tmp_path, synthetic)
    result = mpirun(2, train_args(config, tmp_path / "work", override), timeout=120)
    assert_stopped_saying_once(result, message, code=2)
    assert errors(result.stdout)[0].startswith("invalid config: ")
    assert not (tmp_path / "work").exists()


def test_a_sample_rate_that_samples_no_center_is_refused(tmp_path, synthetic):
    config = config_file(tmp_path, synthetic, sample_rate=0.01)
    result = mpirun(2, train_args(config, tmp_path / "work"), timeout=120)
    assert_stopped_saying_once(result, "sample_rate=0.01 samples 0 of the 60 class centers a "
                                   "process holds (120 classes / 2 processes)", code=1)


def test_sampled_centers_one_mxnet_array_cannot_hold_are_refused_before_allocation(
        tmp_path, synthetic):
    """9M classes over 2 processes, all scored (sample_rate 1): the 4.5M x 512 sampled
    rows are one array (the shard itself would be stored in blocks)."""
    config = config_file(tmp_path, synthetic, num_classes=9_000_000, embedding_size=512,
                         sample_rate=1.0)
    result = mpirun(2, train_args(config, tmp_path / "work"), timeout=120)
    assert_stopped_saying_once(result, "one process scores 4,500,000 of its 4,500,000 class "
                                   "centers per step", code=1)
    assert "use at least 3 processes" in errors(result.stdout)[0]


def test_a_record_with_a_damaged_header_is_named_on_every_rank(tmp_path, synthetic):
    data = tmp_path / "data"
    shutil.copytree(synthetic, data)
    damage_header(data, 300)
    config = config_file(tmp_path, data, num_epoch=1, val_targets=[])
    result = mpirun(2, train_args(config, tmp_path / "work"), timeout=180)
    assert_stopped_saying_once(result, f"{data / 'train.rec'}: record 300 has a damaged header "
                                   "(10 bytes", code=1)


@pytest.mark.parametrize("pairs", [0, 5])
def test_a_verification_set_with_too_few_pairs_stops_every_rank(tmp_path, synthetic, pairs):
    images, issame = pickle.loads((synthetic / "synthetic_heldout.bin").read_bytes())
    small = tmp_path / "small.bin"
    small.write_bytes(pickle.dumps((images[:2 * pairs], issame[:pairs])))
    config = config_file(tmp_path, synthetic, val_targets=[str(small)])
    result = mpirun(2, train_args(config, tmp_path / "work"), timeout=180)
    assert_stopped_saying_once(result, f"rank 0: {small} holds {pairs} pairs; the 10-fold "
                                   "protocol needs at least 10", code=1)
    evaluated = run(python_module("eval", "--model", str(tmp_path), "--bin", str(small)))
    assert evaluated.returncode == 2 and f"{small} holds {pairs} pairs" in evaluated.stdout


@pytest.mark.parametrize("label, shown", [("x", "'x'"), ("1.5", "'1.5'"), ("-1", "'-1'")])
def test_a_list_with_a_label_that_is_not_a_class_id_names_the_line(tmp_path, label, shown):
    (tmp_path / "faces").mkdir()
    lst = tmp_path / "train.lst"
    lst.write_text(f"0\t0\tfaces/a.jpg\n1\t{label}\tfaces/b.jpg\n")
    result = run(python_module("pack", str(lst), str(tmp_path / "out"), "--root",
                               str(tmp_path)))
    assert result.returncode == 2, result.stdout
    assert f"error: {lst} line 2: label {shown} is not a class id (a whole number >= 0)" \
        in result.stdout
    assert not (tmp_path / "out" / "train.rec").exists()


def test_every_error_users_see_is_one_kind_printed_as_a_message(tmp_path):
    """Each concept raises its own error from its own module, all of one base: the
    command line prints the message (naming the file) and exits 2, no traceback."""
    from partial_fc_mx.config import ConfigError
    from partial_fc_mx.data import DataError
    from partial_fc_mx.errors import UserError
    from partial_fc_mx.pfc.partial_fc import PartialFCInputError
    from partial_fc_mx.run.backbone_optimizer import OptimizerStateError
    from partial_fc_mx.run.checkpoint import CheckpointError
    from partial_fc_mx.run.export import ExportError
    from partial_fc_mx.run.precision import PrecisionError
    from partial_fc_mx.run.workdir import WorkDirError
    from partial_fc_mx.train import TrainingError

    for error in (CheckpointError, ConfigError, DataError, ExportError, OptimizerStateError,
                  PartialFCInputError, PrecisionError, TrainingError, WorkDirError):
        assert issubclass(error, UserError), error
    missing = tmp_path / "no-such-run"
    result = run(python_module("export", str(missing)))
    assert result.returncode == 2, result.stdout[-3000:]
    assert errors(result.stdout) == [f"{missing} has no backbone-symbol.json: not a work dir "
                                     "with a saved backbone (training writes it at every "
                                     "checkpoint)"]
    assert "Traceback" not in result.stdout
