# Speed configuration: one million identities, random images (no decoding), to
# measure the step rate of the backbone and Partial FC at this scale (rec = "random").
rec = "random"
num_classes = 1000000
num_image = 5000000
network = "r50"
embedding_size = 512
margin_list = (1.0, 0.5, 0.0)
scale = 64.0
sample_rate = 0.1
fp16 = True
batch_size = 128
lr = 0.1
num_epoch = 1
frequent = 10
