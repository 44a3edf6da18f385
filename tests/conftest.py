"""Helpers shared by the tests: launching real processes, and small datasets on disk."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# PATH without the project's venv: the system's python3 and tools, as before an install
SYSTEM_PATH = os.pathsep.join(d for d in os.environ["PATH"].split(os.pathsep) if Path(d) != BIN)


def start(cmd: list[str], env: dict | None = None, cwd: Path = REPO) -> subprocess.Popen:
    """Start a command in its own session (process group): a launcher killed alone
    would leave its ranks running, spinning in Horovod's loop. Its output goes to a
    file, not a pipe, so a process it leaves behind (a remote MPI daemon that lost its
    link) cannot keep the test waiting for the end of the output."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    output = tempfile.TemporaryFile("w+")
    process = subprocess.Popen(cmd, cwd=cwd, env=full_env, text=True, start_new_session=True,
                               stdout=output, stderr=subprocess.STDOUT,
                               preexec_fn=as_from_a_terminal)
    process.output = output
    return process


def as_from_a_terminal() -> None:
    """Ctrl-C and hang-ups reach the command as they would from a terminal, even when
    the suite itself runs under nohup or in a background job (which ignore SIGHUP,
    SIGINT): a shell cannot trap a signal that was ignored when it started, and the
    stop tests would find run.sh deaf to them."""
    for number in (signal.SIGINT, signal.SIGHUP):
        signal.signal(number, signal.SIG_DFL)


def output_of(process: subprocess.Popen) -> str:
    process.output.seek(0)
    return process.output.read()


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL the process and everything it started in its session."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def finish(process: subprocess.Popen, timeout: float) -> subprocess.CompletedProcess:
    """Wait for a started command; past `timeout` kill its whole group and fail."""
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(process)
        process.wait()
        raise AssertionError(f"{' '.join(map(str, process.args))[:300]} did not finish "
                             f"within {timeout} s; output:\n{output_of(process)[-3000:]}"
                             ) from None
    finally:
        kill_group(process)  # nothing it started may outlive it
    return subprocess.CompletedProcess(process.args, process.returncode, output_of(process))


def rank_pids(pattern: str) -> list[int]:
    """The training processes whose command line matches (not the launcher's)."""
    found = subprocess.run(["pgrep", "-f", pattern], text=True, stdout=subprocess.PIPE)
    pids = [int(p) for p in found.stdout.split()]
    return [p for p in pids if Path(f"/proc/{p}/comm").read_text().startswith("python")]


def run(cmd: list[str], timeout: float = 300, env: dict | None = None,
        cwd: Path = REPO) -> subprocess.CompletedProcess:
    """Run a command to completion; stdout and stderr together in `.stdout`."""
    return finish(start(cmd, env, cwd), timeout)


def mpirun_command(np: int, args: list[str]) -> list[str]:
    return ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(np),
            "-x", "PATH", "-x", "PYTHONUNBUFFERED", *args]


def mpirun(np: int, args: list[str], **kwargs) -> subprocess.CompletedProcess:
    return run(mpirun_command(np, args), **kwargs)


def horovodrun_gloo_command(np: int, args: list[str]) -> list[str]:
    return [str(BIN / "horovodrun"), "-np", str(np), "-H", f"localhost:{np}", "--gloo", *args]


def horovodrun_gloo(np: int, args: list[str], **kwargs) -> subprocess.CompletedProcess:
    return run(horovodrun_gloo_command(np, args), **kwargs)


def python_module(*args: str) -> list[str]:
    return [sys.executable, "-m", "partial_fc_mx", *args]


# ----- what this CPU runs (oneDNN's ISA depends on it; docs/tests.md) -----
CPU_FLAGS = set(" ".join(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                         if line.startswith("flags")).split())
ONEDNN_BELOW_AVX512 = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX512_MIC", "AVX512_MIC_4OPS"}
ONEDNN_BELOW_BF16 = ONEDNN_BELOW_AVX512 | {"AVX512_CORE", "AVX512_CORE_VNNI"}


def onednn_cap(env: dict | None = None) -> str:
    """DNNL_MAX_CPU_ISA where the processes a test starts run: its env, else the
    suite's own (a whole suite run under the AVX2 cap)."""
    return ({**os.environ, **(env or {})}.get("DNNL_MAX_CPU_ISA") or "ALL").upper()


