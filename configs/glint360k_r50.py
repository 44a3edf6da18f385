# Glint360K, IResNet-50, CosFace with Partial FC at 10%.
_base_ = "glint360k_r100.py"
network = "r50"
