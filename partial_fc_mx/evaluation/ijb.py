"""IJB-B / IJB-C 1:1 verification: the TAR at FAR = 1e-6 ... 1e-1 papers report.

The protocol of insightface's and arcface_torch's IJB evaluation, on the release
layout (IJBC/meta/ijbc_face_tid_mid.txt, ijbc_template_pair_label.txt,
ijbc_name_5pts_score.txt, IJBC/loose_crop/):
- each picture is aligned from its 5 points and embedded with its mirror image
  (the sum of both embeddings, norm kept: it carries the face's quality);
- optionally weighted by the detector's score;
- the pictures of one media (a video's frames, one photo) are averaged, a template's
  media summed, the template normalized;
- each listed template pair is scored by cosine similarity; TAR at each FAR is read
  from the ROC point whose FAR is nearest (arcface_torch's rule).

IJB-C has ~470k pictures and ~15.7M pairs, so nothing grows with the pictures but
their metadata: they are embedded batch by batch straight into their template's sum
(each weighted by 1 / its media's size, known from the metadata beforehand). The
pairs file is parsed and checked in blocks before the embedding and kept as int32
template indices (179 MiB for IJB-C); the pairs are scored a block of gathered rows
at a time.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np

from .. import durable
from ..data import DataError
from ..data.align import check_landmarks, unusable_landmarks, warp_to_template
from ..data.network_input import to_network_input
from ..data.transforms import decode_in_workers
from .verification import flip_sum

FARS = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1)
TARGETS = ("IJBB", "IJBC")
PAIR_BLOCK_BYTES = 16 * 2**20
"""How much of the pairs file is parsed and checked at a time (~1M pairs)."""
SCORE_ROWS = 16384
"""Pairs scored at a time: their two gathered feature rows (2 x 32 MiB at D = 512)."""


@dataclass(frozen=True)
class Layout:
    """Where the files of one target lie under the release root."""

    faces: Path
    """<t>_face_tid_mid.txt: `name template media` per picture."""
    pairs: Path
    """<t>_template_pair_label.txt: `template1 template2 1|0` per pair."""
    landmarks: Path
    """<t>_name_5pts_score.txt: `name x1 y1 ... x5 y5 score`, the same rows as faces."""
    images: Path

    @classmethod
    def of(cls, root: str | os.PathLike, target: str) -> Layout:
        if target not in TARGETS:
            raise DataError(f"target {target!r} is not one of {', '.join(TARGETS)}")
        base = Path(root)
        if not (base / "meta").is_dir() and (base / target / "meta").is_dir():
            base = base / target  # --root may name the release or the target's folder
        meta, prefix = base / "meta", target.lower()
        layout = cls(meta / f"{prefix}_face_tid_mid.txt",
                     meta / f"{prefix}_template_pair_label.txt",
                     meta / f"{prefix}_name_5pts_score.txt", base / "loose_crop")
        missing = [str(p) for p in (layout.faces, layout.pairs, layout.landmarks)
                   if not p.is_file()] + ([] if layout.images.is_dir() else [str(layout.images)])
        if missing:
            raise DataError(f"{', '.join(missing)} missing: --root must hold the {target} "
                            f"release layout ({target}/meta/{prefix}_face_tid_mid.txt, "
                            f"..._template_pair_label.txt, ..._name_5pts_score.txt, "
                            f"{target}/loose_crop/)")
        return layout


@dataclass
class Pictures:
    """Every picture of the protocol, in the metadata's order."""

    names: list[str]
    landmarks: np.ndarray
    """N x 5 x 2 pixels."""
    detector_scores: np.ndarray
    template: np.ndarray
    """Each picture's template, as an index into `template_ids`."""
    media_weight: np.ndarray
    """1 / the number of pictures of its media in its template: the media mean."""
    template_ids: np.ndarray
    """The sorted distinct template ids."""
    lines: np.ndarray
    """Each picture's line in the landmarks file, for errors."""


