"""mxnet_library.load_library offers a library's operators as `mx.library.load` does
(mx.nd.NAME, mx.sym.NAME and their .op modules, with MXNet's own docstrings and
signatures), and makes nothing else again: each way runs in a process of its own, as a
library loads once a process."""

from __future__ import annotations

import json
import re
import sys

from conftest import run

from partial_fc_mx.pfc import kernels

OFFERED = """import inspect, json, sys
import mxnet as mx
from partial_fc_mx.pfc import kernels
from partial_fc_mx.pfc.kernels.mxnet_library import load_library
fully_connected = mx.nd.FullyConnected
library = kernels.build(kernels.mxnet_folder())
mx.library.load(str(library), verbose=False) if sys.argv[1] == "mxnet" else load_library(library)
offered = {}
for where, module in (("nd", mx.nd), ("nd.op", mx.nd.op), ("sym", mx.sym), ("sym.op", mx.sym.op),
                      ("nd._internal", mx.nd._internal), ("sym._internal", mx.sym._internal)):
    for name in dir(module):
        if "pfc_" in name:
            function = getattr(module, name)
            offered[f"{where}.{name}"] = [function.__module__, function.__doc__,
                                          str(inspect.signature(function))]
print(json.dumps({"offered": offered, "remade": mx.nd.FullyConnected is not fully_connected,
                  "computes": mx.nd.pfc_scale_rows(mx.nd.ones((1, 4)), scale=2.0,
                                                   threads=1)[0].asnumpy().tolist()}))
"""


def offered_by(way: str) -> dict:
    done = run([sys.executable, "-c", OFFERED, way])
    assert done.returncode == 0, done.stdout[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_librarys_operators_are_offered_as_mxnets_loader_offers_them_and_nothing_is_remade():
    chains = dict(name_and_chain for source in kernels.SOURCES for name_and_chain in
                  re.findall(r"^REGISTER_OP\((\w+)\)([^;]*);", source.read_text(), re.M))
    with_backward = {name for name, chain in chains.items() if ".setBackward(" in chain}
    ours, mxnets = offered_by("ours"), offered_by("mxnet")
    forward = {key.rsplit(".", 1)[1] for key in ours["offered"] if "._internal." not in key}
    backward = {key.rsplit(".", 1)[1] for key in ours["offered"] if "._internal." in key}
    assert forward == set(chains) and with_backward == {"pfc_prelu", "pfc_layer_norm"}
    assert backward == {f"_backward_{name}" for name in with_backward}
    assert len(ours["offered"]) == 4 * len(forward) + 2 * len(backward)
    assert ours["offered"] == mxnets["offered"]
    assert ours["computes"] == mxnets["computes"] == [[1.0, 1.0, 1.0, 1.0]]
    assert mxnets["remade"] and not ours["remade"]
