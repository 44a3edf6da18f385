# The default job (`bash run.sh`): real faces from the AT&T/ORL database, small
# enough to train on 2 CPU processes in minutes. Identities are split into training
# and held-out ones; `orl_heldout.bin` holds verification pairs of unseen people.
rec = "data/orl"
num_classes = 30
val_targets = ["orl_heldout"]
network = "tiny"
embedding_size = 256
batch_size = 32
sample_rate = 1.0
margin_list = (1.0, 0.5, 0.0)  # ArcFace
scale = 32.0
lr = 0.1
num_epoch = 30
frequent = 5
verbose = 100
save_every = 40
report_baseline = True