def read_pictures(layout: Layout) -> Pictures:
    """Both per-picture files, checked to list the same pictures in the same order and
    to give usable landmarks, before hours of embedding start."""
    names, points, scores, lines = [], [], [], []
    for number, line in numbered_lines(layout.landmarks):
        fields = line.split()
        if len(fields) != 12:
            raise DataError(f"{layout.landmarks} line {number} is not 'name x1 y1 ... x5 y5 "
                            f"score' (12 fields): {line!r}")
        try:
            values = [float(v) for v in fields[1:]]
        except ValueError:
            raise DataError(f"{layout.landmarks} line {number}: not numbers: {line!r}") from None
        names.append(fields[0])
        points.append(values[:10])
        scores.append(values[10])
        lines.append(number)
    templates, medias = [], []
    for row, (number, line) in enumerate(numbered_lines(layout.faces)):
        fields = line.split()
        if len(fields) != 3 or not (fields[1].isdigit() and fields[2].isdigit()):
            raise DataError(f"{layout.faces} line {number} is not 'name template media' "
                            f"(two whole numbers): {line!r}")
        if row >= len(names) or fields[0] != names[row]:
            other = f"line {lines[row]} of it names {names[row]}" if row < len(names) else \
                "it has no more pictures"
            raise DataError(f"{layout.faces} line {number} names {fields[0]}, but "
                            f"{layout.landmarks}'s picture {row + 1} ({other}): the two files "
                            "must list the same pictures in the same order")
        templates.append(int(fields[1]))
        medias.append(int(fields[2]))
    if len(templates) != len(names):
        raise DataError(f"{layout.faces} lists {len(templates)} pictures, {layout.landmarks} "
                        f"{len(names)}: they must list the same pictures")
    if not names:
        raise DataError(f"{layout.faces} lists no pictures")
    landmarks = np.array(points, np.float64).reshape(-1, 5, 2)
    for row in unusable_landmarks(landmarks)[:1]:
        check_landmarks(landmarks[row], None, f"{layout.landmarks} line {lines[row]}")
    template_ids, template = np.unique(np.array(templates, np.int64), return_inverse=True)
    _, media, media_size = np.unique(np.stack([template, medias], axis=1), axis=0,
                                     return_inverse=True, return_counts=True)
    return Pictures(names, landmarks, np.array(scores, np.float64), template.astype(np.int64),
                    (1.0 / media_size[media.reshape(-1)]).astype(np.float64), template_ids,
                    np.array(lines, np.int64))


def numbered_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, line) of the lines that are not blank."""
    with open(path) as lines:
        for number, line in enumerate(lines, 1):
            if line.strip():
                yield number, line


def check_pictures_exist(pictures: Pictures, layout: Layout) -> None:
    """Every listed picture is a file under loose_crop/: a missing one would otherwise
    end the run after hours of embedding."""
    missing = [row for row, name in enumerate(pictures.names)
               if not (layout.images / name).is_file()]
    if missing:
        examples = ", ".join(f"{pictures.names[row]} (line {pictures.lines[row]})"
                             for row in missing[:3])
        raise DataError(f"{len(missing)} of the {len(pictures.names)} pictures "
                        f"{layout.landmarks} lists are not in {layout.images}: {examples}; "
                        "copy the whole loose_crop folder of the release")


def template_features(pictures: Pictures, layout: Layout, forward: Callable, flip: bool = True,
                      detector_score: bool = True, batch_size: int = 128, workers: int = 4,
                      progress: Callable[[int], None] | None = None) -> np.ndarray:
    """T x D unit template features. Pictures are read and aligned by `workers` threads
    one batch ahead of the network, and added to their template's sum as they come."""
    decode_in_workers()
    sums = None
    with ThreadPoolExecutor(workers) as pool:
        def submit(start: int) -> list:
            stop = min(start + batch_size, len(pictures.names))
            return [pool.submit(aligned_picture, pictures, layout, i) for i in range(start, stop)]

        pending = submit(0)
        for start in range(0, len(pictures.names), batch_size):
            batch = to_network_input(np.stack([f.result() for f in pending]))
            pending = submit(start + batch_size)
            features = (flip_sum(forward, batch) if flip else forward(batch)).astype(np.float64)
            rows = slice(start, start + len(batch))
            weight = pictures.media_weight[rows]
            if detector_score:
                weight = weight * pictures.detector_scores[rows]
            if sums is None:
                sums = np.zeros((len(pictures.template_ids), features.shape[1]))
            np.add.at(sums, pictures.template[rows], features * weight[:, None])
            if progress:
                progress(len(batch))
    norms = np.linalg.norm(sums, axis=1, keepdims=True)
    return (sums / np.maximum(norms, 1e-12)).astype(np.float32)


