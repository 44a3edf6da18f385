# MS1MV3 (ms1m-retinaface-t1), IResNet-50, ArcFace, as in insightface's reference.
rec = "/train_tmp/ms1m-retinaface-t1"
num_classes = 93431
num_image = 5179510
val_targets = ["lfw", "cfp_fp", "agedb_30"]
network = "r50"
embedding_size = 512
margin_list = (1.0, 0.5, 0.0)
scale = 64.0
sample_rate = 1.0
fp16 = True
batch_size = 128
lr = 0.1
weight_decay = 5e-4
num_epoch = 20
