# MS1MV3, IResNet-50, AdaFace (the paper's m and h; scale 64 from the base).
_base_ = "ms1mv3_r50.py"
margin = "adaface"
margin_options = {"m": 0.4, "h": 0.333}
