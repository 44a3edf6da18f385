# MS1MV3, IResNet-100, ArcFace.
_base_ = "ms1mv3_r50.py"
network = "r100"
