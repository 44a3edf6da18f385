"""Tools over what a run wrote and what the code declares: curves from metrics.jsonl
(plot.py, `python -m partial_fc_mx plot`), docs/configuration.md generated from the
Config class (config_reference.py), and arcface_torch's backbone shapes, recorded in a
torch environment for the tests (anchor_shapes.py)."""
