from pathlib import Path

import pytest

from partial_fc_mx.config import CONFIGS, ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_every_shipped_config_loads():
    configs = sorted((REPO / "configs").glob("*.py"))
    assert len(configs) >= 3
    for path in configs:
        config = load_config(path)
        assert config.num_classes > 0, path
        assert config.output == f"work_dirs/{path.stem}"


def test_base_is_inherited_and_overridden(tmp_path):
    write(tmp_path / "parent.py", "num_classes = 10\nnetwork = 'r50'\nlr = 0.2\n")
    child = write(tmp_path / "child.py", "_base_ = 'parent.py'\nnetwork = 'r100'\n")
    config = load_config(child, ["lr=0.05", "margin_list=(1.0, 0.0, 0.4)", "val_targets=[]"])
    assert (config.num_classes, config.network, config.lr) == (10, "r100", 0.05)
    assert config.margin_list == (1.0, 0.0, 0.4)


def test_override_types_are_coerced_only_when_lossless(tmp_path):
    path = write(tmp_path / "c.py", "num_classes = 10\n")
    assert load_config(path, ["lr=1"]).lr == 1.0
    assert load_config(path, ["rec=/data/x"]).rec == "/data/x"
    with pytest.raises(ConfigError, match="'batch_size' .* must be int, got 'abc'"):
        load_config(path, ["batch_size=abc"])
    with pytest.raises(ConfigError, match="must be int, got 1.5"):
        load_config(path, ["num_classes=1.5"])
    with pytest.raises(ConfigError, match="must be bool"):
        load_config(path, ["fp16=1"])


def test_unknown_keys_are_rejected_with_a_suggestion(tmp_path):
    path = write(tmp_path / "c.py", "num_classes = 10\nsample_ratio = 0.1\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'sample_ratio' in .*c\.py; "
                                          r"did you mean 'sample_rate'"):
        load_config(path)
    good = write(tmp_path / "good.py", "num_classes = 10\n")
    with pytest.raises(ConfigError, match="'embeding_size' in the command line"):
        load_config(good, ["embeding_size=128"])
    with pytest.raises(ConfigError, match="not key=value"):
        load_config(good, ["lr"])


@pytest.mark.parametrize("override, message", [
    ("sample_rate=0", "sample_rate=0.0 must be in"),
    ("sample_rate=1.5", "sample_rate=1.5 must be in"),
    ("num_classes=0", "num_classes must be > 0"),
    ("margin_list=(1.0, 0.5)", "must be .m1, m2, m3."),
    ("optimizer='adam'", "'sgd' or 'adamw'"),
    ("center_optimizer='adam'", r"center_optimizer='adam' must be one of \['adamw', 'sgd'\]"),
    ("margin='arcface'", r"margin='arcface' must be one of \['adaface', 'combined'\]"),
    ("margin_options={'m': 0.4}", "are for the other margins; the combined margin takes"),
    ("keep_checkpoints=0", "keep_checkpoints must be >= 1"),
    ("heartbeat_timeout=5", r"heartbeat_timeout=5 must be 0 \(off\) or at least 10 seconds"),
])
def test_invalid_values_are_rejected(tmp_path, override, message):
    path = write(tmp_path / "c.py", "num_classes = 10\n")
    with pytest.raises(ConfigError, match=message):
        load_config(path, [override])


@pytest.mark.parametrize("options, message", [
    ({"m": 0.3, "h": 0.5}, None),
    ({"m": 2.0}, "need scale > 0, 0 <= m < pi/2"),
    ({"margin": 0.4}, "unexpected keyword argument 'margin'"),
])
def test_adaface_takes_its_settings_from_margin_options(tmp_path, options, message):
    path = write(tmp_path / "c.py", f"num_classes = 10\nmargin = 'adaface'\n"
                                    f"margin_options = {options!r}\nscale = 32.0\n")
    if message:
        with pytest.raises(ConfigError, match=message):
            load_config(path)
        return
    margin = load_config(path).margin_function()
    assert (margin.name, margin.scale, margin.m, margin.h) == ("adaface", 32.0, 0.3, 0.5)


def test_the_center_optimizer_takes_the_settings_it_has(tmp_path):
    """momentum and weight_decay are shared with the backbone's optimizer: SGD takes
    both, AdamW only the weight decay (its betas are its own)."""
    path = write(tmp_path / "c.py", "num_classes = 10\nmomentum = 0.8\nweight_decay = 0.05\n")
    sgd = load_config(path).centers_optimizer()
    assert (sgd.name, sgd.momentum, sgd.weight_decay) == ("sgd", 0.8, 0.05)
    adamw = load_config(path, ["center_optimizer=adamw"]).centers_optimizer()
    assert (adamw.name, adamw.weight_decay, adamw.beta1, adamw.beta2) == ("adamw", 0.05, 0.9, 0.999)


