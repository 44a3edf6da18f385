"""What this machine's GPUs and MXNet build can run: the GPUs the CUDA driver shows
(gpu_support.py) and the kernels an MXNet library carries (fatbinary.py). dist.py asks
it which GPU a rank takes; the preflight and `python -m partial_fc_mx gpus` print its
verdicts. It imports nothing of the package but caches.py and errors.py."""
