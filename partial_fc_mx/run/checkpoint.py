"""Checkpoints that survive crashes, power loss and changes of world size.

    work_dir/checkpoints/step_000120/
        meta.json                      progress, world size, class count, shard ranges,
                                       the margin and its state (AdaFace's statistics),
                                       the centers' optimizer and its states, and every
                                       file below with its size and CRC-32
        backbone.params                backbone weights and BatchNorm statistics
        backbone_optimizer.npz         the backbone optimizer's state (no pickle)
        rank_{r}_softmax_weight.npy    rank r's class centers (rows start..stop of C x D;
                                       with K sub-centers, rows start K..stop K of CK x D)
        rank_{r}_softmax_weight_{state}.npy  each state of the centers' optimizer, one
                                       row per center (SGD: _mom, AdamW: _mean, _var,
                                       _steps)
        rank_{r}_sampler.json          rank r's negative-sampling generator state
    work_dir/backbone-symbol.json, backbone-0000.params   the backbone for inference

A backbone imported from another framework (import-backbone) is a checkpoint of step
0 holding backbone.params alone, its meta.json marked "backbone_only": --load-from
takes it and draws fresh class centers; --resume-from refuses it.

Every rank checks that its weights are finite, writes and fsyncs its files into
`.step_000120.partial/`, and reports their sizes and checksums; rank 0 writes
meta.json, fsyncs the directory and renames it. A crash at any point leaves either
no new checkpoint or a complete one, and never touches the previous ones. Every
rank writes into the same directory: `work_dir` must be shared by all hosts
(workdir.py checks it at start-up).

Resuming takes the newest checkpoint that verifies (every listed file present,
of its size and checksum), naming each one it skips and why. On another number
of processes each new rank cuts its rows out of the old shards, the weights and
every state alike (memory-mapped, so no rank loads the whole matrix).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import mxnet as mx
import numpy as np

from .. import dist, durable
from ..backbones import graph_of
from ..backbones.layout import load_parameters
from ..errors import UserError
from ..evaluation.validator import Validator
from ..pfc.centers import HOST_CHUNK_ELEMENTS, shard_of
from ..pfc.partial_fc import PartialFC
from .backbone_optimizer import load_trainer_state, save_trainer_state
from .precision import all_finite

CHECKPOINTS = "checkpoints"
BACKBONE, OPTIMIZER, META = "backbone.params", "backbone_optimizer.npz", "meta.json"
FORMAT = 5  # meta.json's "format": bumped when the layout above changes
# 4: the best accuracy and its step under "validator" (format 3 kept them at the top)
# 5: backbone-only checkpoints (import-backbone)
SGD_STATES = ["mom"]
"""The center states of a checkpoint whose meta.json names none (formats 1 and 2)."""


@dataclass
class TrainState:
    """Where a run stands: everything a resume needs besides the weights."""

    step: int = 0
    """Optimizer steps done (names checkpoints; 'Global Step' in training.log)."""
    epoch: int = 0
    images_in_epoch: int = 0
    """Images of this epoch's global order already trained on (all ranks together)."""
    images_seen: int = 0
    reference_batch: int = 0
    """The global batch the run started with; max_steps and lr_steps count its steps."""
    loss_scale: float = 1.0

    def advance(self, global_batch: int, epoch_images: int, steps: int = 1) -> None:
        """Count `steps` global batches as trained on; once no full global batch is
        left in the epoch, move to the next one (the rest of this one is dropped)."""
        self.images_seen += steps * global_batch
        self.images_in_epoch += steps * global_batch
        if epoch_images - self.images_in_epoch < global_batch:
            self.epoch, self.images_in_epoch = self.epoch + 1, 0


class CheckpointError(UserError, ValueError):
    """A checkpoint that cannot be written or used; the message says why."""


def checkpoint_name(step: int) -> str:
    return f"step_{step:06d}"


def step_of(path: Path) -> int | None:
    match = re.fullmatch(r"step_(\d+)", path.name)
    return int(match.group(1)) if match else None


