"""What fp16=True means on a CPU host (cpu_precision.py): the probe of what oneDNN runs,
under the CPU's own ISA and under oneDNN's caps (DNNL_MAX_CPU_ISA: AVX2 is how an AMD
Zen 2/3 or a pre-Ice Lake Intel CPU runs), its cache, the choice, the agreement of
ranks on different CPUs, and the forced settings in real 2-process runs."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest
from conftest import (
    REPO,
    bfloat16_native,
    bfloat16_runs,
    config_file,
    logged,
    mpirun,
    onednn_cap,
    python_module,
    run,
    train_args,
)

from partial_fc_mx.config import Config
from partial_fc_mx.run import cpu_precision
from partial_fc_mx.run.cpu_precision import Choice, HostProbe, PrecisionChoiceError

TINY = ("tiny", 64, 0.0)
NATIVE = "Intel AVX-512 with Intel DL Boost and bfloat16 support"
EMULATED = "Intel AVX-512 with AVX512BW, AVX512VL, and AVX512DQ extensions"
FAILED = "MXNetError: could not create a primitive descriptor iterator"


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Every test probes into its own cache (other tests share the suite's)."""
    monkeypatch.setenv("PFC_CACHE_DIR", str(tmp_path / "cache"))


def errors(output: str) -> list[str]:
    return re.findall(r"^error: (.*)$", output, flags=re.MULTILINE)


# ----- the choice, from what a probe found -----
@pytest.mark.parametrize("isa, runs, expected", [
    (NATIVE, "ok", "bfloat16"),
    (NATIVE, FAILED, "float32"),  # a native CPU where this network does not run
    (EMULATED, "ok", "float32"),  # runs, but emulated: slower than float32
    ("Intel AVX2", FAILED, "float32"),
])
def test_auto_takes_bfloat16_only_where_the_cpu_computes_it_natively(isa, runs, expected):
    choice = cpu_precision.choose("auto", "r50", HostProbe(isa, runs), "host-a")
    assert choice.dtype == expected
    assert isa in choice.reason


def test_forced_bfloat16_runs_where_onednn_can_and_is_refused_where_it_cannot():
    emulated = cpu_precision.choose("bfloat16", "r50", HostProbe(EMULATED, "ok"), "host-a")
    assert emulated.dtype == "bfloat16" and "emulated: slower than float32" in emulated.reason
    with pytest.raises(PrecisionChoiceError) as refused:
        cpu_precision.choose("bfloat16", "r50", HostProbe("Intel AVX2", FAILED), "host-b")
    message = str(refused.value)
    assert message.startswith("cpu_precision='bfloat16': oneDNN cannot run r50 in bfloat16 "
                              "on host-b (oneDNN uses Intel AVX2)")
    assert "bfloat16 convolutions need AVX-512 (the answer is kept in " in message
    assert "delete it to probe again); set cpu_precision='auto' (float32 on this CPU) or " \
           "'float32'" in message
    with pytest.raises(PrecisionChoiceError, match="oneDNN fails on mobilefacenet's layers in "
                                                   "bfloat16 here"):
        cpu_precision.choose("bfloat16", "mobilefacenet", HostProbe(NATIVE, "the probe process "
                                                                    "died by signal 11"), "c")


def test_settings_without_a_probe():
    tiny = {"network": "tiny", "embedding_size": 64}
    assert cpu_precision.host_choice(Config(**tiny), on_gpu=False).dtype == "float32"
    assert cpu_precision.host_choice(Config(fp16=True, **tiny), on_gpu=True).dtype == "float16"
    forced = Config(fp16=True, cpu_precision="float32", **tiny)
    assert cpu_precision.host_choice(forced, on_gpu=False) == Choice(
        "float32", "fp16=True, cpu_precision='float32'")


