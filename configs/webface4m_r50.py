# WebFace4M (from WebFace260M), IResNet-50, ArcFace, Partial FC at 30%.
rec = "/train_tmp/WebFace4M"
num_classes = 205990
num_image = 4235242
val_targets = ["lfw", "cfp_fp", "agedb_30"]
network = "r50"
embedding_size = 512
margin_list = (1.0, 0.5, 0.0)
scale = 64.0
sample_rate = 0.3
fp16 = True
batch_size = 128
lr = 0.1
weight_decay = 5e-4
num_epoch = 20
warmup_epoch = 1
