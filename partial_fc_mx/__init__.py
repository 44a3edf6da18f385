"""partial_fc_mx: Partial FC face recognition training with MXNet and Horovod."""
__version__ = "0.1.0"
