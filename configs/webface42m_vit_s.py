# WebFace42M (2 million identities), ViT-S, CosFace, Partial FC at 30%: arcface_torch's
# wf42m_pfc03_40epoch_64gpu_vit_s recipe (its only ViT-S one), which is its ViT-T
# recipe (webface42m_vit_t.py: AdamW at 0.001 with weight decay 0.1, 4 of 40 epochs of
# warmup, linear decay, clipping at norm 5) with ViT-S and 384 images per GPU. Its
# network trains without patch masking and with drop path up to 0.05 (vit_s masks 15
# of 144 patches and drops paths up to 0.1: backbones/vit.py).
_base_ = "webface42m_vit_t.py"
network = "vit_s_dp005_mask_0"
batch_size = 384