def test_the_dense_center_update_is_refused_for_float16_centers(tmp_path):
    path = write(tmp_path / "c.py", "num_classes = 10\ncenter_lazy_update = False\n")
    assert load_config(path).center_lazy_update is False
    with pytest.raises(ConfigError, match="center_lazy_update=False needs float32 centers"):
        load_config(path, ["fp16_centers=True"])


def test_the_default_center_update_is_exact_for_sgd_and_lazy_for_adamw(tmp_path):
    """docs/parity.md: "exact" trains the dense update's rows at the sample's cost;
    AdamW has no replay, so its default stays lazy, and asking it for "exact" is refused."""
    path = write(tmp_path / "c.py", "num_classes = 10\n")
    assert load_config(path).center_update_mode() == "exact"
    assert load_config(path, ["center_optimizer=adamw"]).center_update_mode() == "lazy"
    assert load_config(path, ["center_update=lazy"]).center_update_mode() == "lazy"
    assert load_config(path, ["center_lazy_update=False"]).center_update_mode() == "dense"
    with pytest.raises(ConfigError, match="center_update='exact' replays SGD's momentum"):
        load_config(path, ["center_optimizer=adamw", "center_update=exact"])
    with pytest.raises(ConfigError, match="must be one of 'auto', 'lazy', 'exact', 'dense'"):
        load_config(path, ["center_update=sparse"])
    for update in ("lazy", "exact"):  # the earlier switch from a _base_ says "dense"
        with pytest.raises(ConfigError, match=f"center_lazy_update=False .* and "
                           f"center_update='{update}' disagree"):
            load_config(path, ["center_lazy_update=False", f"center_update={update}"])


def test_missing_or_broken_file_names_it(tmp_path):
    with pytest.raises(ConfigError, match="nope.py: no such config file"):
        load_config(tmp_path / "nope.py")
    broken = write(tmp_path / "broken.py", "num_classes = = 3\n")
    with pytest.raises(ConfigError, match="broken.py failed to run"):
        load_config(broken)


def test_val_targets_resolve_names_inside_rec(tmp_path):
    path = write(tmp_path / "c.py", "num_classes = 3\nrec = '/d'\n"
                                    "val_targets = ['lfw', '/x/cfp.bin']\n")
    assert [str(p) for p in load_config(path).val_paths()] == ["/d/lfw.bin", "/x/cfp.bin"]


def test_a_missing_config_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=rf"config mine.py: no such config file \(looked for "
                                          rf"{tmp_path}/mine.py, {REPO}/mine.py, "
                                          rf"{CONFIGS}/mine.py\); give its path from "
                                          rf"{tmp_path}, or the name of one in {CONFIGS}"):
        load_config("mine.py")


def test_a_config_is_found_from_the_current_folder_then_in_the_repository(tmp_path,
                                                                          monkeypatch):
    """README's `CONFIG=configs/ms1mv3_r50.py` works from a folder of one's own."""
    monkeypatch.chdir(tmp_path)
    shipped = load_config(CONFIGS / "ms1mv3_r50.py")
    assert load_config("configs/ms1mv3_r50.py") == shipped
    assert load_config("ms1mv3_r50.py") == shipped
    assert shipped.output == "work_dirs/ms1mv3_r50"  # in the current folder, as before
    write(tmp_path / "configs" / "ms1mv3_r50.py", "num_classes = 5\n")
    assert load_config("configs/ms1mv3_r50.py").num_classes == 5  # one's own comes first
    # one's own orl.py may build on the repository's of the same name
    write(tmp_path / "orl.py", "_base_ = 'orl.py'\nbatch_size = 4\n")
    mine = load_config("orl.py")
    assert mine.batch_size == 4 and mine.num_epoch == load_config(CONFIGS / "orl.py").num_epoch


def test_base_is_found_beside_the_config_then_in_the_repositorys_configs(tmp_path):
    """A user's config anywhere may build on a shipped one by its name; a missing
    _base_ names itself, the including file and the places looked in."""
    mine = write(tmp_path / "mine.py", "_base_ = 'orl.py'\nbatch_size = 4\n")
    config = load_config(mine)
    assert config.batch_size == 4 and config.rec == load_config(CONFIGS / "orl.py").rec
    write(tmp_path / "orl.py", "num_classes = 7\nnetwork = 'r18'\n")  # beside it: first
    assert (load_config(mine).network, load_config(mine).num_classes) == ("r18", 7)
    broken = write(tmp_path / "broken.py", "_base_ = 'nowhere.py'\n")
    with pytest.raises(ConfigError, match=rf"_base_ = 'nowhere.py' in {broken}: no such "
                                          rf"config file \(looked for {tmp_path}/nowhere.py, "
                                          rf"{REPO}/nowhere.py, {CONFIGS}/nowhere.py\)"):
        load_config(broken)
