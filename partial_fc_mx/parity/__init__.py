"""The parity study (docs/parity.md): the model at the end of a run, ours against
arcface_torch's own public code on the same data and recipe, over several seeds.
`task.py` makes the scale task's data and the data order both arms train in, `ours.py`
and `anchor.py` are the two arms (anchor.py runs in a torch environment and imports
nothing of the project that needs MXNet), `scoring.py` is the one evaluator, and
`__main__.py` runs the matrix and prints both toolkits side by side."""