def checkpoints(work_dir: str | os.PathLike) -> list[Path]:
    """The checkpoint directories of a work dir, oldest first, by step number
    (not by name: step_1000000 sorts before step_999000 as a string)."""
    root = Path(work_dir) / CHECKPOINTS
    found = [p for p in root.glob("step_*") if p.is_dir() and step_of(p) is not None]
    return sorted(found, key=step_of)


def center_file(rank: int, name: str) -> str:
    """The .npy of rank `rank`'s center array `name` ("weight" or an optimizer state)."""
    return f"rank_{rank}_softmax_weight{'' if name == 'weight' else '_' + name}.npy"


def sampler_file(rank: int) -> str:
    return f"rank_{rank}_sampler.json"


def center_states(meta: dict) -> list[str]:
    """The optimizer states a checkpoint holds files of (names checked: they name files)."""
    return [plain_name(name) for name in meta.get("center_states", SGD_STATES)]


def plain_name(name) -> str:
    """`name` if it is a file name meta.json may list: no directory, nothing hidden."""
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", name):
        raise ValueError(f"{name!r} is not a plain file or state name")
    return name


# ----- saving -----
def save(work_dir: Path, state: TrainState, net, trainer, pfc: PartialFC,
         validator: Validator, world: dist.World, keep: int,
         datasets: list | None = None, dataset: dict | None = None) -> Path:
    """Write a checkpoint of `state` on every rank; returns its directory. Any rank's
    failure (a full disk, a non-finite weight) is raised on every rank. `datasets`: the
    composition of a `rec` list (data/joined.py), which a resume must repeat;
    `dataset`: what `clean` recognises the training set by (data_source.identity_of)."""
    pfc.centers.bring_all_current()  # the exact update: the rows a dense run would save
    settle()
    refuse_non_finite(net, pfc, state.step, work_dir)
    root = Path(work_dir) / CHECKPOINTS
    final = root / checkpoint_name(state.step)
    partial = root / f".{final.name}.partial"

    def prepare() -> None:
        remove_stale(root)
        partial.mkdir(parents=True)

    agreed(prepare, "checkpoint.start", f"could not start checkpoint {partial}", world.is_main)
    files = agreed(lambda: write_rank_files(partial, net, trainer, pfc, world),
                   "checkpoint.written", f"could not write checkpoint {partial}")
    table = {}
    for part in dist.allgather_object(files, name="checkpoint.files"):
        table.update(part)

    def finish() -> None:
        meta = {"format": FORMAT, **asdict(state), "world_size": world.size,
                "num_classes": pfc.num_classes, "embedding_size": pfc.embedding_size,
                "num_subcenters": pfc.subcenters,
                "shards": [list(asdict(shard_of(pfc.num_classes, r, world.size)).values())
                           for r in range(world.size)],
                "margin": {"name": pfc.margin.name, "state": pfc.margin.state_dict()},
                "center_optimizer": pfc.centers.optimizer.name,
                "center_update": pfc.center_update,
                "center_states": pfc.centers.state_names(),
                "validator": validator.state_dict(),
                **({"datasets": datasets} if datasets else {}),
                **({"dataset": dataset} if dataset else {}),
                "files": dict(sorted(table.items()))}
        durable.write_file(partial / META, lambda f: f.write(json.dumps(meta, indent=1)
                                                             .encode()))
        publish(partial, final)
        prune(work_dir, state.step, keep)
        save_backbone(net, Path(work_dir) / "backbone", {"step": state.step})

    agreed(finish, "checkpoint.done", f"could not finish checkpoint {final}", world.is_main)
    return final


def settle() -> None:
    """Wait for every queued MXNet operation before reading weights to save them: the
    BatchNorm statistics a hybridized (static_alloc) training forward updates are not
    ordered before a copy queued after it (seen: a backbone saved right after a
    forward held the old statistics)."""
    mx.nd.waitall()


def agreed(action, name: str, context: str, on: bool = True):
    """`action` where `on`; a failure on any rank is a CheckpointError on every rank."""
    return dist.run_agreed(action, name, (CheckpointError,), CheckpointError, context, on)


