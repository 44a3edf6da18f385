"""What a training run is made of besides the classifier, the helpers of train.py:
where its data comes from (data_source.py), how long it runs and at what learning rate
(schedule.py), the backbone's precision on this host (precision.py, cpu_precision.py)
and its optimizer (backbone_optimizer.py), checkpoints and resuming (checkpoint.py,
workdir.py), what it tells the user (training_log.py, metrics.py), stopping cleanly on
a signal (interrupts.py) and the ONNX backbone it writes (export.py,
background_export.py)."""
