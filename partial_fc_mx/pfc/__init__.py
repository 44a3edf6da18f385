"""The classifier: Partial FC. PartialFC (partial_fc.py) scores a global batch of
embeddings against this rank's shard of the class centers (centers.py), sampling the
positives and some negatives (sampling.py), with exact softmax statistics over the
sampled set from three collectives; the rows a step did not sample take it later
(idle_rows.py) or never, as config center_update says; the margin (margins/), the centers' optimizer
(center_optimizers/) and the row kernels (rows.py, kernels/) plug in here. Buffers
kept across steps (buffers.py), the host-side views of the shard (host_view.py) and
the thread pool of the row kernels (threads.py) serve only this wing. It reads the
cluster (dist.py) and nothing above it: no config, no data, no run."""
