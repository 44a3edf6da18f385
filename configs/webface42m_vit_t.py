# WebFace42M (2 million identities), ViT-T, CosFace, Partial FC at 30%: arcface_torch's
# wf42m_pfc03_40epoch_8gpu_vit_t recipe (8 GPUs x 512 images, AdamW at 0.001 with
# weight decay 0.1 for the backbone and the centers, 4 of 40 epochs of warmup), with
# what its train_v2.py adds: linear decay (power 1) and the backbone's gradient
# clipped at norm 5. Verification on lfw, cfp_fp, agedb_30 (it has none). Its
# network trains without patch masking and with drop path up to 0.05 (vit_t masks 15
# of 144 patches and drops paths up to 0.1: backbones/vit.py).
_base_ = "webface42m_r100.py"
network = "vit_t_dp005_mask0"
margin_list = (1.0, 0.0, 0.4)
sample_rate = 0.3
batch_size = 512
optimizer = "adamw"
center_optimizer = "adamw"
lr = 0.001
weight_decay = 0.1
num_epoch = 40
warmup_epoch = 4
lr_power = 1.0
clip_grad = 5.0
