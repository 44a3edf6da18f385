"""The images task: the synthetic look-alike identities of prep/synthetic.py (each a
random picture, a fraction of it, the task's `shared`, one picture common to all),
every image encoded as JPEG and decoded as our loader decodes a record, stored once as
uint8 arrays that both toolkits read. No augmentation in either arm: both see exactly
these pixels, in the same order.

Identities here come in no families: the pair list's "family" impostors (task.py)
are simply identities with nearby ids, as likely alike as any two.
"""

from __future__ import annotations

import numpy as np

from ..data.transforms import FACE_SIZE, decode_face
from ..prep.synthetic import identity_images


def samples(seed: int, classes: range, per_class: int,
            shared: float) -> tuple[np.ndarray, np.ndarray]:
    """`per_class` decoded images of every identity of `classes`, class by class, each
    identity's picture `shared` the one common to all: (images N x 112 x 112 x 3 uint8,
    labels 0 .. len(classes) - 1)."""
    images = np.empty((len(classes) * per_class, FACE_SIZE, FACE_SIZE, 3), np.uint8)
    for index, class_id in enumerate(classes):
        for view, encoded in enumerate(identity_images(seed, class_id, per_class, shared)):
            images[index * per_class + view] = decode_face(encoded)[0]
    return images, np.arange(len(classes)).repeat(per_class).astype(np.int64)
