# MS1MV3, IResNet-50, CosFace.
_base_ = "ms1mv3_r50.py"
margin_list = (1.0, 0.0, 0.4)
