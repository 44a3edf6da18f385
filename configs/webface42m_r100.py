# WebFace42M (2 million identities), IResNet-100, ArcFace, Partial FC at 20%.
_base_ = "webface4m_r50.py"
rec = "/train_tmp/WebFace42M"
num_classes = 2059906
num_image = 42474557
network = "r100"
sample_rate = 0.2
