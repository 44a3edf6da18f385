"""`python -m partial_fc_mx clean WORK_DIR OUT --rec DATASET`: the training set
of a run, less the samples its model says are filed under the wrong person.

Launched like training (alone, `mpirun -np N`, `horovodrun -np N`); every rank:
  1. takes the work dir's newest checkpoint (its sub-centers, memory-mapped) and the
     backbone saved with it, and checks that DATASET is the one it was trained on;
  2. embeds its chunks of the dataset (chunk c is rank c mod W's; with the mirror image
     added, as verification does) and keeps, per sample, the cosines to its own class's
     sub-centers in OUT/.chunks/ (a chunk done is never redone: a killed run goes on);
  3. counts which sub-center each sample is nearest to, summed over all ranks: each
     class's dominant sub-center (dominant.py);
then rank 0 writes the samples within --angle degrees of their class's dominant
sub-center to OUT in insightface's layout (records copied byte for byte, classes left
empty dropped, labels renumbered densely), labels.txt (new id, old id) and
clean_report.json. A rank holds one chunk of embeddings at a time, whatever the
dataset's size; the angle applies after the counting, so OUT/.chunks/ serves another
--angle without embedding again.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import mxnet as mx
import numpy as np

from .. import dist, durable
from ..data import DataError
from ..data.joined import JoinedDataset
from ..data.network_input import to_network_input
from ..data.recordio import RecordDataset, valid_class_ids
from ..data.transforms import decode_face
from ..errors import UserError
from ..evaluation.verification import flip_sum, mxnet_forward
from ..prep.pack import write_records
from ..run import checkpoint
from ..run.data_source import identity_of
from ..run.export import load_backbone
from . import dominant

CHUNKS = ".chunks"
PLAN = "plan.json"
REPORT, LABELS = "clean_report.json", "labels.txt"
DEFAULT_CHUNK = 50_000
"""Images per chunk: at K = 3 and 512-d about 0.8 GB of a rank's memory (the
embeddings, their unit copies, each sample's class's sub-centers), a file of 1.4 MB."""


class CleanError(UserError, ValueError):
    """A cleaning that cannot run as asked; the message says why and what to do."""


@dataclass
class Trained:
    """What the cleaning reads of a run: its checkpoint, the backbone saved with it,
    its sub-centers per class (1: its class centers, used as the one sub-center)."""

    checkpoint: Path
    meta: dict
    subcenters: int
    notes: list[str]


def clean(work_dir: Path, out: Path, rec: str | list[str], angle: float = dominant.DEFAULT_ANGLE,
          chunk: int = DEFAULT_CHUNK, batch_size: int = 128, gpu: bool = False) -> dict:
    """The whole command on every rank; rank 0's report (None elsewhere). `gpu`: each
    rank embeds on its own GPU (its local rank's)."""
    # rank 0 alone writes the kept records, for hours at WebFace42M's size, while the
    # others wait in the next collective: not a stall to warn about (or end the job for)
    os.environ.setdefault("HOROVOD_STALL_CHECK_DISABLE", "1")
    world = dist.init()
    trained = dist.run_agreed(lambda: read_run(work_dir, world), "clean.run", (UserError,),
                              CleanError, f"cannot read the run in {work_dir}")
    dataset = dist.run_agreed(lambda: open_trained_dataset(rec, trained, out, work_dir),
                              "clean.data", (UserError,), CleanError, f"cannot open {rec}")
    chunks = plan_chunks(len(dataset), chunk)
    folder, plan = out / CHUNKS, plan_of(trained, dataset, chunk)
    dist.run_agreed(lambda: start_plan(folder, plan), "clean.plan", (UserError,), CleanError,
                    f"cannot prepare {folder}", on=world.is_main)
    dist.run_agreed(lambda: see_plan(folder, plan), "clean.shared", (UserError,), CleanError,
                    f"cannot read {folder}")
    ctx = embedding_device(world) if gpu else mx.cpu()
    mine = [c for c in range(len(chunks)) if c % world.size == world.rank]
    counts = dist.run_agreed(lambda: embed_and_count(work_dir, trained, dataset, chunks, mine,
                                                     folder, ctx, batch_size),
                             "clean.embed", (UserError,), CleanError,
                             "embedding the dataset failed")
    counts = dist.sum_over_ranks(counts, name="clean.counts").astype(np.int64)
    return dist.run_agreed(lambda: write_kept(out, folder, dataset, chunks, counts, angle,
                                              trained),
                           "clean.write", (UserError,), CleanError, f"cannot write {out}",
                           on=world.is_main)


def embedding_device(world: dist.World) -> mx.Context:
    """Each rank's own GPU, as training chooses it (one per process, also where a
    launcher shows each process one GPU as its first), agreed by every rank; a rank
    that sees none stops them all."""
    ctx = dist.training_device(world)
    if ctx.device_type != "gpu":
        raise dist.agreed(CleanError("--gpu: this process sees no GPU (CUDA_VISIBLE_DEVICES, "
                                     "an MXNet without CUDA?); leave --gpu out to embed on "
                                     "the CPU"))
    return ctx


# ----- the run and its dataset -----
def read_run(work_dir: Path, world: dist.World) -> Trained:
    """The newest checkpoint that verifies, with its sub-centers, and the backbone the
    work dir saved with it (backbone.json says its step). Every rank calls it."""
    path, notes = checkpoint.find_resumable(work_dir, world, weights_only=True)
    meta = json.loads((path / checkpoint.META).read_text())
    if meta.get("backbone_only"):
        raise CleanError(f"{path} holds an imported backbone only, no class centers: train "
                         "on the dataset first, then clean with that run's work dir")
    saved = backbone_step(work_dir)
    if saved is None:
        raise CleanError(f"{Path(work_dir) / 'backbone.json'} is missing or unreadable: give "
                         "the run's work dir (the folder holding checkpoints/ and "
                         "backbone-symbol.json), not a checkpoint folder")
    if saved != meta["step"]:
        raise CleanError(f"{work_dir}'s backbone-symbol.json/-0000.params are of step {saved}, "
                         f"its newest checkpoint {path} of step {meta['step']}: the cleaning "
                         "needs the backbone of the same step as the centers. Resume the run "
                         "to its end (it saves both), or move the newer checkpoints aside")
    k = checkpoint.subcenters_of(meta)
    if k == 1:
        notes.append(f"{path} was trained with one center per class: each class center is "
                     "its one sub-center (samples far from their class center are dropped)")
    return Trained(path, meta, k, notes)


def backbone_step(work_dir: Path) -> int | None:
    try:
        return json.loads((Path(work_dir) / "backbone.json").read_text()).get("step")
    except (OSError, ValueError):
        return None


def open_trained_dataset(rec: str | list[str], trained: Trained, out: Path, work_dir: Path):
    """The dataset, if it is the one the run trained on (its classes, and where the
    checkpoint recorded them, its images and train.idx fingerprints) and OUT is a
    folder of its own."""
    refuse_out(out, [*(rec if isinstance(rec, list) else [rec]), work_dir])
    dataset = JoinedDataset(rec) if isinstance(rec, list) else RecordDataset(rec)
    meta, name = trained.meta, " + ".join(rec) if isinstance(rec, list) else rec
    recorded = meta.get("dataset")
    now = identity_of(dataset)
    if dataset.num_classes != meta["num_classes"] or (recorded and recorded != now):
        what = (f"{recorded['classes']} classes, {recorded['images']} images" if recorded
                else f"{meta['num_classes']} classes")
        raise CleanError(f"{name} holds {now['classes']} classes and {now['images']} images "
                         f"(train.idx {now['index']}); {trained.checkpoint} was trained on "
                         f"{what}{' with other train.idx files' if recorded else ''}: give "
                         "the dataset (or the `rec` list, in its order) the run trained on")
    return dataset


def refuse_out(out: Path, inputs: list) -> None:
    """OUT must not be an input (the dataset would be replaced by its cleaned copy) nor
    hold a dataset that is not an earlier cleaning's (it would be overwritten)."""
    for path in map(Path, inputs):
        if out.exists() and path.exists() and os.path.samefile(out, path):
            raise CleanError(f"OUT {out} is {path}, an input of the cleaning: write the "
                             "cleaned dataset to a folder of its own")
    cleaned_before = (out / REPORT).exists() or (out / CHUNKS / PLAN).exists()
    if (out / "train.rec").exists() and not cleaned_before:
        raise CleanError(f"{out} holds a dataset (train.rec) that no cleaning wrote: give "
                         "an empty or new folder for the cleaned dataset")


# ----- chunks -----
def plan_chunks(images: int, chunk: int) -> list[range]:
    """The dataset's positions in chunks of `chunk` images."""
    return [range(low, min(low + chunk, images)) for low in range(0, images, chunk)]


def plan_of(trained: Trained, dataset, chunk: int) -> dict:
    """What the chunk files depend on: a rerun with any of it changed embeds again."""
    return {"checkpoint": str(trained.checkpoint.resolve()), "step": trained.meta["step"],
            "files": trained.meta.get("files"), "dataset": identity_of(dataset), "chunk": chunk}


def start_plan(folder: Path, plan: dict) -> None:
    """Keep the chunks of an interrupted run of the same plan; clear any other's."""
    path = folder / PLAN
    if path.is_file() and json.loads(path.read_text()) == plan:
        return
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    durable.write_atomically(path, lambda p: p.write_text(json.dumps(plan)))


def see_plan(folder: Path, plan: dict) -> None:
    """Every rank sees rank 0's plan: OUT must be on a file system all ranks share."""
    path = folder / PLAN
    try:
        seen = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise CleanError(f"{path} (written by rank 0) cannot be read here ({error}): OUT "
                         "must be a folder every host sees (a shared file system)") from error
    if seen != plan:
        raise CleanError(f"{path} describes another cleaning than this rank's: every rank "
                         "must see the same work dir, dataset and OUT")


def chunk_file(folder: Path, c: int) -> Path:
    return folder / f"chunk_{c:06d}.npz"


def read_chunk(folder: Path, c: int) -> dict:
    with np.load(chunk_file(folder, c), allow_pickle=False) as data:
        return {name: data[name] for name in data.files}


def embed_and_count(work_dir: Path, trained: Trained, dataset, chunks: list[range],
                    mine: list[int], folder: Path, ctx: mx.Context, batch_size: int
                    ) -> np.ndarray:
    """Each of this rank's chunks not done yet, embedded and compared with its classes'
    sub-centers, written atomically; then how often each sub-center is the nearest
    over all of this rank's chunks (num_classes x K)."""
    todo = [c for c in mine if not chunk_file(folder, c).is_file()]
    if todo:
        forward = mxnet_forward(load_backbone(work_dir, ctx), ctx)
        centers = CheckpointSubcenters(trained)
        for c in todo:
            labels, embeddings = embed_positions(dataset, chunks[c], forward, batch_size)
            cosines = dominant.own_class_cosines(embeddings, labels, centers.of(labels))
            positions = np.arange(chunks[c].start, chunks[c].stop)

            def write(path: Path, labels=labels, cosines=cosines, positions=positions) -> None:
                with open(path, "wb") as f:
                    np.savez(f, positions=positions, labels=labels, cosines=cosines)
            durable.write_atomically(chunk_file(folder, c), write)
    counts = np.zeros((trained.meta["num_classes"], trained.subcenters), np.int64)
    for c in mine:
        part = read_chunk(folder, c)
        counts += dominant.pick_counts(part["labels"], part["cosines"], len(counts))
    return counts


def embed_positions(dataset, positions: range, forward, batch_size: int) -> tuple:
    """(labels, embeddings) of the images at `positions`, `batch_size` at a time, each
    embedding the sum of the image's and its mirror image's."""
    ids = dataset.record_ids(np.arange(positions.start, positions.stop))
    labels, embeddings = np.empty(len(ids), np.int64), []
    for low in range(0, len(ids), batch_size):
        faces, undecodable = [], []
        for i, record_id in enumerate(ids[low:low + batch_size], start=low):
            record = dataset.records.read(int(record_id))
            labels[i] = class_of(record, dataset, trained_classes=dataset.num_classes)
            face, _ = decode_face(record.image)
            undecodable.append(face is None)
            faces.append(np.zeros((112, 112, 3), np.uint8) if face is None else face)
        batch = flip_sum(forward, to_network_input(np.stack(faces)))
        batch[np.array(undecodable)] = np.nan  # not scored: dropped, counted in the report
        embeddings.append(batch)
    return labels, np.concatenate(embeddings)


def class_of(record, dataset, trained_classes: int) -> int:
    """A record's class id, or a DataError naming it (a label the run cannot have
    trained on)."""
    label = record.label
    if not valid_class_ids([label], trained_classes)[0]:
        raise DataError(f"{dataset.records.where(record.record_id)} has label {label}, not a "
                        f"class id in [0, {trained_classes}): re-pack the dataset")
    return int(label)


class CheckpointSubcenters:
    """The checkpoint's center rows of any classes, read from its memory-mapped shards
    (no rank loads the whole matrix): class c's K sub-centers."""

    def __init__(self, trained: Trained) -> None:
        meta, self.k = trained.meta, trained.subcenters
        width = meta["embedding_size"]
        self.starts = np.array([start for start, _ in meta["shards"]])
        self.shards = [checkpoint.saved_rows(
            trained.checkpoint / checkpoint.center_file(r, "weight"), (count * self.k, width))
            for r, (_, count) in enumerate(meta["shards"])]

    def of(self, labels: np.ndarray) -> np.ndarray:
        """(n x K x D) float32: the sub-centers of each label's class."""
        shard = np.searchsorted(self.starts, labels, side="right") - 1
        out = np.empty((len(labels), self.k, self.shards[0].shape[1]), np.float32)
        for r in np.unique(shard):
            rows = (labels[shard == r] - self.starts[r])[:, None] * self.k + np.arange(self.k)
            out[shard == r] = self.shards[r][rows.reshape(-1)].reshape(-1, self.k, out.shape[2])
        return out


# ----- the kept records -----
def write_kept(out: Path, folder: Path, dataset, chunks: list[range], counts: np.ndarray,
               angle: float, trained: Trained) -> dict:
    """OUT's dataset of the kept records, labels.txt and the report (rank 0)."""
    started = time.time()
    dominant_of = dominant.dominant(counts)
    kept_positions, kept_labels, degrees, labels = [], [], [], []
    for c in range(len(chunks)):
        part = read_chunk(folder, c)
        part_degrees = dominant.angles(part["labels"], part["cosines"], dominant_of)
        keep = part_degrees <= angle
        kept_positions.append(part["positions"][keep])
        kept_labels.append(part["labels"][keep])
        degrees.append(part_degrees.astype(np.float32))
        labels.append(part["labels"])
    positions, kept = np.concatenate(kept_positions), np.concatenate(kept_labels)
    if len(kept) == 0:
        raise CleanError(f"no image is within {angle:g} degrees of its class's dominant "
                         f"sub-center ({trained.checkpoint}): nothing to write. Is the run "
                         "trained? A larger --angle keeps more")
    for stale in (out / REPORT, out / LABELS):  # an earlier cleaning's: the report is last
        stale.unlink(missing_ok=True)
    order = np.argsort(kept, kind="stable")  # by class, in record order within one
    write_records(out, kept_records(dataset, positions[order]), trained.meta["num_classes"])
    old_ids = np.unique(kept)
    durable.write_atomically(out / LABELS, lambda p: p.write_text(
        "".join(f"{new} {old}\n" for new, old in enumerate(old_ids.tolist()))))
    report = summary(np.concatenate(labels), np.concatenate(degrees), angle, trained,
                     len(old_ids), time.time() - started)
    durable.write_atomically(out / REPORT, lambda p: p.write_text(json.dumps(report, indent=1)))
    return report


def kept_records(dataset, positions: np.ndarray) -> Iterator[tuple[int, bytes]]:
    """(old label, encoded image) of each kept record, unchanged bytes."""
    for record_id in dataset.record_ids(positions):
        record = dataset.records.read(int(record_id))
        yield int(record.label), record.image


def summary(labels: np.ndarray, degrees: np.ndarray, angle: float, trained: Trained,
            classes_kept: int, seconds: float) -> dict:
    """What the report says: images and classes kept, the angles' histogram, and the
    classes that lost the most images."""
    num_classes = trained.meta["num_classes"]
    scored = np.isfinite(degrees)  # an undecodable image or a non-finite embedding: not
    dropped = np.bincount(labels[~(degrees <= angle)], minlength=num_classes)
    total = np.bincount(labels, minlength=num_classes)
    worst = np.argsort(-dropped, kind="stable")[:20]
    return {"checkpoint": str(trained.checkpoint), "num_subcenters": trained.subcenters,
            "angle": angle, "images": int(len(labels)),
            "images_kept": int((degrees <= angle).sum()),
            "images_not_scored": int((~scored).sum()), "classes": num_classes,
            "classes_kept": classes_kept, "notes": trained.notes,
            "angle_histogram": dominant.histogram(degrees[scored]),
            "most_affected_classes": [{"class": int(c), "dropped": int(dropped[c]),
                                       "images": int(total[c])}
                                      for c in worst if dropped[c] > 0],
            "write_seconds": round(seconds, 1)}
