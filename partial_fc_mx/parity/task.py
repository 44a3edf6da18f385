"""The study's two tasks. The scale task ("latent", this module): many identities that
a cheap network can learn, so that the classifier, not the backbone, is what a run
spends its time on. The images task ("images", images.py): face-sized pictures of
look-alike identities for a face backbone both toolkits build alike.

Every identity is a point of a 32-d latent space. Identities come in look-alike
families (a family's members scatter around its centre, as relatives and
look-alikes do among faces), and each sample is a noisy view of its identity's point
passed with a view's nuisance (pose, light) through a fixed random non-linear map into
64 dimensions: the network has to undo the map, ignore the nuisance and the noise,
and tell family members apart. The held-out identities come from families of their
own, never seen in training.

Both arms read the files written here (numpy only: the torch arm imports this module
too), turn stored rows into the network's input with `as_input`, and
train in the order `rank_rows` gives, the order our loader uses: every
epoch a permutation of the samples from (seed, epoch), global batch k taking
positions kG .. (k+1)G - 1 and rank r every W-th of them from r.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..data.network_input import to_network_input
from .noise import add_noise

KINDS = ("latent", "images")

LATENT = 32
"""Dimensions of the identity space."""
INPUT = 64
"""Dimensions of a sample: what the network reads."""
MAP_WIDTH = 256
FAMILY = 10
"""Identities per look-alike family."""
FAMILY_SPREAD = 0.5
"""How far a family's members lie from its centre (the centres' spread is 1)."""
VIEW_NOISE = 0.4
"""How far a sample lies from its identity's point, per latent dimension."""
NUISANCE = 16
"""Dimensions of what changes from view to view whoever is seen (pose and light, in
faces), drawn N(0, 1) per sample and mapped together with the identity: it dominates
the raw input, so the input's own cosine verifies poorly (scored beside the arms)."""


@dataclass(frozen=True)
class Task:
    classes: int
    per_class: int = 8
    heldout: int = 1000
    """Held-out identities: all pairs of their samples are scored."""
    heldout_per_class: int = 5
    pairs: int = 3000
    """Genuine pairs of the 10-fold protocol, and as many impostor pairs (half of them
    family members)."""
    seed: int = 0
    kind: str = "latent"
    """One of KINDS."""
    shared: float = 0.0
    """Images: the fraction of every identity's picture common to all (images.py);
    in the folder's name, so that data of another fraction is never taken for it."""
    kin: float = 0.0
    """Images: the fraction of the rest that a family's members share (images.py);
    in the folder's name when not 0 (the folders made before it had none)."""
    noise: str = ""
    """Label noise of the training samples (noise.py: "flips0.4", "splits0.3"; "" for
    none), the true labels kept in train_y_true.npy; the held-out identities stay clean.
    In the folder's name when set."""

    @property
    def name(self) -> str:
        kin = f"-kin{self.kin:g}" if self.kin else ""
        shared = f"-shared{self.shared:g}{kin}" if self.kind == "images" else ""
        noise = f"-{self.noise}" if self.noise else ""
        return (f"{self.kind}{self.classes}x{self.per_class}{shared}{noise}-heldout"
                f"{self.heldout}x{self.heldout_per_class}-seed{self.seed}")


FILES = ("train_x.npy", "train_y.npy", "heldout_x.npy", "heldout_y.npy", "pairs.npy",
         "issame.npy")
TRUE_LABELS = "train_y_true.npy"
"""A noisy task's true training labels (each sample's identity), beside train_y.npy."""


def random_map(rng: np.random.Generator):
    """The fixed non-linear map from the latent space to a sample (one per task seed)."""
    first = rng.standard_normal((LATENT + NUISANCE, MAP_WIDTH)) * (
        1.5 / np.sqrt(LATENT + NUISANCE))
    second = rng.standard_normal((MAP_WIDTH, INPUT)) / np.sqrt(MAP_WIDTH)

    def apply(points: np.ndarray) -> np.ndarray:
        return (np.tanh(points @ first) @ second).astype(np.float32)

    return apply


