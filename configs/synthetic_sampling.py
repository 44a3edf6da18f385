# The sampling study (docs/parity.md): does scoring only a sample of the class
# centers cost accuracy? Synthetic identities (pack-synthetic, or made by
# `python -m partial_fc_mx.quality --synthetic CLASSES`, which also sets rec and
# num_classes), 2 CPU processes; the arms differ in sample_rate only.
rec = "data/synthetic"
num_classes = 3000
val_targets = ["synthetic_heldout"]
network = "tiny"
embedding_size = 512
margin_list = (1.0, 0.5, 0.0)  # ArcFace, s = 64, as the MS1MV3 / Glint360K recipes
scale = 64.0
sample_rate = 1.0
batch_size = 64
lr = 0.1
weight_decay = 5e-4
num_epoch = 4
frequent = 20
verbose = 150  # held-out accuracy along the run, for the curves
save_every = 1000
report_baseline = True
