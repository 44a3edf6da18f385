# The default job (`bash run.sh`): real faces from the AT&T/ORL database, small
# enough to train on 2 CPU processes in minutes. Identities are split into training
# and held-out ones; `orl_heldout.bin` holds verification pairs of unseen people.
# Every choice below is measured over five identity splits in docs/quality.md.
rec = "data/orl"
num_classes = 30
val_targets = ["orl_heldout"]
network = "tiny"
embedding_size = 256
batch_size = 16  # 540 steps for 60 epochs: the augmented task needs the steps
# 30 people x 10 images are memorized unless each step shows them differently
augment_crop_scale = 0.8
augment_rotate = 10.0
augment_color = 0.2
augment_blur = 0.2
sample_rate = 1.0
margin_list = (1.0, 0.5, 0.0)  # ArcFace
scale = 32.0
lr = 0.1
num_epoch = 60  # 0.956 over five splits, against 0.940 at 30 epochs
frequent = 10
verbose = 100  # evaluate every 100 steps: a curve to read, and a best model worth keeping
save_every = 100
report_baseline = True
