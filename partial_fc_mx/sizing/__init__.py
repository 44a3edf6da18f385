"""Will a run fit, and will it start: the memory of every part of a step per rank
(memory.py, with Partial FC's part in pfc_memory.py), the hardware plan of a config
(plan.py: memory, collectives and FLOPs per GPU, the fewest GPUs it fits on;
`python -m partial_fc_mx plan`) and the preflight (preflight.py: `python -m
partial_fc_mx check`, also run by every rank before training)."""