def refuse_non_finite(net, pfc: PartialFC, step: int, work_dir: Path) -> None:
    """Never save weights a diverging update made non-finite (the loss is checked
    before the update, so it cannot catch them): every rank checks its copy of the
    backbone and its shard of the centers; all ranks raise together."""
    arrays = {f"backbone parameter {name}": param.data()
              for name, param in net.collect_params().items()}
    arrays = {name: [array] for name, array in arrays.items()}
    arrays.update({("class centers" if name == "weight" else f"class-center state {name}"):
                   blocks for name, blocks in pfc.centers.arrays().items()})
    error = None
    if not all_finite([part for parts in arrays.values() for part in parts]):
        bad = [name for name, parts in arrays.items() if not all_finite(parts)]
        previous = checkpoints(work_dir)
        kept = (f"the last good checkpoint, {previous[-1]}, is untouched: lower lr or set "
                "clip_grad, then resume with --resume-from" if previous else
                "no checkpoint was written before: lower lr or set clip_grad")
        error = CheckpointError(
            f"the weights became non-finite (NaN/Inf) at step {step}: {', '.join(bad[:4])}"
            f"{f' and {len(bad) - 4} more' if len(bad) > 4 else ''}; not saving them; {kept}")
    dist.raise_on_every_rank(error, name="checkpoint.finite")


def write_rank_files(directory: Path, net, trainer, pfc: PartialFC,
                     world: dist.World) -> dict:
    """This rank's files, written and fsynced; {name: {"bytes", "crc32"}}."""
    sampler = json.dumps(pfc.centers.rng.bit_generator.state).encode()
    files = {sampler_file(world.rank): durable.write_file(
        directory / sampler_file(world.rank), lambda f: f.write(sampler))}
    for name, blocks in pfc.centers.arrays().items():
        files[center_file(world.rank, name)] = durable.write_file(
            directory / center_file(world.rank, name),
            lambda f, blocks=blocks: save_rows(f, blocks))
    if world.is_main:
        files[BACKBONE] = durable.written_by(directory / BACKBONE, net.save_parameters)
        files[OPTIMIZER] = durable.written_by(directory / OPTIMIZER,
                                              lambda path: save_trainer_state(trainer, path))
    return files


