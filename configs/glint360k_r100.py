# Glint360K (360k identities), IResNet-100, CosFace with Partial FC at 10%.
rec = "/train_tmp/glint360k"
num_classes = 360232
num_image = 17091657
val_targets = ["lfw", "cfp_fp", "agedb_30"]
network = "r100"
embedding_size = 512
margin_list = (1.0, 0.0, 0.4)
scale = 64.0
sample_rate = 0.1
fp16 = True
batch_size = 128
lr = 0.1
weight_decay = 5e-4
num_epoch = 20
