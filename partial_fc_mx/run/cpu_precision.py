"""What `fp16 = True` means on a CPU host (config `cpu_precision`), decided at start-up.

On a GPU the 16-bit backbone computes in float16. MXNet has no float16 convolution on
the CPU, so there it computes in bfloat16 (precision.py), which oneDNN runs well only
on some CPUs:
  - AVX512_BF16 or AMX (Intel Cooper Lake, Sapphire Rapids and later; AMD Zen 4 and
    later): native bfloat16;
  - AVX-512 without them (Intel Skylake-SP to Ice Lake): emulated, about 2x slower
    than float32;
  - AVX2 only (AMD Zen 2/3, most Intel desktops and laptops before Ice Lake, many
    cloud instances): oneDNN cannot build bfloat16 convolutions at all ("could not
    create a primitive descriptor iterator" at the first step).

So `cpu_precision = "auto"` (the default) trains the 16-bit graph in bfloat16 where the
CPU computes it natively and oneDNN runs the config's own network in it, and in
float32 elsewhere; "bfloat16" and "float32" force either (bfloat16 is refused with a
clear message where oneDNN cannot run it). A GPU config thus trains on any x86-64 CPU.

Which instructions oneDNN uses is what oneDNN itself reports (its verbose mode's isa
line), so its DNNL_MAX_CPU_ISA cap is honoured. Whether it runs the network in
bfloat16 is found by a forward and backward of that network on two images in a
separate process (`probe_here`): a oneDNN failure there, an exception or a crash,
never reaches a training process. The answer is cached per host (the CPU, oneDNN's
and MXNet's settings, MXNet and the code the probe runs are its key), so ranks that
start together probe once, and later runs not at all; an answer that may not last
(the probe was killed, ran out of time or memory) is kept for the ranks starting
now only. Every rank then takes the same precision (`agree`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from .. import caches, durable
from ..errors import UserError
from ..pfc import kernels

if TYPE_CHECKING:
    from ..config import Config

PROBE_SECONDS = 300
"""The probe's time limit: r200's forward and backward on two images takes seconds."""
PASSING_SECONDS = 600
"""How long an answer that may not last is kept: for the ranks that start together."""
ONEDNN_ISA_LINE = "dnnl_verbose,info,cpu,isa:"
PROBE_RESULT = "PROBE "
SOURCES = [Path(__file__), Path(__file__).with_name("precision.py"),
           Path(__file__).with_name("cpu_kernels.py"), *kernels.SOURCES, kernels.HEADER,
           *sorted((Path(__file__).parents[1] / "backbones").glob("*.py"))]
"""The code a probe runs besides MXNet (the training graph, its CPU kernels among it):
a change in it probes again."""
SETTINGS = ("DNNL_", "ONEDNN_", "MKLDNN_", "MXNET_MKLDNN_", "MXNET_ONEDNN_")
"""Environment variables that change what oneDNN does (its ISA cap, MXNet's switch)."""
CRASHES = (-4, -6, -7, -8, -11)
"""SIGILL, SIGABRT, SIGBUS, SIGFPE, SIGSEGV: oneDNN failing the same way every time."""


class PrecisionChoiceError(UserError, RuntimeError):
    """bfloat16 forced where oneDNN cannot run it; says what to set instead."""


@dataclass(frozen=True)
class HostProbe:
    """What a host's oneDNN does with bfloat16."""

    isa: str
    """oneDNN's own name of the instructions it uses, e.g. "Intel AVX2"."""
    bfloat16: str
    """"ok" when the network ran forward and backward in bfloat16, else why not."""

    @property
    def native(self) -> bool:
        """oneDNN 2.x names the ISAs with bfloat16 instructions "... with Intel DL
        Boost and bfloat16 support" (AVX512_BF16) and "Intel AMX with bfloat16 ..."."""
        return "bfloat16" in self.isa


AnyChoice = TypeVar("AnyChoice")
"""A Choice here or a GemmChoice (pfc/gemm.py): a dtype and its reason."""


@dataclass(frozen=True)
class Choice:
    """The backbone's compute type on one host (or agreed by all), and why."""

    dtype: str
    """"float16" (GPU), "bfloat16" or "float32"."""
    reason: str


def host_choice(config: Config, on_gpu: bool) -> Choice:
    """This host's choice for the config's fp16, cpu_precision and network, probing
    (cached) only where the answer depends on it."""
    if not config.fp16:
        return Choice("float32", "fp16=False")
    if on_gpu:
        return Choice("float16", "fp16=True on a GPU")
    if config.cpu_precision == "float32":
        return Choice("float32", "fp16=True, cpu_precision='float32'")
    kernels.load()  # the probe trains with them: a failed build is named as one, here
    network = (config.network, config.embedding_size, config.dropout)
    return choose(config.cpu_precision, config.network, cached_probe(network),
                  socket.gethostname())


def choose(setting: str, network: str, probe: HostProbe, host: str) -> Choice:
    """"auto" or "bfloat16" on a CPU, from what the probe found on `host`."""
    cpu = f"oneDNN uses {probe.isa}"
    if setting == "bfloat16":
        if probe.bfloat16 != "ok":
            raise PrecisionChoiceError(
                f"cpu_precision='bfloat16': oneDNN cannot run {network} in bfloat16 on "
                f"{host} ({cpu}): {probe.bfloat16}. {why_not(probe, network)}; set "
                "cpu_precision='auto' (float32 on this CPU) or 'float32'")
        speed = "natively" if probe.native else "emulated: slower than float32 here"
        return Choice("bfloat16", f"fp16=True, cpu_precision='bfloat16' ({cpu}, {speed})")
    if not probe.native:
        why = ("bfloat16 would be emulated, slower than float32; cpu_precision='bfloat16' "
               "forces it" if probe.bfloat16 == "ok"
               else f"oneDNN cannot run {network} in bfloat16 here")
        return Choice("float32", f"fp16=True on a CPU without native bfloat16 ({cpu}: {why})")
    if probe.bfloat16 != "ok":
        return Choice("float32", f"fp16=True, but oneDNN could not run {network} in bfloat16 "
                                 f"({cpu}): {probe.bfloat16}; {why_not(probe, network)}")
    return Choice("bfloat16", f"fp16=True on a CPU that computes bfloat16 natively ({cpu})")


def why_not(probe: HostProbe, network: str) -> str:
    """What a failed probe means, and how to ask again."""
    if "AVX2" in probe.isa or probe.isa.endswith(("AVX", "SSE4.1")):
        cause = "bfloat16 convolutions need AVX-512"
    elif "AVX-512" in probe.isa or "AMX" in probe.isa:
        cause = f"oneDNN fails on {network}'s layers in bfloat16 here"
    else:
        cause = "the probe could not find out"
    return (f"{cause} (the answer is kept in {cache_folder()}: delete it to probe again)")


def agree(choices: list[tuple[str, AnyChoice]]) -> AnyChoice:
    """One choice for every rank from each rank's (host, choice), the same on every
    rank: bfloat16 only where every host takes it (a host that takes float32 under
    auto makes the run float32; a forced bfloat16 failed on its own host already).
    The backbone's choices and the classifier GEMMs' (pfc/gemm.py) alike."""
    if len({choice.dtype for _, choice in choices}) == 1:
        return choices[0][1]
    host, choice = min(choices, key=lambda item: item[1].dtype != "float32")
    return dataclasses.replace(choice, reason=f"{choice.reason}, on host {host}; every rank "
                                              "computes alike")


# ----- the probe -----
def cache_folder() -> Path:
    """~/.cache/partial_fc_mx/precision, or one in the temporary folder where that one
    cannot be written (a read-only home, or none): the lock must work either way, or every rank
    would probe at once."""
    try:
        folder = caches.default_cache_dir() / "precision"
        folder.mkdir(parents=True, exist_ok=True)
        if os.access(folder, os.W_OK):
            return folder
    except (OSError, RuntimeError):  # RuntimeError: no home folder
        pass
    return Path(tempfile.gettempdir()) / f"partial_fc_mx-{os.getuid()}" / "precision"


def cached_probe(network: tuple) -> HostProbe:
    """This host's probe from the cache, or run now under a lock: ranks of a host that
    start together probe once."""
    folder = cache_folder()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{probe_key(network)}.json"
    with open(folder / f"{path.name}.lock", "w") as lock:
        with contextlib.suppress(OSError):  # no locks here (Lustre noflock): each probes
            fcntl.flock(lock, fcntl.LOCK_EX)
        if (found := read_probe(path)) is not None:
            return found
        probe, lasting = run_probe(network)
        record = {**asdict(probe), "until": None if lasting else time.time() + PASSING_SECONDS}
        with contextlib.suppress(OSError):  # a full disk: the answer holds, unkept
            durable.write_atomically(path, lambda tmp: tmp.write_text(json.dumps(record)))
        return probe


def read_probe(path: Path) -> HostProbe | None:
    """The kept answer, unless it was one for the ranks starting then only."""
    try:
        record = json.loads(path.read_text())
        until = record.pop("until", None)
        return None if until is not None and time.time() > until else HostProbe(**record)
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def probe_key(network: tuple) -> str:
    """What decides a probe's answer on a host: the CPU, oneDNN's and MXNet's settings,
    MXNet, the network and the code the probe runs. A home folder shared by hosts of
    several CPU kinds keeps one answer per kind."""
    import mxnet as mx

    digest = hashlib.sha256(json.dumps([
        list(network), mx.__version__, cpu_identity(),
        sorted((k, v) for k, v in os.environ.items() if k.startswith(SETTINGS)),
    ]).encode())
    for source in SOURCES:
        digest.update(source.read_bytes())
    return digest.hexdigest()[:16]


def cpu_identity() -> str:
    """The CPU's model name and flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        import platform

        return platform.processor()
    fields = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(dict.fromkeys(fields))


def run_probe(network: tuple) -> tuple[HostProbe, bool]:
    """(the probe, whether its answer lasts): a separate Python runs a small
    convolution (oneDNN then names its ISA), then the network's forward and backward
    in bfloat16. An MXNet error there or a crash is oneDNN's lasting answer; a probe
    killed from outside, out of time or out of memory says so, for now only."""
    env = {**os.environ, "DNNL_VERBOSE": "1"}
    try:
        done = subprocess.run(probe_command(network), env=env, capture_output=True, text=True,
                              timeout=PROBE_SECONDS, start_new_session=True)  # side_process.py
    except subprocess.TimeoutExpired as stopped:
        output = stopped.stdout.decode(errors="replace") if stopped.stdout else ""
        return HostProbe(isa_in(output), f"the probe took more than {PROBE_SECONDS} s"), False
    isa = isa_in(done.stdout)
    results = [line for line in done.stdout.splitlines() if line.startswith(PROBE_RESULT)]
    if done.returncode == 0 and results:
        said = results[-1][len(PROBE_RESULT):].strip()
        return HostProbe(isa, said), "allocate" not in said.lower()
    tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
    died = (f"the probe process died by signal {-done.returncode}" if done.returncode < 0
            else f"the probe process exited with code {done.returncode}")
    return HostProbe(isa, f"{died} ({tail})"), done.returncode in CRASHES


def probe_command(network: tuple) -> list[str]:
    return [sys.executable, "-m", __name__, json.dumps([*network, os.getpid()])]


def isa_in(output: str) -> str:
    found = [line[len(ONEDNN_ISA_LINE):].strip() for line in output.splitlines()
             if line.startswith(ONEDNN_ISA_LINE)]
    return found[0] if found else "an ISA oneDNN did not name"


def probe_here(name: str, embedding_size: int, dropout: float, parent: int) -> None:
    """The probe's own process: a small convolution, then the network in bfloat16 as
    training runs it (forward and backward) and as verification does (inference)."""
    from ..side_process import become_side_process

    become_side_process(parent, nice=False)  # the ranks wait for it
    import mxnet as mx

    from ..config import Config
    from .precision import build_backbone

    x = mx.nd.ones((1, 3, 8, 8))  # oneDNN prints its ISA as it makes its first primitive
    mx.nd.Convolution(x, mx.nd.ones((4, 3, 3, 3)), kernel=(3, 3), num_filter=4,
                      no_bias=True).wait_to_read()
    result = "ok"
    try:
        config = Config(network=name, embedding_size=embedding_size, dropout=dropout)
        net, model = build_backbone(config, mx.cpu(), "bfloat16")
        images = mx.nd.random.uniform(-1, 1, (2, 3, 112, 112))
        with mx.autograd.record():
            embeddings = model(images)
        embeddings.backward()
        model(images).wait_to_read()
        mx.nd.waitall()
    except mx.base.MXNetError as error:
        lines = str(error).strip().splitlines()
        result = lines[-1] if lines else "MXNetError"
    print(PROBE_RESULT + result, flush=True)


if __name__ == "__main__":
    probe_here(*json.loads(sys.argv[1]))
