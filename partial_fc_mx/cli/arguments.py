"""Argument types and option groups that several commands share."""

from __future__ import annotations

import argparse


def at_least(low: int):
    """An argparse type: a whole number >= low."""
    def whole(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"{text} is less than {low}")
        return value
    return whole


def fraction(text: str) -> float:
    """An argparse type: a number in [0, 1)."""
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not in [0, 1)")
    return value


def add_pictures(command: argparse.ArgumentParser, first: str, out: str, root: str,
                 landmarks: str) -> None:
    """Where pack and make-bin read pictures (FIRST, OUT, --root) and how they prepare one
    that is not 112x112 already; the strings are each argument's help."""
    command.add_argument(first)
    command.add_argument("out", help=out)
    command.add_argument("--root", default=".", help=root)
    command.add_argument("--landmarks", metavar="FILE", help=f"5 points per picture {landmarks}, "
                         "to align it: 'relative/path x1 y1 ... x5 y5' per line (IJB's "
                         "*_name_5pts_score.txt layout)")
    unaligned = command.add_mutually_exclusive_group()
    unaligned.add_argument("--crop", action="store_true", help="center-crop and resize "
                           "pictures without landmarks that are not 112x112")
    unaligned.add_argument("--resize", action="store_true", help="resize pictures without "
                           "landmarks that are not 112x112 (no crop)")

