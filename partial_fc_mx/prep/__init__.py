"""Preparing datasets, apart from reading them (data/): packing a folder or a .lst of
pictures into RecordIO (pack.py), holding people out for a verification set
(heldout.py, pairs.py), the ORL real faces and synthetic identities (orl.py,
synthetic.py), and checking a packed dataset (inspect.py). Training never imports it."""
