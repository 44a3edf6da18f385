"""The images task: the synthetic look-alike identities of prep/synthetic.py (each a
random picture, a fraction of it, the task's `shared`, one picture common to all), in
families of task.FAMILY whose members share the task's `kin` of the rest, every image
encoded as JPEG and decoded as our loader decodes a record, stored once as uint8 arrays
that both toolkits read. No augmentation in either arm: both see exactly these pixels,
in the same order.

The families are the scale task's (task.py passes its FAMILY in): consecutive ids from
0 (the held-out ones from the first after training's, a multiple of FAMILY), so that
half of the pair list's impostors are family members, the pairs hard to tell apart.
"""

from __future__ import annotations

import numpy as np

from ..data.transforms import FACE_SIZE, decode_face
from ..prep.synthetic import identity_images


def samples(seed: int, classes: range, per_class: int, shared: float, kin: float,
            family_size: int) -> tuple[np.ndarray, np.ndarray]:
    """`per_class` decoded images of every identity of `classes`, class by class, each
    identity's picture `shared` the one common to all and `kin` of the rest its
    family's (ids `family_size` by family_size): (images N x 112 x 112 x 3 uint8,
    labels 0 .. len(classes) - 1)."""
    images = np.empty((len(classes) * per_class, FACE_SIZE, FACE_SIZE, 3), np.uint8)
    for index, class_id in enumerate(classes):
        faces = identity_images(seed, class_id, per_class, shared, kin, family_size)
        for view, encoded in enumerate(faces):
            images[index * per_class + view] = decode_face(encoded)[0]
    return images, np.arange(len(classes)).repeat(per_class).astype(np.int64)
