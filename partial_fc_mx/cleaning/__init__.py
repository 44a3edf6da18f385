"""Cleaning a training set with the model trained on it (sub-center ArcFace's recipe):
each class's dominant sub-center, and the samples too far from it dropped.

    dominant.py  the rule, pure numpy: sub-center picks, dominant sub-centers, angles
    clean.py     `python -m partial_fc_mx clean`: the rule over a packed dataset, in
                 chunks spread over the ranks, resumable, writing the kept records
"""
