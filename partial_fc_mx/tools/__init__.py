"""Tools over what a run wrote and what the code declares: curves from metrics.jsonl
(plot.py, `python -m partial_fc_mx plot`) and docs/configuration.md generated from the
Config class (config_reference.py)."""