def test_kernels_that_cannot_be_built_are_named_before_any_probe(monkeypatch):
    """The probe trains with the CPU's PReLU kernel: a failed build is the build's error,
    raised before probing, not an answer about bfloat16 (nor cached as one)."""
    from partial_fc_mx.pfc import kernels

    def cannot_build():
        raise kernels.KernelBuildError("no g++ here")

    monkeypatch.setattr(cpu_precision.kernels, "load", cannot_build)
    monkeypatch.setattr(cpu_precision, "cached_probe", lambda network: pytest.fail("probed"))
    with pytest.raises(kernels.KernelBuildError, match="no g\\+\\+ here"):
        cpu_precision.host_choice(Config(network="tiny", embedding_size=64, fp16=True),
                                  on_gpu=False)


def test_ranks_agree_on_float32_when_any_host_takes_it():
    native = Choice("bfloat16", "native")
    avx2 = Choice("float32", "fp16=True on a CPU without native bfloat16")
    assert cpu_precision.agree([("a", native), ("a", native)]) == native
    agreed = cpu_precision.agree([("a", native), ("b", avx2), ("a", native)])
    assert agreed.dtype == "float32"
    assert agreed.reason == ("fp16=True on a CPU without native bfloat16, on host b; every "
                             "rank computes alike")


# ----- the probe, in its own process -----
@pytest.mark.parametrize("cap", [None, "AVX512_CORE", "AVX2"])
def test_the_probe_reports_what_onednn_does_under_each_isa_cap(monkeypatch, cap):
    """Checked against the CPU's flags, read independently of the code tested: on this
    machine's CPU and under oneDNN's caps, which reproduce other CPUs (the AVX2 cap
    fails a bfloat16 convolution exactly as an AVX2-only EPYC does)."""
    env = {"DNNL_MAX_CPU_ISA": cap} if cap else {}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    probe, lasting = cpu_precision.run_probe(TINY)
    assert lasting
    assert probe.native == bfloat16_native(env), probe
    assert (probe.bfloat16 == "ok") == bfloat16_runs(env), probe
    if not bfloat16_runs(env):
        assert "could not create a primitive descriptor" in probe.bfloat16
    if cap == "AVX2":
        assert "AVX-512" not in probe.isa and "AVX" in probe.isa
    expected = "bfloat16" if bfloat16_native(env) else "float32"
    assert cpu_precision.choose("auto", "tiny", probe, "here").dtype == expected


def fake_probe(monkeypatch, script: str) -> None:
    """The probe's process replaced by `script`."""
    monkeypatch.setattr(cpu_precision, "probe_command",
                        lambda network: [sys.executable, "-c", script])


