"""Backbones from elsewhere: a model trained by arcface_torch or insightface, read
from its file (onnx_source.py, mxnet_source.py), laid onto our network of the same
architecture (mapping.py), its folded BatchNorms given statistics (calibration.py),
checked and written as a work dir (importer.py)."""
