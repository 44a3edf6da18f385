"""Writes insightface_NAME-symbol.json beside this script: a network's graph as
insightface's own MXNet-era training code builds it (recognition/arcface_mxnet: the
symbol/ module that sample_config.py names for the network, with its defaults), for
tests/test_import_backbone.py, which gives it random weights. That code is not part
of this project; run it from a checkout of insightface:

    pip install easydict   # sample_config.py's only dependency beyond MXNet
    python tests/data/make_insightface_symbol.py /path/to/insightface r50 --num-layers 18 --name r18
    python tests/data/make_insightface_symbol.py /path/to/insightface y1 --name mobilefacenet
"""

import argparse
import importlib
import sys
import types
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("insightface")
parser.add_argument("network", help="a key of sample_config.network (r50, y1, ...)")
parser.add_argument("--num-layers", type=int, help="override its depth (fresnet)")
parser.add_argument("--name", help="the file's name (default: the network's)")
args = parser.parse_args()
code = Path(args.insightface) / "recognition" / "arcface_mxnet"
sys.path[:0] = [str(code), str(code / "symbol")]
try:
    import sklearn  # noqa: F401  (fresnet.py imports it, and uses none of it)
except ImportError:
    sys.modules["sklearn"] = types.ModuleType("sklearn")
import sample_config  # noqa: E402

sys.modules["config"] = sample_config  # the symbol modules: from config import config
config = sample_config.config
for key, value in sample_config.network[args.network].items():  # as train.py's config does
    config[key] = value
if args.num_layers:
    config.num_layers = args.num_layers
symbol = importlib.import_module(config.net_name).get_symbol()
out = Path(__file__).with_name(f"insightface_{args.name or args.network}-symbol.json")
symbol.save(str(out))
print(f"wrote {out}")