def test_what_a_probe_says_lasts_unless_it_was_killed_late_or_out_of_memory(monkeypatch):
    fake_probe(monkeypatch, "import os; print('dnnl_verbose,info,cpu,isa:Intel AVX2', "
                            "flush=True); os.abort()")
    crashed, lasting = cpu_precision.run_probe(TINY)
    assert crashed == HostProbe("Intel AVX2", crashed.bfloat16) and lasting
    assert crashed.bfloat16.startswith("the probe process died by signal 6")
    fake_probe(monkeypatch, "print('PROBE MXNetError: could not create a primitive')")
    refused, lasting = cpu_precision.run_probe(TINY)
    assert refused.bfloat16 == "MXNetError: could not create a primitive" and lasting
    fake_probe(monkeypatch, "print('PROBE MXNetError: Failed to allocate CPU Memory')")
    assert not cpu_precision.run_probe(TINY)[1]
    fake_probe(monkeypatch, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    killed, lasting = cpu_precision.run_probe(TINY)
    assert "signal 9" in killed.bfloat16 and not lasting
    fake_probe(monkeypatch, "raise ImportError('a broken install')")
    broken, lasting = cpu_precision.run_probe(TINY)
    assert "exited with code 1 (ImportError: a broken install)" in broken.bfloat16
    assert not lasting
    monkeypatch.setattr(cpu_precision, "PROBE_SECONDS", 1)
    fake_probe(monkeypatch, "import time; time.sleep(30)")
    late, lasting = cpu_precision.run_probe(TINY)
    assert late.bfloat16 == "the probe took more than 1 s" and not lasting


def test_a_passing_answer_serves_the_ranks_starting_now_only(monkeypatch):
    """A probe killed from outside is not the host's answer: the ranks that start with
    it take it (not one probe after another), a later start probes again."""
    ran = []
    monkeypatch.setattr(cpu_precision, "run_probe", lambda network: ran.append(1) or (
        HostProbe("Intel AVX2", "the probe took more than 300 s"), False))
    first = cpu_precision.cached_probe(TINY)
    assert cpu_precision.cached_probe(TINY) == first and len(ran) == 1
    later = time.time() + cpu_precision.PASSING_SECONDS + 1
    monkeypatch.setattr(cpu_precision.time, "time", lambda: later)
    cpu_precision.cached_probe(TINY)
    assert len(ran) == 2


def test_a_home_that_cannot_be_written_probes_into_the_temporary_folder(tmp_path,
                                                                         monkeypatch):
    home = tmp_path / "not-a-folder"  # (root writes into read-only folders: a file then)
    home.write_text("")
    monkeypatch.setenv("PFC_CACHE_DIR", str(home / "cache"))
    monkeypatch.setattr(cpu_precision.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    monkeypatch.setattr(cpu_precision, "run_probe", lambda network: (
        HostProbe("Intel AVX2", "x"), True))
    assert cpu_precision.cached_probe(TINY) == HostProbe("Intel AVX2", "x")
    kept = list((tmp_path / "tmp").glob("partial_fc_mx-*/precision/*.json"))
    assert len(kept) == 1


def test_the_probe_is_cached_per_onednn_setting(monkeypatch):
    ran = []
    real = cpu_precision.run_probe
    monkeypatch.setattr(cpu_precision, "run_probe", lambda network: ran.append(1) or real(network))
    first = cpu_precision.cached_probe(TINY)
    assert cpu_precision.cached_probe(TINY) == first and len(ran) == 1
    other = "AVX" if onednn_cap() == "AVX2" else "AVX2"  # another setting than the suite's
    monkeypatch.setenv("DNNL_MAX_CPU_ISA", other)
    capped = cpu_precision.cached_probe(TINY)
    assert len(ran) == 2 and capped.bfloat16 != "ok"
    cpu_precision.cached_probe(("mobilefacenet", 64, 0.0))
    assert len(ran) == 3


COUNTING_PROBE = """
from partial_fc_mx.run import cpu_precision
real, ran = cpu_precision.run_probe, []
cpu_precision.run_probe = lambda network: ran.append(1) or real(network)
cpu_precision.cached_probe(("tiny", 64, 0.0))
print("RAN", len(ran), flush=True)
"""


def test_processes_that_start_together_probe_once():
    processes = [subprocess.Popen([sys.executable, "-c", COUNTING_PROBE], cwd=REPO, text=True,
                                  stdout=subprocess.PIPE) for _ in range(3)]
    outputs = [process.communicate(timeout=300)[0] for process in processes]
    assert sorted(outputs) == ["RAN 0\n", "RAN 0\n", "RAN 1\n"], outputs


# ----- real runs -----
FORCED = {
    "cpu_precision": ({"fp16": True, "cpu_precision": "bfloat16"},
                      "cpu_precision='bfloat16': oneDNN cannot run tiny in bfloat16",
                      "set cpu_precision='auto' (float32 on this CPU) or 'float32'"),
    "pfc_gemm": ({"pfc_gemm": "bfloat16"},
                 "pfc_gemm='bfloat16': oneDNN 3 uses avx2 on this CPU, without bfloat16",
                 "set pfc_gemm='auto' (float32 here) or 'float32'"),
}
"""The backbone's and the classifier GEMMs' bfloat16, each forced under the AVX2 cap."""


@pytest.mark.parametrize("forced", FORCED)
def test_forced_bfloat16_where_onednn_cannot_run_it_stops_both_ranks_with_one_message(
        tmp_path, synthetic, forced):
    settings, start, fix = FORCED[forced]
    config = config_file(tmp_path, synthetic, max_steps=2, **settings)
    result = mpirun(2, train_args(config, tmp_path / "work"), timeout=300,
                    env={"DNNL_MAX_CPU_ISA": "AVX2"})
    assert result.returncode == 1, result.stdout[-3000:]
    said = errors(result.stdout)
    assert len(said) == 1, result.stdout[-3000:]
    assert said[0].startswith(start) and fix in said[0], said[0]
    assert "Traceback" not in result.stdout


def test_ranks_on_different_cpus_train_alike(tmp_path, synthetic):
    """Rank 1's oneDNN capped at AVX2 (an older host beside a newer one): under auto
    both ranks compute in float32, backbone and classifier GEMMs, and the log says
    which host decided; forced
    bfloat16 is refused on both, naming rank 1 where rank 0 could run it."""
    auto = config_file(tmp_path, synthetic, name="auto.py", fp16=True, max_steps=2,
                       pfc_gemm="auto")
    mixed = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-x", "PATH",
             "-np", "1", *train_args(auto, tmp_path / "auto"), ":",
             "-np", "1", "env", "DNNL_MAX_CPU_ISA=AVX2", *train_args(auto, tmp_path / "auto")]
    result = run(mixed, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]
    text = logged(tmp_path / "auto")["text"]
    assert "backbone in float32 (fp16=True on a CPU without native bfloat16" in text
    if bfloat16_native():
        assert "on host" in text and "every rank computes alike" in text
    # the classifier GEMMs alike: float32 on both, the capped host's reason given
    assert "classifier GEMMs: float32 inputs (pfc_gemm='auto': oneDNN 3 uses avx2" in text
    forced = config_file(tmp_path, synthetic, name="forced.py", fp16=True,
                         cpu_precision="bfloat16", max_steps=2)
    refused = run([arg if arg != str(auto) else str(forced) for arg in mixed], timeout=300)
    assert refused.returncode == 1
    said = errors(refused.stdout)
    assert len(said) == 1, refused.stdout[-3000:]
    # rank 0's own refusal may read differently (an AVX2 CPU with AVX-VNNI names its ISA
    # "Intel AVX2 with Intel DL Boost"): one message either way, naming rank 1
    if bfloat16_runs():
        assert said[0].startswith("rank 1: cpu_precision='bfloat16': oneDNN cannot run tiny")
    else:
        assert "cpu_precision='bfloat16': oneDNN cannot run tiny" in said[0]


@pytest.mark.parametrize("cap", [None, "AVX2"])
def test_the_preflight_says_which_precision_it_will_use(tmp_path, synthetic, cap):
    env = {"DNNL_MAX_CPU_ISA": cap} if cap else {}
    config = config_file(tmp_path, synthetic, fp16=True)
    result = run(python_module("check", str(config)), env=env)
    assert result.returncode == 0, result.stdout[-3000:]
    expected = "bfloat16" if bfloat16_native(env) else "float32"
    assert f"backbone in {expected}: fp16=True on a CPU " in result.stdout
    forced = config_file(tmp_path, synthetic, name="forced.py", fp16=True,
                         cpu_precision="bfloat16")
    result = run(python_module("check", str(forced)), env=env)
    problems = [line for line in result.stdout.splitlines() if line.startswith("PROBLEM")]
    if bfloat16_runs(env):
        assert result.returncode == 0 and not problems, result.stdout[-3000:]
        assert "backbone in bfloat16: fp16=True, cpu_precision='bfloat16'" in result.stdout
    else:
        assert result.returncode == 1 and len(problems) == 1, result.stdout[-3000:]
        assert "cpu_precision='bfloat16': oneDNN cannot run tiny in bfloat16" in problems[0]


def test_a_file_system_without_locks_still_gets_an_answer(monkeypatch, tmp_path):
    """flock fails on Lustre mounted noflock: the rank probes without the lock."""
    def refuse(*args):
        raise OSError(37, "No locks available")

    probe = HostProbe("Intel AVX2", "refused")
    monkeypatch.setattr(cpu_precision.fcntl, "flock", refuse)
    monkeypatch.setattr(cpu_precision, "cache_folder", lambda: tmp_path)
    monkeypatch.setattr(cpu_precision, "run_probe", lambda network: (probe, True))
    assert cpu_precision.cached_probe(("tiny", 64, 0.0)) == probe
