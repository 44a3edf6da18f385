"""Training configuration: Python files in configs/, overridable with `key=value`.

A config file is plain Python that assigns the keys it changes, as insightface's
configs do (`network = "r50"`). It may name a parent with `_base_ = "other.py"`
(resolved next to it) and then only lists what differs. Every key has a default
and a type in `Config` below, so a misspelled key or a wrong type is an error at
start-up on every rank, not a silent default three hours into training.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import hashlib
import os
import runpy
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import UserError

if TYPE_CHECKING:
    from .data.augment import Augmentation
    from .pfc.center_optimizers import CenterOptimizer
    from .pfc.margins import Margin


class ConfigError(UserError, ValueError):
    """A config file or override that cannot be used; the message says how to fix it."""


FLOAT32_MAX = 3.4028234663852886e38
CPU_PRECISIONS = ("auto", "bfloat16", "float32")
"""cpu_precision's settings (cpu_precision.py)."""
PFC_GEMMS = ("auto", "float32", "bfloat16")
"""pfc_gemm's settings (pfc/gemm.py)."""


@dataclass
class Config:
    # --- data ---
    rec: str | list = ""
    """Directory holding train.rec, train.idx and property (insightface layout); a list
    of them, trained as one dataset with each one's classes after the previous ones'
    (num_classes: their sum; a person in two of them is two classes); or "random" for
    random tensors without decoding (speed runs)."""
    num_classes: int = 0
    """Identities in the training set; must agree with `property` (the packer writes it),
    for a `rec` list with the sum of its datasets'."""
    num_image: int = 0
    """Images in the training set; 0 means count them from train.idx."""
    val_targets: list = field(default_factory=list)
    """Verification sets: names looked up as <rec>/<name>.bin (in each folder of a `rec`
    list, the first that has it), or paths to .bin files."""
    num_workers: int = 0
    """Decode threads per process; 0: the host's cores shared by its processes, at least
    2 (a GPU consumes batches faster than 2 threads decode them)."""
    skip_corrupt: bool = False
    """Replace undecodable images by others of the same batch (counted) instead of failing."""
    augment_crop_scale: float = 1.0
    """Training augmentation (data/augment.py), all off by default: the smallest area of
    a random square crop, as a share of the image (1: no crop)..."""
    augment_rotate: float = 0.0
    """... the largest random rotation in degrees ..."""
    augment_color: float = 0.0
    """... the largest relative change of contrast and brightness ..."""
    augment_blur: float = 0.0
    """... and the probability of a slight Gaussian blur."""

    # --- model ---
    network: str = "r50"
    """The backbone: r18, r34, r50, r100, r200 (IResNet), mobilefacenet, mbf (arcface_torch's
    MobileFaceNet, twice as wide), arcface_torch's Vision Transformers vit_t,
    vit_t_dp005_mask0, vit_s, vit_s_dp005_mask_0, vit_b, vit_b_dp005_mask_005,
    vit_l_dp005_mask_005, vit_h (docs/training.md), or tiny (tests)."""
    embedding_size: int = 512
    """Length of the face embedding (the backbone's output, the class centers' width)."""
    dropout: float = 0.0
    """Dropout before the embedding layer, in [0, 1)."""
    fp16: bool = False
    """The backbone computes in 16 bits, with dynamic loss scaling: float16 on a GPU;
    on a CPU host what cpu_precision says (MXNet has no float16 convolutions there);
    its parameters and checkpoints stay float32 (precision.py)."""
    cpu_precision: str = "auto"
    """What fp16=True means on a CPU host: "auto", bfloat16 where the CPU computes it
    natively (AVX512_BF16 or AMX) and oneDNN runs the network in it, float32 elsewhere;
    "bfloat16" or "float32" forces either (cpu_precision.py; docs/training.md)."""
    pfc_gemm: str = "float32"
    """The inputs of Partial FC's three GEMMs: "float32"; "bfloat16" (rounded to it,
    float32 accumulation and output, by oneDNN 3 on a CPU with AVX512_BF16 or AMX: the
    GEMMs in about half the time); "auto", bfloat16 where the CPU computes it, float32
    elsewhere, and the log says why. The margin, softmax, loss and updates stay float32
    (pfc/gemm.py; docs/training.md). bfloat16's models ended within the seeds' spread
    of float32's (parity, 3 seeds); the default is still float32."""
    recompute_activations: bool = False
    """Keep only each backbone segment's input (a ViT's blocks, an IResNet's residual
    units) between the forward and the backward, and recompute the segments one at a
    time in the backward: less activation memory for about one more forward's time,
    the same gradients in float32 (run/recompute.py; arcface_torch's
    `using_checkpoint`). With fp16 the values between segments are float32 (an
    IResNet's whole 16-bit graph keeps its units' outputs in 16 bits). Its random
    draws (drop path, masks, dropout) are per segment: a run draws other masks with
    it than without."""

    # --- Partial FC ---
    sample_rate: float = 1.0
    """Share of each rank's class centers scored per step (Partial FC; positives always
    are); 1: all of them, the plain margin softmax. 0.1 is the papers' choice."""
    margin: str = "combined"
    """The margin on the target logit, a module of partial_fc_mx/pfc/margins/: "combined"
    (margin_list) or "adaface" (margin_options m, h, t_alpha)."""
    margin_list: tuple = (1.0, 0.5, 0.0)
    """Combined margin (m1, m2, m3): s * (cos(m1 * theta + m2) - m3). ArcFace (1, 0.5, 0)."""
    margin_options: dict = field(default_factory=dict)
    """Settings of a margin other than "combined", e.g. {"m": 0.4, "h": 0.333}."""
    scale: float = 64.0
    """The logits' scale s of the combined margin."""
    fp16_centers: bool = False
    """Store this rank's class-center shard in float16 to fit twice the classes."""
    center_optimizer: str = "sgd"
    """The class centers' optimizer, a module of partial_fc_mx/pfc/center_optimizers/:
    "sgd" (with `momentum`, the insightface references') or "adamw" (per-row bias
    correction; its moments are float32 even with fp16_centers). Both use
    `weight_decay` and the learning rate lr * center_lr_scale."""
    center_update: str = "auto"
    """How the centers a step did not sample take it. "exact": a sampled row first takes
    the momentum and weight-decay steps it missed (SGD only), so every step sees the
    rows of "dense" at the sample's cost (about 1.5% of the step at 1M classes, 8 bytes
    per row). "lazy" (the MXNet reference): a step moves only the sampled centers; the
    optimizer's states and weight decay reach a row only when it is sampled. "dense"
    (arcface_torch's PartialFC_V2, a dense optimizer over the whole shard): every row
    takes its states and weight decay every step, float32 centers only. "auto": "exact"
    with center_optimizer = "sgd", "lazy" with "adamw" (which has no exact replay).
    docs/parity.md compares them."""
    center_lazy_update: bool = True
    """The earlier switch: False is center_update = "dense"."""
    interclass_filtering_threshold: float = 0.0
    """Inter-class filtering for noisy labels (arcface_torch's name and rule): a negative
    class whose cosine to a sample is above this counts as cosine 0 in the softmax, with
    no gradient (a sample filed under the wrong person stops pulling its true person's
    center away); 0: off. arcface_torch's noisy configs use 0.4. The log's
    filtered_percent is the share of negatives filtered: on clean data nearly 0."""
    num_subcenters: int = 1
    """Sub-center ArcFace: K centers per class, a sample's class cosine the max over them,
    so that wrong labels gather on sub-centers of their own; 3 in the paper. Then
    `python -m partial_fc_mx clean` drops the samples far from each class's dominant
    sub-center, and a K = 1 run trains on what it keeps (docs/noisy_labels.md). K times
    the center rows and the classifier's GEMMs."""

    # --- optimisation ---
    batch_size: int = 128
    """Per process, in each forward and backward pass (with gradient_accumulation: of
    each micro-batch)."""
    gradient_accumulation: int = 1
    """k micro-batches of batch_size per optimizer step, which is then the step of one
    global batch of k x batch_size x the processes, exactly (pfc/partial_fc.py): the
    centers sampled once for all k, each sample weighted by 1 / that batch, the
    gradients summed and applied once; steps, the schedule, max_steps, logs and
    checkpoints count optimizer steps. The backbone's BatchNorms see each micro-batch
    alone, as a GPU holding only batch_size would (docs/training.md)."""
    reference_batch: int = 0
    """The global batch that max_steps and lr_steps count steps of; 0: batch_size x
    gradient_accumulation x the processes of the run's first launch. A resume keeps
    its checkpoint's; the restart supervisor sets it when it relaunches a job that has
    no checkpoint yet on fewer processes, so that the schedule holds
    (run/schedule.py)."""
    optimizer: str = "sgd"
    """The backbone's: "sgd" (with momentum) or "adamw" (decoupled weight decay; try
    lr=0.001, weight_decay=0.1). The class centers': center_optimizer."""
    lr: float = 0.1
    """The learning rate at the end of warmup, for a global batch of batch_size x
    gradient_accumulation x the processes (not scaled by the number of processes:
    change it with them)."""
    center_lr_scale: float = 1.0
    """The class centers' learning rate is lr * center_lr_scale."""
    momentum: float = 0.9
    """SGD's momentum (the backbone's, and the centers' with center_optimizer="sgd")."""
    weight_decay: float = 5e-4
    """Weight decay of the backbone and of the class centers."""
    num_epoch: int = 20
    """Epochs to train (max_steps, when set, ends the run instead)."""
    warmup_epoch: float = 0.0
    """Epochs of linear warmup (fractions allowed)."""
    lr_steps: list = field(default_factory=list)
    """Multi-step schedule: lr x 0.1 after each of these steps, counted in steps of the
    global batch the run started with (schedule.py); empty: polynomial decay."""
    lr_power: float = 2.0
    """The polynomial decay's power: lr x (1 - progress)^lr_power. 2 is arcface_torch's
    schedule until 2023; its train_v2.py decays with 1 since (docs/parity.md)."""
    max_steps: int = 0
    """Stop after this many steps of the global batch the run started with (a run
    resumed on more processes takes fewer, larger steps to get there); 0: num_epoch
    epochs."""
    clip_grad: float = 0.0
    """Clip the backbone's global gradient norm to this; 0: no clipping."""
    seed: int = 2048
    """Seeds the initial weights and centers, the data order and augmentation, dropout."""

    # --- output ---
    output: str = ""
    """Work directory; default work_dirs/<config file name>."""
    frequent: int = 10
    """Write a log line every `frequent` steps."""
    verbose: int = 2000
    """Evaluate on val_targets every `verbose` steps (and at the end)."""
    save_every: int = 0
    """Save a resumable checkpoint every this many steps; 0: at the end of each epoch."""
    keep_checkpoints: int = 2
    """How many of the newest checkpoints to keep (older ones are deleted)."""
    stall_timeout: int = 1800
    """Seconds one step (with its evaluation and saving) may take before the process
    prints every thread's stack and exits, so a stuck job fails instead of hanging
    (its launcher then ends the other ranks); 0: wait forever."""
    heartbeat_timeout: int = 120
    """Seconds a rank waits for its next step, while another rank's heartbeat has
    stopped (a frozen process or host), before it names that rank and ends the job
    (run/heartbeat.py); 0: no heartbeats (the watchdog above remains). At least 10;
    keep 60 or more on NFS."""
    report_baseline: bool = False
    """At the end, also score an eigenfaces (PCA) baseline on the val_targets."""

    def validate(self) -> None:
        """Reject values that would fail later, far from their cause, or on one rank."""
        from .backbones import dropout_problem, unknown_network
        from .pfc.centers import subcenter_problem
        from .pfc.rows import filter_problem

        positive = ("num_classes", "embedding_size", "batch_size", "lr", "num_epoch",
                    "frequent", "verbose", "center_lr_scale", "lr_power")
        problems = [f"{key} must be > 0 (got {getattr(self, key)!r})" for key in positive
                    if not getattr(self, key) > 0]
        not_negative = ("num_workers", "max_steps", "warmup_epoch", "save_every",
                        "stall_timeout", "heartbeat_timeout", "clip_grad", "momentum",
                        "weight_decay", "num_image")
        problems += [f"{key} must be >= 0 (got {getattr(self, key)!r})" for key in not_negative
                     if not getattr(self, key) >= 0]
        if self.keep_checkpoints < 1:
            problems.append("keep_checkpoints must be >= 1")
        if not isinstance(self.gradient_accumulation, int) or self.gradient_accumulation < 1:
            problems.append(f"gradient_accumulation={self.gradient_accumulation!r} must be a "
                            "whole number of micro-batches >= 1")
        elif self.gradient_accumulation > 1 and self.margin == "adaface":
            problems.append("gradient_accumulation > 1 with margin='adaface': AdaFace follows "
                            "statistics of each whole global batch's embeddings, which "
                            "accumulation never holds at once; use 1, or another margin")
        if isinstance(self.rec, list) and not listed_datasets_valid(self.rec):
            problems.append(f"rec={self.rec!r}: a list of datasets names one or more folders, "
                            "each once (not 'random')")
        if 0 < self.heartbeat_timeout < 10:
            problems.append(f"heartbeat_timeout={self.heartbeat_timeout} must be 0 (off) or at "
                            "least 10 seconds (60 or more on NFS, whose caches lag)")
        if not self.lr < FLOAT32_MAX:
            problems.append(f"lr={self.lr} is beyond float32 (the optimizers' precision)")
        if not 0.0 < self.sample_rate <= 1.0:
            problems.append(f"sample_rate={self.sample_rate} must be in (0, 1]")
        problems += [problem for problem in (
            subcenter_problem(self.num_subcenters),
            filter_problem(self.interclass_filtering_threshold)) if problem]
        try:
            self.margin_function()
        except (ValueError, TypeError) as error:  # TypeError: an option it does not take
            keys = "margin_list/scale" if self.margin == "combined" else "margin"
            problems.append(f"{keys}: {error}")
        if problem := unknown_network(self.network):
            problems.append(f"network: {problem}")
        if self.optimizer not in ("sgd", "adamw"):
            problems.append(f"optimizer={self.optimizer!r} must be 'sgd' or 'adamw'")
        try:
            self.centers_optimizer()
        except ValueError as error:
            problems.append(str(error))
        problems += self.center_update_problems()
        if self.cpu_precision not in CPU_PRECISIONS:
            problems.append(f"cpu_precision={self.cpu_precision!r} must be one of "
                            f"{', '.join(map(repr, CPU_PRECISIONS))}")
        elif self.cpu_precision == "bfloat16" and not self.fp16:
            problems.append("cpu_precision='bfloat16' asks for the 16-bit backbone that "
                            "fp16=False turns off; set fp16=True too")
        if self.pfc_gemm not in PFC_GEMMS:
            problems.append(f"pfc_gemm={self.pfc_gemm!r} must be one of "
                            f"{', '.join(map(repr, PFC_GEMMS))}")
        if not 0 <= self.dropout < 1:
            problems.append(f"dropout={self.dropout} must be in [0, 1)")
        elif problem := dropout_problem(self.network, self.dropout):
            problems.append(problem)
        problems += self.augmentation().problems()
        if not isinstance(self.reference_batch, int) or self.reference_batch < 0:
            problems.append(f"reference_batch={self.reference_batch} must be a whole number "
                            "of images (0: batch_size x gradient_accumulation x the processes)")
        if any(not isinstance(s, int) or s <= 0 for s in self.lr_steps):
            problems.append(f"lr_steps={self.lr_steps} must be positive step counts")
        if problems:
            raise ConfigError("invalid config: " + "; ".join(problems))

    def images_per_step(self) -> int:
        """Per process and optimizer step: batch_size in each of the micro-batches."""
        return self.batch_size * self.gradient_accumulation

    def check_world_size(self, world_size: int) -> None:
        """What only the number of processes decides; the same answer on every rank."""
        from .pfc.centers import sharding_problem, tensor_size_problem

        if problem := sharding_problem(self.num_classes, world_size, self.sample_rate):
            raise ConfigError(problem)
        if problem := tensor_size_problem(self.num_classes, world_size, self.embedding_size,
                                          self.sample_rate, self.batch_size * world_size,
                                          self.num_subcenters, self.gradient_accumulation):
            raise ConfigError(problem)

    def augmentation(self) -> Augmentation:
        from .data.augment import Augmentation  # OpenCV: not for the stdlib-only commands

        return Augmentation(self.augment_crop_scale, self.augment_rotate, self.augment_color,
                            self.augment_blur)

    def margin_function(self) -> Margin:
        from .pfc import margins

        return margins.build(self.margin, scale=self.scale, margin_list=self.margin_list,
                             options=self.margin_options)

    def center_update_mode(self) -> str:
        """center_update resolved: the earlier center_lazy_update=False is "dense", and
        "auto" is "exact" for SGD's centers, "lazy" for AdamW's."""
        if not self.center_lazy_update:
            return "dense"
        if self.center_update == "auto":
            return "exact" if self.center_optimizer == "sgd" else "lazy"
        return self.center_update

    def center_update_problems(self) -> list[str]:
        from .pfc.idle_rows import CENTER_UPDATES

        update = self.center_update_mode()
        if self.center_update not in ("auto", *CENTER_UPDATES):
            return [f"center_update={self.center_update!r} must be one of "
                    f"{', '.join(map(repr, ('auto', *CENTER_UPDATES)))}"]
        if not self.center_lazy_update and self.center_update not in ("auto", "dense"):
            return [f"center_lazy_update=False (the earlier switch, \"dense\") and "
                    f"center_update={self.center_update!r} disagree (a _base_ config may set "
                    "the first): give center_update only, and center_lazy_update=True or "
                    "not at all"]
        if update == "dense" and self.fp16_centers:
            named = ("center_lazy_update=False" if not self.center_lazy_update
                     else "center_update='dense'")
            return [f"{named} needs float32 centers (fp16_centers=False): the dense update "
                    "is float32 only"]
        if update == "exact" and self.center_optimizer != "sgd":
            return [f"center_update='exact' replays SGD's momentum and weight decay; the "
                    f"{self.center_optimizer} optimizer of the centers has no such replay: "
                    "use center_update='lazy' or 'dense', or center_optimizer='sgd'"]
        return []

    def centers_optimizer(self) -> CenterOptimizer:
        from .pfc import center_optimizers

        return center_optimizers.build(self.center_optimizer, momentum=self.momentum,
                                       weight_decay=self.weight_decay)

    def val_paths(self) -> list[Path]:
        """Paths of the verification sets, with bare names resolved inside `rec` (the
        first of its datasets that holds the name, else the first)."""
        folders = [Path(folder) for folder in (self.rec if isinstance(self.rec, list)
                                               else [self.rec])]
        paths = []
        for target in self.val_targets:
            path = Path(target)
            if path.suffix != ".bin":
                path = next((folder / f"{target}.bin" for folder in folders
                             if (folder / f"{target}.bin").is_file()),
                            folders[0] / f"{target}.bin")
            paths.append(path)
        names = [path.stem for path in paths]
        if len(set(names)) < len(names):  # the validator keys each set's results by it
            raise ConfigError(f"val_targets {self.val_targets} name two sets of the same file "
                              f"name ({names}); give each its own name")
        return paths