def aligned_picture(pictures: Pictures, layout: Layout, index: int) -> np.ndarray:
    """Picture `index`, aligned, RGB."""
    path = layout.images / pictures.names[index]
    where = f"{path} (line {pictures.lines[index]} of {layout.landmarks})"
    image = cv2.imread(str(path), cv2.IMREAD_COLOR)
    if image is None:
        raise DataError(f"{where} is missing or not a decodable image")
    # the points were checked up front (read_pictures); points just outside a loose
    # crop are warped as insightface does, not refused: one such picture must not end
    # hours of embedding
    face = warp_to_template(image, pictures.landmarks[index])
    return cv2.cvtColor(face, cv2.COLOR_BGR2RGB)


@dataclass(frozen=True)
class Pairs:
    """Every listed pair: its two templates (indices into the sorted template ids)
    and its label. IJB-C's 15.7M pairs take 190 MB."""

    templates: np.ndarray
    labels: np.ndarray


def read_pairs(template_ids: np.ndarray, pairs_file: Path) -> Pairs:
    """The pairs file, read and checked once, before hours of embedding."""
    blocks = list(pair_rows(template_ids, pairs_file))
    if not blocks:
        raise DataError(f"{pairs_file} lists no pairs")
    rows = np.concatenate(blocks)
    del blocks  # not twice in memory
    return Pairs(rows[:, :2], rows[:, 2])


def score_pairs(features: np.ndarray, pairs: Pairs) -> np.ndarray:
    """The cosine similarity of every pair's unit template features, SCORE_ROWS pairs
    at a time (one product of gathered rows each)."""
    index = pairs.templates
    return np.concatenate([np.empty(0, features.dtype), *(
        np.einsum("ij,ij->i", features[index[start:start + SCORE_ROWS, 0]],
                  features[index[start:start + SCORE_ROWS, 1]])
        for start in range(0, len(index), SCORE_ROWS))])


def pair_rows(template_ids: np.ndarray, pairs_file: Path) -> Iterator[np.ndarray]:
    """Blocks of int32 (template index, template index, label) rows, a DataError naming the
    line of a template no picture has or of a label that is not 0 or 1."""
    for block, lines in pair_blocks(pairs_file):
        index = np.searchsorted(template_ids, block[:, :2]).clip(max=len(template_ids) - 1)
        unknown = (template_ids[index] != block[:, :2]).any(axis=1)
        if unknown.any():
            row = int(np.flatnonzero(unknown)[0])
            missing = [t for t in block[row, :2] if t not in template_ids][0]
            raise DataError(f"{pairs_file} line {lines[row]}: template {missing} is not in "
                            "the face list")
        bad_label = ~np.isin(block[:, 2], (0, 1))
        if bad_label.any():
            row = int(np.flatnonzero(bad_label)[0])
            raise DataError(f"{pairs_file} line {lines[row]}: label {block[row, 2]} is not 1 "
                            "(same person) or 0")
        yield np.column_stack([index, block[:, 2]]).astype(np.int32)