def bfloat16_runs(env: dict | None = None) -> bool:
    """Whether oneDNN can build bfloat16 convolutions here: AVX-512 (avx512_core) and
    no cap below it. Read from the CPU's flags, independently of the code tested."""
    avx512_core = {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= CPU_FLAGS
    return avx512_core and onednn_cap(env) not in ONEDNN_BELOW_AVX512


def bfloat16_native(env: dict | None = None) -> bool:
    """Whether the CPU computes bfloat16 natively (AVX512_BF16 or AMX) and oneDNN may
    use it: what cpu_precision='auto' trains the 16-bit backbone in bfloat16 on."""
    flags = bool({"avx512_bf16", "amx_bf16"} & CPU_FLAGS)
    return flags and bfloat16_runs(env) and onednn_cap(env) not in ONEDNN_BELOW_BF16


def sixteen_bits(env: dict | None = None) -> tuple[dict, str]:
    """(config keys, the backbone's compute type) of a test of the 16-bit path: the
    AMP graph forced into bfloat16 wherever oneDNN runs it, else what auto does on a
    CPU that cannot (float32)."""
    if bfloat16_runs(env):
        return {"fp16": True, "cpu_precision": "bfloat16"}, "bfloat16"
    return {"fp16": True}, "float32"


ISA_CAPS = [None, "AVX2"]
"""The oneDNN settings the ISA-dependent tests run under: the CPU's own, and capped at
AVX2 (no AVX-512: how AMD Zen 2/3 and older Intel CPUs run)."""


def isa_env(cap: str | None) -> dict:
    return {"DNNL_MAX_CPU_ISA": cap} if cap else {}


def pytest_configure(config):
    """Settings of the whole suite, for its time on CI's two cores (docs/tests.md).

    The C++ kernels stay where the suite first built them (the toolkit's default
    folder, or PARTIAL_FC_MX_KERNELS as given), also for the tests that give the
    toolkit a cache folder of their own (PFC_CACHE_DIR: a precision probe, a GPU
    preflight): a build costs 13 s of CPU, and each of those tests built anew. The
    tests of the kernels' own build and folder set or clear PARTIAL_FC_MX_KERNELS
    themselves (test_rows.py, test_check.py, test_parity.py). Set, the variable skips
    the toolkit's tightening of its own folder, so that is done here; without a home
    folder (no default) it stays unset, and the tests that need kernels say why."""
    from partial_fc_mx.caches import default_cache_dir
    from partial_fc_mx.pfc.kernels import only_owner_writes

    if "PARTIAL_FC_MX_KERNELS" not in os.environ:
        with contextlib.suppress(RuntimeError):  # no home folder
            kernels = default_cache_dir() / "kernels"
            if kernels.is_dir():
                only_owner_writes(kernels)
            os.environ["PARTIAL_FC_MX_KERNELS"] = str(kernels)
    # Open MPI's ranks wait for a message by polling a core unless the host is
    # oversubscribed; the suite runs two tests' ranks at once on CI's two cores, so a
    # rank waiting in a collective yields its core to the other test's ranks (5-15% less
    # CPU for the same runs, measured on test_stop_and_resume.py and a 15-step training).
    os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")


@pytest.fixture(autouse=True)
def venv_on_path(monkeypatch):
    """Launchers and child processes find the venv's python, mpirun and horovodrun."""
    monkeypatch.setenv("PATH", f"{BIN}{os.pathsep}{os.environ['PATH']}")


@pytest.fixture(scope="session")
def fake_driver(tmp_path_factory) -> Path:
    """A directory holding the stand-in libcuda.so.1, for LD_LIBRARY_PATH."""
    directory = tmp_path_factory.mktemp("driver")
    subprocess.run(["gcc", "-shared", "-fPIC", "-Wall", "-o", str(directory / "libcuda.so.1"),
                    str(REPO / "tests" / "fake_libcuda.c")], check=True)
    return directory


# ----- training runs on a small synthetic dataset -----
CLASSES = 120


@pytest.fixture(scope="session")
def synthetic(tmp_path_factory) -> Path:
    """120 synthetic identities x 6 images (720: a whole number of global batches of
    24 x 1, 2 or 3 processes), and 400 held-out verification pairs."""
    from partial_fc_mx.prep.synthetic import prepare_synthetic

    directory = tmp_path_factory.mktemp("data") / "syn"
    prepare_synthetic(str(directory), CLASSES, per_class=6, heldout=40, pairs=200, seed=1)
    return directory


def config_file(tmp_path: Path, data: Path | str, name: str = "config.py", **keys) -> Path:
    values = {"rec": str(data), "num_classes": CLASSES, "network": "tiny",
              "embedding_size": 64, "batch_size": 24, "lr": 0.1, "num_epoch": 4,
              "margin_list": (1.0, 0.0, 0.35), "scale": 32.0, "frequent": 1, "verbose": 1000,
              "num_workers": 1, "stall_timeout": 120, **keys}
    path = tmp_path / name
    path.write_text("".join(f"{k} = {v!r}\n" for k, v in values.items()))
    return path


def train_args(config: Path, work_dir: Path, *extra: str) -> list[str]:
    return python_module("train", str(config), "--work-dir", str(work_dir), *extra)


def logged(work_dir: Path) -> dict:
    """From metrics.jsonl: {step: loss}, [(step, accuracy)] in the order written, every
    step record (loss, learning_rate, epoch, step, images seen after it, ...); and the
    text of training.log."""
    records = [json.loads(line) for line in (work_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    accuracy = [(r["step"], r["accuracy"]) for r in records if r["kind"] == "evaluation"]
    return {"losses": {r["step"]: r["loss"] for r in steps}, "steps": steps,
            "accuracy": accuracy, "text": (work_dir / "training.log").read_text()}


def wait_for_step(job, work: Path, step: int, timeout: float = 240) -> None:
    """Until metrics.jsonl has a record of `step`; fails if the job ends first."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert job.poll() is None, "the job ended early"
        try:
            if max(logged(work)["losses"], default=0) >= step:
                return
        except (OSError, ValueError):  # not yet written, or a line half-written
            pass
        time.sleep(0.5)
    raise AssertionError(f"step {step} not reached within {timeout} s")


def damage_header(directory: Path, record_id: int) -> None:
    """Cut record `record_id` to 10 bytes: shorter than its IRHeader."""
    import mxnet as mx

    from partial_fc_mx.data.recordio import RecordDataset

    records = RecordDataset(directory).records
    writer = mx.recordio.MXIndexedRecordIO(str(directory / "x.idx"), str(directory / "x.rec"),
                                           "w")
    for key in sorted(records.offsets):
        raw = records.read_bytes(key)
        writer.write_idx(key, raw[:10] if key == record_id else raw)
    writer.close()
    (directory / "x.rec").replace(directory / "train.rec")
    (directory / "x.idx").replace(directory / "train.idx")


SRUN_STUB = """#!/bin/sh
# srun as the Slurm tests see it: each call is a line of $SRUN_LOG; a probe of a node
# named in $SRUN_DEAD fails; a training launch fails the first $SRUN_FAILURES times.
echo "srun $* CONFIG=$CONFIG PFC_COMMAND=$PFC_COMMAND" >> "$SRUN_LOG"
last=$(eval echo \\${$#})
case " $* " in *" -w $SRUN_DEAD true "*) exit 1 ;; esac
[ "$last" = true ] && exit 0
failed=$(cat "$SRUN_LOG.failed" 2>/dev/null || echo 0)
if [ -z "$PFC_COMMAND" ] && [ "$failed" -lt "${SRUN_FAILURES:-0}" ]; then
  echo $((failed + 1)) > "$SRUN_LOG.failed"
  echo "srun: error: $SRUN_DEAD: task 9: Killed"
  echo "srun: error: nodea: tasks 0-7: Killed"
  exit 137
fi
exit 0
"""


def slurm_job(tmp_path: Path, nodes: tuple = ("nodea", "nodeb"), per_node: int = 8) -> dict:
    """The environment of a Slurm batch job on `nodes` with stub srun and scontrol."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "srun").write_text(SRUN_STUB)
    (stubs / "scontrol").write_text('#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && '
                                    'echo "$3" | tr , "\\n"\n')
    for stub in ("srun", "scontrol"):
        (stubs / stub).chmod(0o755)
    return {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}",
            "SRUN_LOG": str(tmp_path / "srun.log"), "SLURM_SUBMIT_DIR": str(tmp_path),
            "SLURM_JOB_NODELIST": ",".join(nodes), "SLURM_NTASKS": str(per_node * len(nodes)),
            "SLURM_NTASKS_PER_NODE": f"{per_node}(x{len(nodes)})"}