def listed_datasets_valid(folders: list) -> bool:
    """One or more folders, none named twice (however spelled), none "random"."""
    named = [os.path.realpath(folder) for folder in folders
             if isinstance(folder, str) and folder and folder != "random"]
    return bool(folders) and len(named) == len(folders) == len(set(named))


FIELDS = {f.name: f for f in dataclasses.fields(Config)}
FIELD_TYPES = typing.get_type_hints(Config)


def load_config(path: str | os.PathLike, overrides: list[str] = ()) -> Config:
    """Read a config file (find_config: from the current folder, else the repository's),
    apply `key=value` overrides, validate."""
    values = read_config_file(find_config(str(path), Path.cwd(), f"config {path}"))
    for override in overrides:
        key, value = parse_override(override)
        values[key] = value
    config = Config()
    for key, value in values.items():
        setattr(config, key, coerce(key, value, source=str(path)))
    if not config.output:
        config.output = str(Path("work_dirs") / Path(path).stem)
    config.validate()
    return config


CONFIGS = Path(__file__).resolve().parent.parent / "configs"
"""The repository's configs: where `_base_ = "orl.py"` is found from a user's config."""


def read_config_file(path: Path) -> dict:
    try:
        namespace = runpy.run_path(str(path))
    except Exception as error:  # a user's Python file: any error is theirs to see
        raise ConfigError(f"config file {path} failed to run: {error!r}") from error
    values = {}
    base = namespace.get("_base_")
    if base:
        values.update(read_config_file(find_config(str(base), path.parent,
                                                   f"_base_ = {base!r} in {path}", path)))
    for key, value in namespace.items():
        if key.startswith("_") or callable(value) or isinstance(value, types.ModuleType):
            continue
        check_known(key, source=str(path))
        values[key] = value
    return values


