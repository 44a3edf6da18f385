"""partial_fc_mx's command line with the backbones of the earlier layout (one PReLU
slope per layer), to write the checkpoints tests/test_backbones.py then resumes.
Usage: old_layout_worker.py COMMAND ARGS..."""

from __future__ import annotations

import sys

from mxnet.gluon import nn

from partial_fc_mx.backbones import iresnet, mobilefacenet
from partial_fc_mx.cli.main import main

iresnet.prelu = mobilefacenet.prelu = lambda channels: nn.PReLU()
sys.exit(main(sys.argv[1:]))
