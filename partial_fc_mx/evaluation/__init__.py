"""Verification of face embeddings: insightface .bin pairs with 10-fold accuracy and
TAR@FAR (verification.py), during training (validator.py, baseline.py) and IJB-B/IJB-C
1:1 with ROC plots (ijb.py, drawing.py). The model comes in as a callable."""