def find_config(name: str, folder: Path, what: str, including: Path | None = None) -> Path:
    """A config named from `folder` (the current one for CONFIG, the including
    config's for `_base_`), else from the repository: `configs/ms1mv3_r50.py` and
    `ms1mv3_r50.py` work from any folder. An absolute path is taken as it is. A
    `_base_` never names the file `including` it: a user's own orl.py may build on the
    repository's."""
    places = list(dict.fromkeys([folder / name, CONFIGS.parent / name, CONFIGS / name]))
    found = next((place for place in places if place.is_file() and not (
        including is not None and place.samefile(including))), None)
    if found is None:
        raise ConfigError(f"{what}: no such config file (looked for "
                          f"{', '.join(str(p.absolute()) for p in places)}); give its path "
                          f"from {folder.absolute()}, or the name of one in {CONFIGS}")
    return found


def config_fingerprint(config: Config) -> str:
    """Every key's value, as a short digest: equal configs, equal digests."""
    return hashlib.sha256(repr(dataclasses.asdict(config)).encode()).hexdigest()[:12]


def configs_differ(copies: list[tuple[str, str, str]]) -> str | None:
    """Why ranks whose (host, config file, config_fingerprint) are `copies`, in rank
    order, cannot train together, or None: a different batch or class count would
    make their collectives disagree, a different rate train something else."""
    groups: dict[tuple[str, str], list[str]] = {}
    for rank, (host, path, digest) in enumerate(copies):
        groups.setdefault((digest, path), []).append(f"{rank} ({host})")
    if len({digest for digest, _ in groups}) < 2:
        return None
    return ("the ranks read different configs: " + "; ".join(
        f"rank(s) {', '.join(ranks)}: {path} (values {digest})"
        for (digest, path), ranks in groups.items())
        + ". Give every host the same config file at the same path (or an absolute path "
        "every host sees)")


