"""matplotlib set up to draw into files: the ROC plots of evaluation and the training
curves of `plot` draw the same way, on machines without a screen."""

from __future__ import annotations


def pyplot():
    """matplotlib.pyplot drawing to files (no screen needed), without the line matplotlib
    prints the first time it builds its font cache: nothing for a user to act on."""
    import logging

    import matplotlib

    logging.getLogger("matplotlib.font_manager").setLevel(logging.ERROR)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