def save_rows(file, blocks: list[mx.nd.NDArray]) -> None:
    """The blocks of one center array as one .npy of their rows, copied to the host a
    part at a time (a shard can be larger than the host's free memory twice over)."""
    width, dtype = blocks[0].shape[1], np.dtype(blocks[0].dtype)
    rows = sum(block.shape[0] for block in blocks)
    np.lib.format.write_array_header_1_0(file, {
        "descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False,
        "shape": (rows, width)})
    step = max(1, HOST_CHUNK_ELEMENTS // width)
    for block in blocks:
        for low in range(0, block.shape[0], step):
            file.write(block[low:low + step].asnumpy().tobytes())


def publish(partial: Path, final: Path) -> None:
    """Rename the finished directory into place. A directory already there (copied in
    by hand: a run never saves a step twice) is moved aside, never deleted."""
    if final.exists():
        stamp = time.strftime("%Y%m%d-%H%M%S")
        os.replace(final, final.with_name(f"{final.name}.replaced-{stamp}"))
    durable.replace(partial, final)


def prune(work_dir: Path, step: int, keep: int) -> None:
    """Keep the newest `keep` checkpoints up to `step`. Each old one is renamed out of
    sight first, so a kill during the deletion never leaves a half-deleted directory
    that looks like a checkpoint."""
    mine = [p for p in checkpoints(work_dir) if step_of(p) <= step]
    for old in mine[:-keep]:
        doomed = old.with_name(f".{old.name}.deleting")
        os.replace(old, doomed)
        shutil.rmtree(doomed, ignore_errors=True)


def remove_stale(root: Path) -> None:
    """Leftovers of saves and deletions that were killed (each may hold a full copy of
    the centers); none of them is a checkpoint."""
    for stale in [*root.glob(".step_*.partial"), *root.glob(".step_*.deleting")]:
        shutil.rmtree(stale, ignore_errors=True)


def set_aside(work_dir: Path, newer_than: int = -1) -> Path | None:
    """Move the checkpoints past step `newer_than` (all, for a run starting at step 0)
    to checkpoints-before-<time>/. A run's own saves must be its newest checkpoints:
    otherwise pruning would delete them in favour of another run's higher steps, and a
    later resume would pick that run."""
    newer = [p for p in checkpoints(work_dir) if step_of(p) > newer_than]
    if not newer:
        return None
    aside = Path(work_dir) / f"{CHECKPOINTS}-before-{time.strftime('%Y%m%d-%H%M%S')}"
    aside.mkdir()
    for path in newer:
        os.replace(path, aside / path.name)
    durable.fsync_path(Path(work_dir) / CHECKPOINTS)
    return aside


def save_backbone(net, prefix: str | os.PathLike, record: dict | None = None) -> None:
    """`prefix`-symbol.json and `prefix`-0000.params for inference, in net.export's
    format, each written under a temporary name and renamed durably, so a crash never
    leaves a half-written backbone behind a good name; then `record` (its step) as
    `prefix`.json, which `eval` names.

    The graph comes from calling `net` on a symbol, not from the graph cached by a
    forward pass (net.export's): the float32 network of a mixed-precision run never
    runs forward, and its graph has no AMP casts for ONNX to choke on, nor a ViT's
    training-only operators."""
    prefix = Path(prefix)
    tmp = prefix.with_name(f".{prefix.name}.partial")
    if record is not None:  # a crash below leaves no record naming the previous step
        prefix.with_name(f"{prefix.name}.json").unlink(missing_ok=True)
    settle()
    graph = graph_of(net, training=False)
    auxiliary, used = set(graph.list_auxiliary_states()), set(graph.list_inputs())
    graph.save(f"{tmp}-symbol.json")
    mx.nd.save(f"{tmp}-0000.params",  # a ViT's mask token serves training only
               {f"{'aux' if name in auxiliary else 'arg'}:{name}": param.data().copyto(mx.cpu())
                for name, param in net.collect_params().items() if name in used})
    for suffix in ("-symbol.json", "-0000.params"):
        durable.replace(f"{tmp}{suffix}", f"{prefix}{suffix}")
    if record is not None:
        durable.write_atomically(prefix.with_name(f"{prefix.name}.json"),
                                 lambda path: path.write_text(json.dumps(record)))


def save_imported(work_dir: Path, net, record: dict) -> Path:
    """A backbone-only checkpoint of step 0 in work_dir, and its inference files;
    `record` (where it came from) goes into both records. A work dir that holds
    checkpoints already is refused: --load-from would take its newest, not this one."""
    refuse_used_work_dir(work_dir)
    root = Path(work_dir) / CHECKPOINTS
    final = root / checkpoint_name(0)
    partial = root / f".{final.name}.partial"
    remove_stale(root)
    partial.mkdir(parents=True)
    files = {BACKBONE: durable.written_by(partial / BACKBONE, net.save_parameters)}
    meta = {"format": FORMAT, "step": 0, "backbone_only": True, **record, "files": files}
    durable.write_file(partial / META, lambda f: f.write(json.dumps(meta, indent=1).encode()))
    publish(partial, final)
    save_backbone(net, Path(work_dir) / "backbone", {"step": 0, **record})
    return final


def refuse_used_work_dir(work_dir: str | os.PathLike) -> None:
    if checkpoints(work_dir):
        raise CheckpointError(f"{work_dir} holds checkpoints of a run already: import into "
                              "a new work dir")


# ----- verifying -----
def verify(checkpoint: Path, rank: int = 0, world_size: int = 1,
           weights_only: bool = False) -> list[str]:
    """What is wrong with a checkpoint, [] when nothing. Every rank checks every
    file's size and the checksums of its share of the files (i % world_size).
    `weights_only` (--load-from) also accepts the first format, which listed no files:
    its backbone and shards are read without checksums (none of them is a pickle)."""
    try:
        meta = json.loads((checkpoint / META).read_text())
        if int(meta.get("format", 1)) > FORMAT:
            return [f"{checkpoint} was written by a newer version of partial_fc_mx (format "
                    f"{meta['format']}; this one reads up to {FORMAT})"]
        if meta.get("backbone_only") and not weights_only:
            return [f"{checkpoint} holds an imported backbone only: train from it with "
                    "--load-from, not --resume-from"]
        saved_world = 0 if meta.get("backbone_only") else int(meta["world_size"])
        if weights_only and "files" not in meta:
            return [f"{checkpoint / name} is missing" for name in weight_files(saved_world)
                    if not (checkpoint / name).is_file()]
        files = {plain_name(name): (int(r["bytes"]), int(r["crc32"]))
                 for name, r in meta["files"].items()}
        expected = [BACKBONE] if meta.get("backbone_only") else [
            OPTIMIZER, BACKBONE, *(name for r in range(saved_world) for name in [
                sampler_file(r), *(center_file(r, n) for n in ["weight", *center_states(meta)])])]
    except FileNotFoundError:
        return [f"{checkpoint / META} is missing"]
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        return [f"{checkpoint / META} is damaged or from an older version ({error!r}); "
                "an older checkpoint can be used with --load-from (weights only)"]
    problems = [f"{checkpoint / name} is not listed in meta.json" for name in expected
                if name not in files]
    for i, (name, (size, crc)) in enumerate(sorted(files.items())):
        path = checkpoint / name
        actual = path.stat().st_size if path.is_file() else None
        if actual is None:
            problems.append(f"{path} is missing")
        elif actual != size:
            problems.append(f"{path} has {actual} bytes, meta.json says {size} (truncated?)")
        elif i % world_size == rank and durable.file_record(path)["crc32"] != crc:
            problems.append(f"{path} does not match its checksum in meta.json (damaged)")
    return problems


def weight_files(world_size: int) -> list[str]:
    """What a first-format checkpoint (SGD, no file list) must hold for --load-from."""
    return [BACKBONE, *(center_file(r, n) for r in range(world_size)
                        for n in ["weight", *SGD_STATES])]


def find_resumable(path: str | os.PathLike, world: dist.World,
                   weights_only: bool = False) -> tuple[Path, list[str]]:
    """The checkpoint to resume from and notes on those skipped, the same on every rank.

    `path` is a checkpoint (it must verify) or a work dir: then the newest of its
    checkpoints that verifies, skipping damaged ones (a save cut off by a power
    loss, a truncated copy). Rank 0's listing is used by all ranks.
    """
    path = Path(path)
    listing = None  # rank 0's: a network file system may show the ranks different lists
    if world.is_main:
        explicit = (path / META).exists() or step_of(path) is not None
        listing = [str(path)] if explicit else [str(p) for p in reversed(checkpoints(path))]
    candidates = dist.allgather_object(listing, name="resume.candidates")[0]
    notes = []
    for candidate in map(Path, candidates):
        problems = dist.allgather_object(
            verify(candidate, world.rank, world.size, weights_only), name="resume.verify")
        problems = sorted({p for rank_problems in problems for p in rank_problems})
        if not problems:
            return candidate, notes
        notes.append(f"skipped checkpoint {candidate}: {'; '.join(problems)}")
    if not candidates:
        raise CheckpointError(f"no checkpoint in {path} (looked for {path}/{META} and "
                              f"{path}/{CHECKPOINTS}/step_*/{META})")
    raise CheckpointError("no checkpoint verifies: " + " | ".join(notes))


# ----- loading -----
def read_meta(checkpoint: Path, pfc: PartialFC, weights_only: bool = False) -> dict:
    """meta.json, if this run can take the checkpoint: the same classes and embedding
    size, and (to resume) the centers' optimizer the checkpoint keeps the states of."""
    meta = json.loads((checkpoint / META).read_text())
    if meta.get("backbone_only"):
        if meta["embedding_size"] != pfc.embedding_size:
            raise CheckpointError(
                f"{checkpoint} holds a backbone of {meta['embedding_size']}-d embeddings "
                f"({meta.get('imported_from', 'imported')}); this run has "
                f"embedding_size={pfc.embedding_size}")
        return meta
    if (meta["num_classes"], meta["embedding_size"]) != (pfc.num_classes, pfc.embedding_size):
        raise CheckpointError(
            f"{checkpoint} holds {meta['num_classes']} x {meta['embedding_size']} class centers "
            f"but this run has num_classes={pfc.num_classes}, "
            f"embedding_size={pfc.embedding_size}")
    saved = meta.get("center_optimizer", "sgd")
    if not weights_only and saved != pfc.centers.optimizer.name:
        raise CheckpointError(
            f"{checkpoint} was trained with center_optimizer={saved!r}; this run has "
            f"center_optimizer={pfc.centers.optimizer.name!r}. Resume with {saved!r}, or "
            f"start {pfc.centers.optimizer.name!r} afresh from its weights with --load-from")
    saved_k = subcenters_of(meta)
    if saved_k != pfc.subcenters and (not weights_only or saved_k != 1):
        how = ("start a run with sub-centers from it with --load-from (each class's row "
               "becomes its sub-centers)" if saved_k == 1 else
               "find each class's dominant sub-center and clean the data with `python -m "
               "partial_fc_mx clean`, then train the cleaned data afresh")
        raise CheckpointError(
            f"{checkpoint} holds {saved_k} sub-center(s) per class; this run has "
            f"num_subcenters={pfc.subcenters}. Continue it with num_subcenters={saved_k}, "
            f"or {how}")
    if not weights_only and sorted(center_states(meta)) != pfc.centers.state_names():
        raise CheckpointError(
            f"{checkpoint} holds the center states {center_states(meta)}; "
            f"{pfc.centers.optimizer.name} keeps {pfc.centers.state_names()}: it is damaged "
            "or from another version (its weights can be used with --load-from)")
    return meta


def subcenters_of(meta: dict) -> int:
    """Sub-centers per class of a checkpoint (1 before they were recorded)."""
    return int(meta.get("num_subcenters", 1))


def update_change(checkpoint: Path, pfc: PartialFC) -> str | None:
    """A note for the log when a resumed run updates the centers it does not sample
    otherwise than the checkpoint's run did. Every checkpoint holds current rows, so any
    rule can continue from it; but a changed default (lazy, before "auto") must not pass
    unnoticed."""
    saved = json.loads((checkpoint / META).read_text()).get("center_update")
    if saved == pfc.center_update:
        return None
    was = (f"was trained with center_update={saved!r}" if saved else
           "was saved before the update rule was recorded (the default then: 'lazy')")
    return (f"{checkpoint} {was}; this run continues with center_update="
            f"{pfc.center_update!r} (set center_update in the config to choose)")


def load_centers(checkpoint: Path, meta: dict, pfc: PartialFC, with_states: bool,
                 sampler: dict | None = None) -> None:
    """This rank's rows of the centers (and of every optimizer state), cut from the
    saved shards by classes (a class's sub-centers stay together); without states, the
    optimizer starts afresh. `sampler`: the generator state to continue (None: keep
    the current stream). A checkpoint of one row per class under a run of K
    sub-centers (--load-from; read_meta allows no other change) gives each class K
    rows from its one (SubcenterRows)."""
    widths = pfc.centers.widths()
    names = ["weight", *(center_states(meta) if with_states else [])]
    parts = {name: [] for name in names}
    mine, k = pfc.shard, subcenters_of(meta)
    for rank, (start, count) in enumerate(meta["shards"]):
        low, high = max(start, mine.start), min(start + count, mine.stop)
        if low >= high:
            continue
        for name in names:
            saved = saved_rows(checkpoint / center_file(rank, name), (count * k, widths[name]))
            parts[name].append(saved[(low - start) * k:(high - start) * k])
    rows = {name: JoinedRows(p) for name, p in parts.items()}
    if k != pfc.subcenters:
        rows = {"weight": SubcenterRows(rows["weight"], pfc.subcenters, mine.start, pfc.seed)}
    try:
        pfc.centers.load_state_dict({**rows, **({"sampler": sampler} if sampler else {})})
    except ValueError as error:
        raise CheckpointError(f"{checkpoint}: {error}") from error


class JoinedRows:
    """Consecutive row ranges of saved shards (memory-mapped) as one matrix: sliced by
    rows it stays a view, and only np.asarray reads and joins the rows. A rank's rows
    of a 10M-class checkpoint reach its blocks a chunk at a time (CenterBlock.load)."""

    def __init__(self, parts: list[np.ndarray]) -> None:
        self.parts = [part for part in parts if len(part)] or parts[:1]
        self.starts = np.cumsum([0] + [len(part) for part in self.parts])
        self.shape = (int(self.starts[-1]), *(parts[0].shape[1:] if parts else (0,)))

    def __getitem__(self, rows: slice) -> JoinedRows:
        low, high, _ = rows.indices(self.shape[0])
        return JoinedRows([part[max(low - start, 0):max(min(high - start, len(part)), 0)]
                           for part, start in zip(self.parts, self.starts[:-1])])

    def __array__(self, dtype=None) -> np.ndarray:
        joined = np.concatenate(self.parts) if len(self.parts) > 1 else np.asarray(self.parts[0])
        return joined if dtype is None else joined.astype(dtype, copy=False)


class SubcenterRows:
    """A shard's rows of one center per class as rows of K sub-centers each, for
    --load-from into a sub-center run: sub-center 0 of a class is its saved row, each
    other one that row turned by about 5.7 degrees (the row plus SUBCENTER_SPREAD times
    its norm along a random unit direction, drawn from (seed, class block): the same
    on any world size). Identical sub-centers would tie for every sample, and the first
    would take every gradient. Sliced by rows it stays a view, as JoinedRows: only
    np.asarray makes the rows (a block loads a chunk at a time: CenterBlock.load)."""

    def __init__(self, classes: JoinedRows, k: int, first_class: int, seed: int,
                 rows: slice | None = None) -> None:
        self.classes, self.k, self.first_class, self.seed = classes, k, first_class, seed
        self.rows = rows or slice(0, classes.shape[0] * k)
        self.shape = (self.rows.stop - self.rows.start, classes.shape[1])

    def __getitem__(self, rows: slice) -> SubcenterRows:
        low, high, _ = rows.indices(self.shape[0])
        start = self.rows.start
        return SubcenterRows(self.classes, self.k, self.first_class, self.seed,
                             slice(start + low, start + max(high, low)))

    def __array__(self, dtype=None) -> np.ndarray:
        low, high = self.rows.start, self.rows.stop
        first, last = low // self.k, -(-high // self.k)  # the classes the rows are of
        base = np.asarray(self.classes[first:last], dtype=np.float32)
        turned = np.repeat(base, self.k, axis=0)
        turned += SUBCENTER_SPREAD * np.linalg.norm(turned, axis=1, keepdims=True) * \
            self.directions(self.first_class + first, len(base))
        turned[::self.k] = base  # sub-center 0: the row itself
        rows = turned[low - first * self.k:high - first * self.k]
        return rows if dtype is None else rows.astype(dtype, copy=False)

    def directions(self, first_class: int, count: int) -> np.ndarray:
        """Unit directions for every sub-center of `count` classes from `first_class`,
        drawn per block of SUBCENTER_BLOCK classes."""
        out = np.empty((count * self.k, self.shape[1]), np.float32)
        stop = first_class + count
        for block in range(first_class // SUBCENTER_BLOCK, (stop - 1) // SUBCENTER_BLOCK + 1):
            drawn = np.random.default_rng([self.seed, 2039, block]).standard_normal(
                (SUBCENTER_BLOCK * self.k, self.shape[1]), dtype=np.float32)
            low, high = max(block * SUBCENTER_BLOCK, first_class), min(
                (block + 1) * SUBCENTER_BLOCK, stop)
            offset = block * SUBCENTER_BLOCK
            out[(low - first_class) * self.k:(high - first_class) * self.k] = \
                drawn[(low - offset) * self.k:(high - offset) * self.k]
        out /= np.linalg.norm(out, axis=1, keepdims=True)
        return out


SUBCENTER_SPREAD = 0.1
"""How far a loaded class's other sub-centers start from its row, in its norm."""
SUBCENTER_BLOCK = 1024
"""Classes per random block of those directions."""


def saved_rows(path: Path, shape: tuple) -> np.ndarray:
    """A saved shard, memory-mapped: a float array of the shape meta.json records, or a
    CheckpointError (never unpickled: .npy files can hold pickled objects)."""
    try:
        rows = np.load(path, mmap_mode="r", allow_pickle=False)
    except ValueError as error:
        raise CheckpointError(f"{path} holds no plain array of numbers ({error}); it is not "
                              "a shard this program wrote") from error
    if not isinstance(rows, np.ndarray):  # an .npz archive under an .npy name
        raise CheckpointError(f"{path} is not a .npy array file; it is not a shard this "
                              "program wrote")
    if rows.dtype.kind != "f" or rows.shape != tuple(shape):
        raise CheckpointError(f"{path} holds a {rows.dtype} array of shape {rows.shape}, "
                              f"meta.json records {tuple(shape)} floats")
    return rows


def resume(checkpoint: Path, net, trainer, pfc: PartialFC, validator: Validator,
           world: dist.World, ctx: mx.Context, datasets: list | None = None) -> TrainState:
    """Everything back as it was saved; the sampler continues its stream when the world
    size is unchanged, else each rank starts a fresh stream from (seed, rank, step)."""
    meta = read_meta(checkpoint, pfc)
    refuse_other_datasets(checkpoint, meta.get("datasets"), datasets)
    load_parameters(net, checkpoint / BACKBONE, ctx)
    load_trainer_state(trainer, checkpoint / OPTIMIZER, ctx)
    state = TrainState(**{f.name: meta[f.name] for f in dataclasses.fields(TrainState)})
    saved_margin = meta.get("margin", {"name": "combined", "state": {}})
    if saved_margin["name"] == pfc.margin.name:  # another margin starts its own state afresh
        pfc.margin.load_state_dict(saved_margin["state"])
    validator.load_state_dict(meta.get("validator", {  # written before validators existed
        "best_accuracy": meta.get("best_accuracy", -1.0), "best_step": meta.get("best_step", 0)}))
    same_world = meta["world_size"] == world.size
    sampler = (json.loads((checkpoint / sampler_file(world.rank)).read_text())
               if same_world else None)
    load_centers(checkpoint, meta, pfc, with_states=True, sampler=sampler)
    if not same_world:
        pfc.centers.restart_sampler(pfc.seed, world.rank, state.step)
    return state


def refuse_other_datasets(checkpoint: Path, saved: list | None, now: list | None) -> None:
    """A resume must read the datasets of a `rec` list as the run it continues did: in
    another order, or with another one in the list, the same class ids would stand for
    other people (the sum alone may agree). Datasets are told apart by their counts and
    their train.idx fingerprints (checkpoints before those were kept: counts only), not
    by their folders, which may move."""
    def identities(listing: list | None, fingerprints: bool) -> list | None:
        return [(d["classes"], d["images"], d.get("index") if fingerprints else None)
                for d in listing] if listing else None

    def described(listing: list | None) -> str:
        return (" + ".join(f"{d['rec']} ({d['classes']} classes, {d['images']} images)"
                           for d in listing) if listing else "one dataset")

    fingerprints = all("index" in d for d in [*(saved or []), *(now or [])])
    if identities(saved, fingerprints) != identities(now, fingerprints):
        raise CheckpointError(
            f"{checkpoint} was trained on {described(saved)}; this run's rec is "
            f"{described(now)}: its class ids would stand for other people. Resume with "
            "the same datasets in the same order")


def load_weights(checkpoint: Path, net, pfc: PartialFC, ctx: mx.Context) -> None:
    """--load-from: backbone and centers only (fresh centers under an imported backbone);
    optimizer state and step start afresh."""
    meta = read_meta(checkpoint, pfc, weights_only=True)
    try:
        load_parameters(net, checkpoint / BACKBONE, ctx)
    except (AssertionError, mx.base.MXNetError) as error:  # another network's parameters
        saved = f" ({meta['network']})" if "network" in meta else ""
        why = next((line for line in str(error).splitlines() if line.strip()), repr(error))
        raise CheckpointError(f"{checkpoint} holds a backbone{saved} that this run's network "
                              f"cannot take: {why}") from error
    if meta.get("backbone_only"):
        pfc.centers.draw_initial(pfc.seed)
    else:
        load_centers(checkpoint, meta, pfc, with_states=False)
