# Speed configuration: ten million identities, Partial FC at 10%, random images.
_base_ = "random_1m_r50.py"
num_classes = 10000000
num_image = 50000000
