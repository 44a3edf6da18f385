# Glint360K, IResNet-100, ArcFace with Partial FC at 10%.
_base_ = "glint360k_r100.py"
margin_list = (1.0, 0.5, 0.0)