def identity_points(rng: np.random.Generator, count: int) -> np.ndarray:
    """`count` identities, FAMILY by FAMILY around shared centres (count x LATENT);
    identity i belongs to family i // FAMILY."""
    centres = rng.standard_normal((-(-count // FAMILY), LATENT))
    members = centres.repeat(FAMILY, axis=0)[:count]
    return members + FAMILY_SPREAD * rng.standard_normal((count, LATENT))


def samples(rng: np.random.Generator, points: np.ndarray, per_class: int, apply):
    """`per_class` views of every identity, class by class: (x, labels)."""
    labels = np.arange(len(points)).repeat(per_class)
    x = np.empty((len(labels), INPUT), np.float32)
    for start in range(0, len(labels), 65536):  # bounded temporaries at 100k classes
        rows = labels[start:start + 65536]
        noisy = points[rows] + VIEW_NOISE * rng.standard_normal((len(rows), LATENT))
        view = rng.standard_normal((len(rows), NUISANCE))
        x[start:start + len(rows)] = apply(np.concatenate([noisy, view], axis=1))
    return x, labels.astype(np.int64)


def verification_pairs(rng: np.random.Generator, labels: np.ndarray, count: int):
    """`count` genuine pairs and `count` impostor pairs of the held-out samples, half
    of the impostors from one family, shuffled: (pairs (2 count x 2), issame)."""
    by_class = np.arange(len(labels)).reshape(-1, np.bincount(labels)[0])  # class by class
    classes, per_class = by_class.shape
    who = rng.integers(0, classes, count)
    first, second = (rng.permuted(np.tile(np.arange(per_class), (count, 1)), axis=1)[:, :2]
                     .T)
    genuine = np.stack([by_class[who, first], by_class[who, second]], axis=1)
    a = rng.integers(0, classes, count)
    family_mate = (a // FAMILY) * FAMILY + (a % FAMILY + rng.integers(1, FAMILY, count)) % FAMILY
    anyone = (a + rng.integers(1, classes, count)) % classes
    b = np.where(np.arange(count) % 2 == 0, family_mate, anyone)
    impostor = np.stack([by_class[a, rng.integers(0, per_class, count)],
                         by_class[b, rng.integers(0, per_class, count)]], axis=1)
    order = rng.permutation(2 * count)  # every fold of the protocol gets both kinds
    return np.concatenate([genuine, impostor])[order], order < count


PAIRS_VERSION = 2
"""Of the pair list's draw (1: a family member's draw that skipped each family's first
and could leave the family); a task folder of another version gets its pairs drawn
again (the training data stays: its runs need not train again, only be scored)."""


def write_task(task: Task, folder: Path) -> Path:
    """The task's files in folder/<task.name> (kept: made once per task; the pairs
    drawn from their own generator, so that they can be drawn again alone)."""
    if task.kind not in KINDS:
        raise SystemExit(f"task kind {task.kind!r}: one of {', '.join(KINDS)}")
    for field, what in (("shared", "common to all identities"),
                        ("kin", "common to a family's members")):
        fraction = getattr(task, field)
        fraction_allowed = 0 <= fraction < 1 if task.kind == "images" else fraction == 0
        if not fraction_allowed:
            raise SystemExit(f"{field}={fraction}: the fraction of an image {what}, in "
                             "[0, 1), and only for the images task")
    if task.classes % FAMILY or task.heldout % FAMILY:
        raise SystemExit(f"{task.classes} training and {task.heldout} held-out identities: "
                         f"both must be multiples of {FAMILY}, the family size, so that no "
                         "family spans the two")
    out = Path(folder) / task.name
    made = out / "task.json"
    if made.is_file() and json.loads(made.read_text()).get("pairs_version") == PAIRS_VERSION:
        return out
    if not made.is_file():
        out.mkdir(parents=True, exist_ok=True)
        train_x, train_y, heldout_x, heldout_y = make_samples(task)
        if task.noise:  # the true labels first, then the ones trained on
            np.save(out / TRUE_LABELS, train_y)
            train_y = add_noise(train_y, task.noise, task.seed)
        for name, array in zip(FILES[:4], (train_x, train_y, heldout_x, heldout_y)):
            np.save(out / name, array)
    pairs, issame = verification_pairs(np.random.default_rng([task.seed, 2038, 1]),
                                       np.load(out / "heldout_y.npy"), task.pairs)
    np.save(out / "pairs.npy", pairs)
    np.save(out / "issame.npy", issame)
    made.write_text(json.dumps({**asdict(task), "pairs_version": PAIRS_VERSION}))
    return out


def make_samples(task: Task) -> tuple[np.ndarray, ...]:
    """train_x, train_y, heldout_x, heldout_y of `task`; labels count from 0 in each."""
    if task.kind == "images":
        from .images import samples as image_samples  # MXNet's environment only: prep/

        likeness = (task.shared, task.kin, FAMILY)
        return (*image_samples(task.seed, range(task.classes), task.per_class, *likeness),
                *image_samples(task.seed, range(task.classes, task.classes + task.heldout),
                               task.heldout_per_class, *likeness))
    rng = np.random.default_rng([task.seed, 2038])
    apply = random_map(rng)
    points = identity_points(rng, task.classes + task.heldout)
    return (*samples(rng, points[:task.classes], task.per_class, apply),
            *samples(rng, points[task.classes:], task.heldout_per_class, apply))


def load_task(folder: Path, files: tuple[str, ...] = FILES) -> dict[str, np.ndarray]:
    """The arrays write_task saved (all, or `files`), by name (train_x, ...), mapped
    from disk (the images task's 1 GB is read where used, and the ranks share
    them); a missing file named."""
    arrays = {}
    for name in files:
        path = Path(folder) / name
        if not path.is_file():
            raise SystemExit(f"{path} does not exist: make the task with "
                             "`python -m partial_fc_mx.parity` (it writes it first)")
        arrays[name.removesuffix(".npy")] = np.load(path, mmap_mode="r")
    return arrays


def as_input(rows: np.ndarray) -> np.ndarray:
    """What a network reads from stored rows: the latent task's as stored; images
    (uint8, N x H x W x 3) as our loader gives them (N x 3 x H x W float32, (x - 127.5)
    / 128 as insightface's MXNet code: arcface_torch divides by 127.5, the one
    difference it would have made), for both arms alike."""
    return to_network_input(rows) if rows.ndim == 4 else np.array(rows)  # a copy: writable


def input_batches(rows: np.ndarray, batch: int):
    """`rows` as the network's input, `batch` at a time (both arms embed the held-out
    samples so: a backbone's activations of thousands of images at once do not fit)."""
    for start in range(0, len(rows), batch):
        yield as_input(rows[start:start + batch])


def steps_per_epoch(samples_count: int, global_batch: int) -> int:
    return samples_count // global_batch


def run_steps(samples_count: int, global_batch: int, epochs: int) -> int:
    """A whole run's steps: every epoch's full global batches."""
    return steps_per_epoch(samples_count, global_batch) * epochs


def rank_rows(samples_count: int, global_batch: int, seed: int, epoch: int, rank: int,
              world: int) -> np.ndarray:
    """This rank's sample indices for every step of `epoch` (steps x B), in our
    loader's order (data/loader.py): the remainder that fills no global batch dropped."""
    order = np.random.default_rng([seed, epoch]).permutation(samples_count)
    steps = steps_per_epoch(samples_count, global_batch)
    batch = global_batch // world
    positions = rank + world * np.arange(steps * batch)
    return order[positions].reshape(steps, batch)
