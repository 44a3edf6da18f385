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
separate process (`probe`): a oneDNN failure there, an exception or a crash, never
reaches a training process. The answer is cached per host (the CPU, oneDNN's
settings, MXNet and the network's code are its key), so ranks that start together
probe once, and later runs not at all. Every rank then takes the same precision
(`agree`).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from . import caches, durable
from .errors import UserError

PROBE_SECONDS = 900
"""The probe's time limit: r200's forward and backward on two images takes seconds."""
ONEDNN_ISA_LINE = "dnnl_verbose,info,cpu,isa:"
PROBE_RESULT = "PROBE "
SOURCES = [Path(__file__).with_name("precision.py"), *sorted(
    (Path(__file__).parent / "backbones").glob("*.py"))]
"""The code a probe runs besides MXNet: a change in it probes again."""


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


@dataclass(frozen=True)
class Choice:
    """The backbone's compute type on one host (or agreed by all), and why."""

    dtype: str
    """"float16" (GPU), "bfloat16" or "float32"."""
    reason: str


def host_choice(setting: str, fp16: bool, on_gpu: bool, network: tuple) -> Choice:
    """This host's choice for `network` = (name, embedding_size, dropout), probing
    (cached) only where the answer depends on it."""
    if not fp16:
        return Choice("float32", "fp16=False")
    if on_gpu:
        return Choice("float16", "fp16=True on a GPU")
    if setting == "float32":
        return Choice("float32", "fp16=True, cpu_precision='float32'")
    return choose(setting, network[0], cached_probe(network), socket.gethostname())


def choose(setting: str, network: str, probe: HostProbe, host: str) -> Choice:
    """"auto" or "bfloat16" on a CPU, from what the probe found on `host`."""
    cpu = f"oneDNN uses {probe.isa}"
    if setting == "bfloat16":
        if probe.bfloat16 != "ok":
            why = ("bfloat16 convolutions need AVX-512" if "AVX-512" not in probe.isa
                   else f"oneDNN fails on {network}'s layers in bfloat16 here")
            raise PrecisionChoiceError(
                f"cpu_precision='bfloat16': oneDNN cannot run {network} in bfloat16 on "
                f"{host} ({cpu}): {probe.bfloat16}. {why}; set cpu_precision='auto' "
                "(float32 on this CPU) or 'float32'")
        speed = "natively" if probe.native else "emulated: slower than float32 here"
        return Choice("bfloat16", f"fp16=True, cpu_precision='bfloat16' ({cpu}, {speed})")
    if not probe.native:
        why = ("bfloat16 would be emulated, slower than float32; cpu_precision='bfloat16' "
               "forces it" if probe.bfloat16 == "ok"
               else f"oneDNN cannot run {network} in bfloat16 here")
        return Choice("float32", f"fp16=True on a CPU without native bfloat16 ({cpu}: {why})")
    if probe.bfloat16 != "ok":
        return Choice("float32", f"fp16=True, but oneDNN could not run {network} in bfloat16 "
                                 f"({cpu}): {probe.bfloat16}")
    return Choice("bfloat16", f"fp16=True on a CPU that computes bfloat16 natively ({cpu})")


def agree(choices: list[tuple[str, Choice]]) -> Choice:
    """One choice for every rank from each rank's (host, choice), the same on every
    rank: bfloat16 only where every host takes it (a host that takes float32 under
    auto makes the run float32; a forced bfloat16 failed on its own host already)."""
    if len({choice.dtype for _, choice in choices}) == 1:
        return choices[0][1]
    host, choice = min(choices, key=lambda item: item[1].dtype != "float32")
    return Choice("float32", f"{choice.reason}, on host {host}; every rank computes alike")


# ----- the probe -----
def cached_probe(network: tuple) -> HostProbe:
    """This host's probe from the cache, or run now under a lock: ranks of a host that
    start together probe once."""
    folder = caches.default_cache_dir() / "precision"
    path = folder / f"{probe_key(network)}.json"
    if (found := read_probe(path)) is not None:
        return found
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / f"{path.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if (found := read_probe(path)) is not None:
                return found
            probe, lasting = run_probe(network)
            if lasting:
                durable.write_atomically(path, lambda tmp: tmp.write_text(
                    json.dumps(asdict(probe))))
            return probe
    except OSError:  # no cache folder to write (a read-only home): probe, keep nothing
        return run_probe(network)[0]


def read_probe(path: Path) -> HostProbe | None:
    try:
        return HostProbe(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def probe_key(network: tuple) -> str:
    """What decides a probe's answer on a host: the CPU, oneDNN's settings, MXNet, the
    network and the code that builds it. A home folder shared by hosts of several CPU
    kinds keeps one answer per kind."""
    import mxnet as mx

    digest = hashlib.sha256(json.dumps([
        list(network), mx.__version__, cpu_identity(),
        sorted((k, v) for k, v in os.environ.items()
               if k.startswith(("DNNL_", "ONEDNN_", "MKLDNN_"))),
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
    """(the probe, whether it may be cached): a separate Python runs a small
    convolution (oneDNN then names its ISA), then the network's forward and backward
    in bfloat16. Killed from outside or out of time, it says so and is not cached."""
    env = {**os.environ, "DNNL_VERBOSE": "1"}
    try:
        done = subprocess.run(probe_command(network), env=env, capture_output=True, text=True,
                              timeout=PROBE_SECONDS)
    except subprocess.TimeoutExpired as stopped:
        output = stopped.stdout.decode(errors="replace") if stopped.stdout else ""
        return HostProbe(isa_in(output), f"the probe took more than {PROBE_SECONDS} s"), False
    isa = isa_in(done.stdout)
    results = [line for line in done.stdout.splitlines() if line.startswith(PROBE_RESULT)]
    if results:
        return HostProbe(isa, json.loads(results[-1][len(PROBE_RESULT):])), True
    tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
    died = (f"the probe process died by signal {-done.returncode}" if done.returncode < 0
            else f"the probe process exited with code {done.returncode}")
    interrupted = done.returncode in (-9, -15, -2)  # killed from outside: try again later
    return HostProbe(isa, f"{died} ({tail})"), not interrupted


def probe_command(network: tuple) -> list[str]:
    return [sys.executable, "-m", __name__, json.dumps(list(network))]


def isa_in(output: str) -> str:
    found = [line[len(ONEDNN_ISA_LINE):].strip() for line in output.splitlines()
             if line.startswith(ONEDNN_ISA_LINE)]
    return found[0] if found else "an ISA oneDNN did not name"


def probe_here(name: str, embedding_size: int, dropout: float) -> None:
    """The probe's own process: a small convolution, then the network in bfloat16 as
    training runs it (forward and backward) and as verification does (inference)."""
    import mxnet as mx

    from .config import Config
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
    print(PROBE_RESULT + json.dumps(result), flush=True)


if __name__ == "__main__":
    probe_here(*json.loads(sys.argv[1]))