def parse_override(text: str) -> tuple[str, object]:
    """`lr=0.2` -> ("lr", 0.2); values are Python literals, else plain strings."""
    key, sep, raw = text.partition("=")
    key = key.strip().lstrip("-").replace("-", "_")
    if not sep or not key:
        raise ConfigError(f"override {text!r} is not key=value (example: sample_rate=0.1)")
    check_known(key, source="the command line")
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        value = raw
    return key, value


def check_known(key: str, source: str) -> None:
    if key not in FIELDS:
        close = difflib.get_close_matches(key, FIELDS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"unknown config key {key!r} in {source}{hint}")


def coerce(key: str, value: object, source: str) -> object:
    """Convert to the field's type where that loses nothing; otherwise refuse."""
    expected = FIELD_TYPES[key]
    if isinstance(expected, types.UnionType):  # `rec`: a folder or a list of them
        value = list(value) if isinstance(value, tuple) else value
        if isinstance(value, str) and value.lstrip().startswith(("[", "(")):
            raise ConfigError(f"config key {key!r} from {source} reads {value!r}, a list "
                              "whose quotes the shell took away: quote the whole word, "
                              """e.g. 'rec=["data/a", "data/b"]'""")
        if isinstance(value, expected.__args__):
            return value
        kinds = " or ".join(kind.__name__ for kind in expected.__args__)
        raise ConfigError(f"config key {key!r} from {source} must be {kinds}, got {value!r}")
    expected = typing.get_origin(expected) or expected
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if expected in (list, tuple) and isinstance(value, (list, tuple)):
        return expected(value)
    if isinstance(value, expected) and not (expected is int and isinstance(value, bool)):
        return value
    raise ConfigError(
        f"config key {key!r} from {source} must be {expected.__name__}, got {value!r}"
    )