def pair_blocks(path: Path) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(rows x 3 integers, each row's line number) of `template1 template2 label`
    lines, PAIR_BLOCK_BYTES of the file at a time."""
    first_line, rest = 1, b""
    with open(path, "rb") as pairs:
        while chunk := pairs.read(PAIR_BLOCK_BYTES):
            head, newline, rest = (rest + chunk).rpartition(b"\n")
            if newline:
                if head.strip():
                    yield parse_pairs(head, path, first_line)
                first_line += head.count(b"\n") + 1
            else:
                rest = head + rest  # no line ends in this chunk yet
        if rest.strip():
            yield parse_pairs(rest, path, first_line)


def parse_pairs(text: bytes, path: Path, first_line: int) -> tuple[np.ndarray, np.ndarray]:
    """The rows of `text` (whole lines) and their line numbers; every line that is not
    blank must be three whole numbers."""
    numbered = [(first_line + offset, line) for offset, line in enumerate(text.split(b"\n"))
                if line.strip()]
    for number, line in numbered:
        fields = line.split()
        if len(fields) != 3 or not all(field.isdigit() for field in fields):
            raise DataError(f"{path} line {number} is not 'template1 template2 label' (three "
                            f"whole numbers): {line.decode(errors='replace')!r}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        values = np.fromstring(text, dtype=np.int64, sep=" ")
    return values.reshape(-1, 3), np.array([number for number, _ in numbered], np.int64)


@dataclass(frozen=True)
class Roc:
    far: np.ndarray
    tar: np.ndarray
    threshold: np.ndarray


def roc_curve(scores: np.ndarray, labels: np.ndarray) -> Roc:
    """One point per distinct score: the shares of impostor (FAR) and genuine (TAR)
    pairs scoring at least that much."""
    genuine = int(labels.sum())
    if genuine == 0 or genuine == len(labels):
        raise DataError("the pairs need both genuine (label 1) and impostor (label 0) pairs")
    order = np.argsort(scores)[::-1]  # the order within equal scores does not matter
    ranked = scores[order]
    true_accepts = np.cumsum(labels[order], dtype=np.int64)
    del order  # IJB-C: 15.7M of everything; keep the peak low
    last_of_each = np.append(np.flatnonzero(ranked[1:] != ranked[:-1]), len(ranked) - 1)
    threshold = ranked[last_of_each]
    del ranked
    true_accepts = true_accepts[last_of_each]
    far = (last_of_each + 1 - true_accepts) / (len(labels) - genuine)
    return Roc(far, true_accepts / genuine, threshold)


def tar_at_fars(roc: Roc, fars=FARS) -> dict[float, float]:
    """TAR at the ROC point whose FAR is nearest each of `fars`; of equally near points
    the last (the highest TAR: genuine pairs between two impostors count), as
    arcface_torch picks on its reversed curve."""
    tars = {}
    for far in fars:
        gap = np.abs(roc.far - far)
        tars[far] = float(roc.tar[len(gap) - 1 - np.argmin(gap[::-1])])
    return tars


def table(rows: dict[str, dict[float, float]], fars=FARS) -> str:
    """TAR (%) per FAR, one row per model, as arcface_torch prints it."""
    width = max(len("model"), *map(len, rows))
    lines = [" | ".join([f"{'model':<{width}}", *(f"{far:>7.0e}" for far in fars)])]
    lines.append("-" * len(lines[0]))
    lines += [" | ".join([f"{name:<{width}}", *(f"{100 * tars[far]:7.2f}" for far in fars)])
              for name, tars in rows.items()]
    return "\n".join(lines)


def plot_rocs(curves: dict[str, Roc], out: Path, title: str) -> Path:
    """One PNG with every curve (TAR against log FAR)."""
    from .drawing import pyplot

    plt = pyplot()
    figure, axes = plt.subplots(figsize=(6, 4.5))
    for name, roc in curves.items():
        # ~2000 points evenly spread over log FAR: IJB-C's curve has millions
        keep = np.unique(np.searchsorted(roc.far, np.logspace(-7, 0, 2000)).clip(
            max=len(roc.far) - 1))
        keep = keep[roc.far[keep] > 0]
        axes.plot(roc.far[keep], roc.tar[keep], label=name)
    axes.set(xscale="log", xlim=(min(FARS), 1), ylim=(0, 1), xlabel="FAR", ylabel="TAR",
             title=title)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(out, dpi=120)
    plt.close(figure)
    return out


def save_scores(path: Path, scores: np.ndarray, labels: np.ndarray) -> Path:
    """Scores and labels as a plain .npz (no pickle), for `roc` to compare models;
    written atomically, as every output file."""
    def write(tmp: Path) -> None:
        with open(tmp, "wb") as file:  # a file: np.savez would append .npz to a name
            np.savez(file, scores=scores.astype(np.float32), labels=labels.astype(np.int8))

    durable.write_atomically(path, write)
    return path


def load_scores(path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as saved:
            scores, labels = saved["scores"], saved["labels"]
    except (OSError, ValueError, KeyError) as error:
        raise DataError(f"{path} is not a scores file eval-ijb wrote: {error}") from error
    if scores.shape != labels.shape or scores.ndim != 1:
        raise DataError(f"{path}: scores {scores.shape} and labels {labels.shape} differ")
    return scores, labels
