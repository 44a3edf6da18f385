"""The step's row passes (rows.py): the fused C++ kernels of the CPU and the MXNet
operators a GPU runs, each against float64; and how the kernels are built (kernels/):
loud when they cannot be, once when ranks start together, never half-written."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import mxnet as mx
import numpy as np
import pytest
from conftest import REPO, run

from partial_fc_mx.pfc import kernels
from partial_fc_mx.pfc.buffers import Buffers
from partial_fc_mx.pfc.rows import ComposedRows, FusedRows, InterclassFilter

IMPLEMENTATIONS = {
    "fused": lambda: FusedRows(threads=1),
    "composed": lambda: ComposedRows(Buffers(mx.cpu())),
}


def softmax_with_spare_reference(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    x = logits.astype(np.float64)
    row_max = np.nanmax(x[:, :-1], axis=1)
    x[:, -1] = row_max
    e = np.exp(x - row_max[:, None])
    return e / e.sum(axis=1, keepdims=True), row_max


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
@pytest.mark.parametrize("rows, width, spread", [(3, 2, 1.0), (7, 33, 30.0), (64, 1001, 10.0),
                                                 (5, 4099, 64.0)])
def test_softmax_with_spare_matches_float64(name, rows, width, spread):
    """Each row's softmax with its last entry set to the max of the others (the spare
    center's column), in place; widths that are not a multiple of any vector width."""
    logits = (np.random.default_rng(width).standard_normal((rows, width)) * spread)
    logits = logits.astype(np.float32)
    array = mx.nd.array(logits)
    row_max = IMPLEMENTATIONS[name]().softmax_with_spare(array)
    expected, expected_max = softmax_with_spare_reference(logits)
    assert np.array_equal(row_max.asnumpy(), expected_max.astype(np.float32))
    assert np.allclose(array.asnumpy(), expected, rtol=1e-6, atol=1e-12)


def test_the_fused_exp_is_within_a_few_ulp_down_to_float32s_least_normal_number():
    """The kernel's own exp (a polynomial the compiler vectorizes) over [-87, 0]: within
    2 ulp (each probability over the spare column's, whose exp is 1, is the exp with one
    more rounding), and 0 (not NaN) below. The probabilities themselves carry the row's
    float32 sum of 300,000 entries too, whose rounding depends on the vector width
    (measured 0.4 ulp with AVX-512, 1.3 with AVX2, 3.8 with SSE2): within 8 ulp."""
    x = np.linspace(-87, 0, 300_001).astype(np.float32)
    logits = np.concatenate([x, [-95.0, -300.0, 0.0]]).astype(np.float32)[None]
    array = mx.nd.array(logits)
    FusedRows(threads=1).softmax_with_spare(array)
    got = array.asnumpy()[0].astype(np.float64)
    expected, _ = softmax_with_spare_reference(logits)
    normal = expected[0] > np.finfo(np.float32).tiny
    exps = np.exp(logits[0].astype(np.float64))
    exp_error = np.abs(got / got[-1] - exps)[normal] / exps[normal]
    assert exp_error.max() < 2.5 * 2.0**-23, exp_error.max() / 2.0**-23
    error = np.abs(got - expected[0])[normal] / expected[0][normal]
    assert error.max() < 8 * 2.0**-23, error.max() / 2.0**-23
    assert got[-3] == 0 and got[-2] == 0  # exp(-95), exp(-300): 0 to float32


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_a_nan_logit_is_skipped_by_the_max_and_makes_the_exp_sum_non_finite(name):
    """What the step's NaN check relies on: the spare column's probability,
    1 / (1 + exp-sum), turns non-finite (so does the loss), while the row's max is the
    max of its numbers."""
    logits = np.array([[np.nan, 1, 2, 0], [1, 2, 3, 0]], np.float32)
    array = mx.nd.array(logits)
    row_max = IMPLEMENTATIONS[name]().softmax_with_spare(array)
    assert row_max.asnumpy().tolist() == [2.0, 3.0]
    prob = array.asnumpy()
    with np.errstate(divide="ignore", invalid="ignore"):  # MXNet's is 0, the kernel's NaN
        assert not np.isfinite(1 / prob[0, -1])
    assert np.allclose(prob[1], softmax_with_spare_reference(logits[1:])[0][0], rtol=1e-6)


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_nan_and_infinity_anywhere_in_a_wide_row(name):
    """The vector loops, not only their scalar tails, meet the NaN (positions at the
    start, inside and at the end of a row of 1001 plus the spare) and +Inf: the spare
    column's probability is non-finite in those rows, and only in those."""
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((6, 1002)).astype(np.float32) * 5
    for row, (column, value) in enumerate([(0, np.nan), (517, np.nan), (1000, np.nan),
                                           (333, np.inf)]):
        logits[row, column] = value
    array = mx.nd.array(logits)
    row_max = IMPLEMENTATIONS[name]().softmax_with_spare(array).asnumpy()
    expected_max = [np.nanmax(np.where(np.isnan(r[:-1]), -np.inf, r[:-1])) for r in logits]
    assert row_max.tolist() == np.float32(expected_max).tolist()
    with np.errstate(divide="ignore", invalid="ignore"):
        exp_sums = 1 / array.asnumpy()[:, -1]
    assert (~np.isfinite(exp_sums)).tolist() == [True] * 4 + [False] * 2


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
@pytest.mark.parametrize("rows, width", [(1, 1), (40, 24), (300, 512)])
def test_centers_scale_and_projection_match_float64(name, rows, width):
    rng = np.random.default_rng(rows)
    w = (rng.standard_normal((rows, width)) * rng.uniform(0.01, 100, (rows, 1))).astype(np.float32)
    grad = rng.standard_normal((rows, width)).astype(np.float32)
    implementation = IMPLEMENTATIONS[name]()
    v = mx.nd.zeros((rows, width))
    row_scale = implementation.scale(mx.nd.array(w), 64.0, out=v)
    norms = np.linalg.norm(w.astype(np.float64), axis=1)
    assert np.allclose(row_scale.asnumpy(), 64 / norms, rtol=2e-7)
    assert np.allclose(v.asnumpy(), w * (64 / norms)[:, None], rtol=2e-7, atol=1e-6)
    inverse, scale = 1 / norms**2, rng.uniform(0.5, 2, rows)
    projected = mx.nd.array(grad)
    implementation.project(projected, mx.nd.array(w), mx.nd.array(inverse), mx.nd.array(scale))
    g = grad.astype(np.float64)
    expected = scale[:, None] * (g - ((g * w).sum(axis=1) * inverse)[:, None] * w)
    assert np.allclose(projected.asnumpy(), expected, rtol=1e-5, atol=1e-6)
    if width > 1:  # what is left is orthogonal to its center
        assert np.abs((projected.asnumpy() * w).sum(axis=1) / norms).max() < 1e-4


@pytest.mark.parametrize("march", ["x86-64", "x86-64-v3"])
def test_each_vector_width_the_library_carries_passes_the_same_tests(march, tmp_path):
    """The library picks its code by the CPU it loads on, and this machine runs only one
    of the clones: built once per -march with no clones, the exp, softmax, projection,
    SGD and replay (exact update) tests, and the PReLU and LayerNorm kernels', pass on the baseline
    (SSE2) and AVX2-with-FMA code too. Only their cases that run the kernels: not the
    MXNet-operator (`composed`) ones, nor the whole backbones' graphs."""
    if march == "x86-64-v3" and not {"avx2", "fma"} <= cpu_flags():
        pytest.skip("this CPU cannot run AVX2 with FMA")
    here = Path(__file__).parent
    code = ("import sys, pytest; from partial_fc_mx.pfc import kernels; "
            f"kernels.FLAGS += ['-DPFC_CLONES=', '-march={march}']; "
            f"sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '-k', "
            "'(exp or softmax or nan or non_finite or scale_and_projection or bit_for_bit "
            "or exact_equals_dense_over_200_steps_with_a_resume_on_another_world_size[True] "
            "or prelu_kernel or slope_gradient or layer_norm_kernel or layer_norms_same or "
            "sub_center) and not composed', "
            f"{str(here / 'test_rows.py')!r}, {str(here / 'test_centers.py')!r}, "
            f"{str(here / 'test_idle_rows.py')!r}, {str(here / 'test_cpu_kernels.py')!r}]))")
    env = {**os.environ, "PARTIAL_FC_MX_KERNELS": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], env=env, text=True, capture_output=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and " failed" not in done.stdout, done.stdout[-500:]


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def test_more_threads_give_the_same_bits():
    """Rows are independent: the kernels' OpenMP threads split rows, never a row."""
    logits = np.random.default_rng(0).standard_normal((37, 3001)).astype(np.float32) * 20
    results = []
    for threads in (1, 2, 3):
        array = mx.nd.array(logits)
        row_max = FusedRows(threads).softmax_with_spare(array)
        results.append((array.asnumpy().tobytes(), row_max.asnumpy().tobytes()))
    assert results[0] == results[1] == results[2]


@pytest.mark.parametrize("environment, cores, expected", [
    ({"MXNET_OMP_MAX_THREADS": "3", "OMP_NUM_THREADS": "5"}, 16, 3),
    ({"OMP_NUM_THREADS": "5,2"}, 16, 5),
    ({}, 16, 8),  # MXNet halves the cores on x86 (hyper-threads)
    ({}, 1, 1),   # a rank mpirun bound to one core
])
def test_a_ranks_threads_are_mxnets_choice(monkeypatch, environment, cores, expected):
    """The kernels' OpenMP threads (and the benchmarks') are the count MXNet's own
    operators use in the process."""
    from partial_fc_mx.pfc import threads

    for name in ("MXNET_OMP_MAX_THREADS", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setattr(threads.platform, "machine", lambda: "x86_64")
    assert threads.rank_threads() == expected


def test_the_kernels_take_float32_and_say_so():
    with pytest.raises(mx.base.MXNetError, match="float32"):
        FusedRows(1).softmax_with_spare(mx.nd.ones((2, 3), dtype="float64"))


def test_without_a_compiler_the_build_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("PARTIAL_FC_MX_KERNELS", str(tmp_path / "kernels"))
    with pytest.raises(kernels.KernelBuildError, match="apt-get install g\\+\\+"):
        kernels.build(kernels.mxnet_folder())


def test_a_failed_compile_shows_the_compilers_error_and_leaves_no_library(monkeypatch, tmp_path):
    broken = tmp_path / "rows.cc"
    broken.write_text(kernels.SOURCES[0].read_text() + "\nthis is not C++;\n")
    monkeypatch.setattr(kernels, "SOURCES", [broken, *kernels.SOURCES[1:]])
    monkeypatch.setenv("PARTIAL_FC_MX_KERNELS", str(tmp_path / "kernels"))
    with pytest.raises(kernels.KernelBuildError, match="this is not C"):
        kernels.build(kernels.mxnet_folder())
    built = tmp_path / "kernels"
    assert not list(built.glob("*.so")) and not list(built.glob("*.partial")), list(built.iterdir())


def test_ranks_that_start_together_build_once_and_a_new_source_builds_anew(tmp_path):
    """Three processes ask for the library in an empty folder at once: the compiler runs
    once (a wrapper counts it), all three get the same complete library. Then a changed
    source gets its own library beside the old one."""
    calls = tmp_path / "calls"
    wrapper = tmp_path / "cxx"
    wrapper.write_text(f"#!/bin/sh\ncase \"$*\" in *--version*) ;; *) echo x >> {calls};; esac\n"
                       "exec g++ \"$@\" -O0\n")  # what is tested is the build, not the code
    wrapper.chmod(0o755)
    env = {**os.environ, "CXX": str(wrapper), "PARTIAL_FC_MX_KERNELS": str(tmp_path / "kernels")}
    code = ("from partial_fc_mx.pfc import kernels; "
            "print(kernels.build(kernels.mxnet_folder()))")
    ranks = [subprocess.Popen([sys.executable, "-c", code], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(3)]
    outputs = [rank.communicate(timeout=300) for rank in ranks]
    assert all(rank.returncode == 0 for rank in ranks), outputs
    paths = {out.strip() for out, _ in outputs}
    assert len(paths) == 1 and calls.read_text().count("x") == 1, (paths, calls.read_text())
    library = Path(paths.pop())
    assert library.stat().st_size > 0 and not list(library.parent.glob("*.partial"))
    assert library.stat().st_mode & 0o055 == 0o055  # others may load it from a shared folder

    changed = tmp_path / "rows.cc"
    changed.write_text(kernels.SOURCES[0].read_text() + "\n// a change\n")
    code = ("from pathlib import Path; from partial_fc_mx.pfc import kernels; "
            f"kernels.SOURCES[0] = Path({str(changed)!r}); "
            "print(kernels.build(kernels.mxnet_folder()))")
    done = subprocess.run([sys.executable, "-c", code], env=env, text=True, capture_output=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()) != library and library.is_file()
    assert calls.read_text().count("x") == 2


def test_a_file_system_without_locks_still_builds(monkeypatch, tmp_path):
    """flock on Lustre mounted noflock or NFS nolock fails although the folder is
    writable: each rank then builds, and the library is published whole (compile_to)."""
    def refuse(*args):
        raise OSError(37, "No locks available")

    def compile_to(command, library):
        library.write_bytes(b"built")

    monkeypatch.setenv("PARTIAL_FC_MX_KERNELS", str(tmp_path / "kernels"))
    monkeypatch.setattr(kernels.fcntl, "flock", refuse)
    monkeypatch.setattr(kernels, "compile_to", compile_to)
    library = kernels.build(kernels.mxnet_folder())
    assert library.parent == tmp_path / "kernels" and library.read_bytes() == b"built"


def test_a_damaged_library_is_named_with_what_to_do(monkeypatch, tmp_path):
    damaged = tmp_path / "rows-0123456789abcdef.so"
    damaged.write_bytes(b"")
    monkeypatch.setattr(kernels, "build", lambda mxnet: damaged)
    with pytest.raises(kernels.KernelBuildError, match=f"{damaged}.*delete that file"):
        kernels.load.__wrapped__()  # not the process's cached load


def test_relative_cache_settings_name_absolute_folders(monkeypatch, tmp_path):
    """MXNet loads a library by an absolute path only: relative settings are taken from
    the current folder, and a relative XDG_CACHE_HOME is ignored (the XDG rule)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PARTIAL_FC_MX_KERNELS", "build/kernels")
    assert kernels.kernel_folder() == tmp_path / "build" / "kernels"
    monkeypatch.delenv("PARTIAL_FC_MX_KERNELS")
    monkeypatch.delenv("PFC_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")
    assert kernels.kernel_folder() == Path.home() / ".cache" / "partial_fc_mx" / "kernels"
    monkeypatch.setenv("PFC_CACHE_DIR", "cache")
    assert kernels.kernel_folder() == tmp_path / "cache" / "kernels"


def test_kernels_load_from_a_relative_folder(tmp_path):
    """The library built where the tests build it, found again under a relative
    PARTIAL_FC_MX_KERNELS and loaded (in a process of its own: loaded once there)."""
    library = kernels.build(kernels.mxnet_folder())
    (tmp_path / "build" / "kernels").mkdir(parents=True)
    shutil.copy(library, tmp_path / "build" / "kernels" / library.name)
    done = run([sys.executable, "-c", "from partial_fc_mx.pfc import kernels; kernels.load(); "
                "print('LOADED', kernels.kernel_folder())"], cwd=tmp_path,
               env={**os.environ, "PARTIAL_FC_MX_KERNELS": "build/kernels",
                    "PYTHONPATH": str(REPO)})
    assert done.returncode == 0 and f"LOADED {tmp_path}/build/kernels" in done.stdout, done.stdout


def test_kernels_that_another_user_could_write_are_refused(monkeypatch, tmp_path):
    """Every training process loads the library: a folder or library that others can
    write, or that another user owns, is refused with what to do, before any build."""
    folder = tmp_path / "kernels"
    monkeypatch.setenv("PARTIAL_FC_MX_KERNELS", str(folder))
    monkeypatch.setattr(kernels, "compile_to", lambda command, library: library.write_bytes(b"x"))
    library = kernels.build(kernels.mxnet_folder())  # a folder of our own: built
    folder.chmod(0o777)
    with pytest.raises(kernels.KernelBuildError, match=f"{folder}: it can be written by other "
                                                        "users.*chmod go-w"):
        kernels.build(kernels.mxnet_folder())
    folder.chmod(0o755)
    library.chmod(0o666)  # planted, or swapped in
    with pytest.raises(kernels.KernelBuildError, match=f"{library}: it can be written"):
        kernels.build(kernels.mxnet_folder())
    library.chmod(0o755)
    assert kernels.build(kernels.mxnet_folder()) == library
    if os.geteuid() == 0:  # chown needs root, as the suite runs in CI
        os.chown(library, 12345, -1)
        with pytest.raises(kernels.KernelBuildError, match=f"{library}: it is owned by uid "
                                                            "12345"):
            kernels.build(kernels.mxnet_folder())
        os.chown(library, 0, -1)
        monkeypatch.setattr(kernels.os, "getuid", lambda: 12345)  # root's files: trusted
        assert kernels.build(kernels.mxnet_folder()) == library


def test_the_toolkits_own_kernel_folder_is_made_private_whatever_the_umask(monkeypatch,
                                                                           tmp_path):
    """A umask of 002 (per-user groups) makes the cache folders group-writable: the
    kernels' own folder is then tightened, not refused."""
    monkeypatch.delenv("PARTIAL_FC_MX_KERNELS", raising=False)
    monkeypatch.setenv("PFC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(kernels, "compile_to", lambda command, library: library.write_bytes(b"x"))
    (tmp_path / "cache" / "kernels").mkdir(parents=True)
    (tmp_path / "cache" / "kernels").chmod(0o775)
    library = kernels.build(kernels.mxnet_folder())
    assert library.parent == tmp_path / "cache" / "kernels"
    assert library.parent.stat().st_mode & 0o777 == 0o755


def test_a_new_build_removes_what_old_and_killed_builds_left(monkeypatch, tmp_path):
    """A killed build's temporary file (older than an hour) and a library of another
    source or compiler built over 30 days ago, with its lock file, go when a new library
    is built; recent ones stay (another rank's build, another host's library)."""
    folder = tmp_path / "kernels"
    folder.mkdir()
    month, hour = 31 * 86400, 2 * 3600
    files = {"tmpold.so.partial": hour, "tmpnew.so.partial": 60, "rows-0ld.so": month,
             "rows-0ld.so.lock": month, "rows-recent.so": 86400}
    for name, age in files.items():
        (folder / name).write_bytes(b"x")
        os.utime(folder / name, (time.time() - age, time.time() - age))
    monkeypatch.setenv("PARTIAL_FC_MX_KERNELS", str(folder))
    monkeypatch.setattr(kernels, "compile_to", lambda command, library: library.write_bytes(b"x"))
    library = kernels.build(kernels.mxnet_folder())
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        ["tmpnew.so.partial", "rows-recent.so", library.name, f"{library.name}.lock"])
    os.utime(library, (time.time() - 31 * 86400,) * 2)
    kernels.build(kernels.mxnet_folder())  # loaded again: in use, young again
    assert time.time() - library.stat().st_mtime < 60


def test_an_unwritable_kernel_folder_is_named(monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("PARTIAL_FC_MX_KERNELS", str(blocker / "kernels"))
    with pytest.raises(kernels.KernelBuildError, match="PARTIAL_FC_MX_KERNELS"):
        kernels.build(kernels.mxnet_folder())


def test_a_folder_without_hard_links_still_gets_the_library(monkeypatch, tmp_path):
    """s3fs, vfat and some CIFS mounts refuse os.link: the build is published by a rename
    there, whole, and nothing partial is left."""
    def refuse(*args):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setenv("PARTIAL_FC_MX_KERNELS", str(tmp_path / "kernels"))
    monkeypatch.setattr(kernels.os, "link", refuse)
    monkeypatch.setattr(kernels, "FLAGS", [*kernels.FLAGS, "-O0"])  # the build is tested
    library = kernels.build(kernels.mxnet_folder())
    assert library.stat().st_size > 0 and not list(library.parent.glob("*.partial"))


def test_no_home_folder_is_a_build_error_that_names_the_setting(monkeypatch):
    """A container's uid without a passwd entry and no HOME: Path.home() raises, and the
    error says where to build instead (the preflight reports it on every rank)."""
    def homeless():
        raise RuntimeError("Could not determine home directory.")

    for name in ("PARTIAL_FC_MX_KERNELS", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(kernels.Path, "home", homeless)
    with pytest.raises(kernels.KernelBuildError, match="home directory.*PARTIAL_FC_MX_KERNELS"):
        kernels.build(kernels.mxnet_folder())


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
@pytest.mark.parametrize("k, classes", [(2, 1), (3, 257), (4, 33), (16, 5), (3, 1000)])
def test_the_sub_center_max_and_its_way_back_match_numpy(name, k, classes):
    """Each class's logit the max of its k consecutive entries (a NaN kept), then each
    class's probability to its first entry of the largest logit and 0 to the others;
    class counts across the kernel's blocks of 256 and vector widths."""
    rng = np.random.default_rng(k * classes)
    sub = (rng.standard_normal((7, classes * k)) * 10).astype(np.float32)
    sub[0, :k] = 1.0  # a tie: the first entry takes it
    if classes > 1:
        sub[1, k] = np.nan  # the second class of row 1: NaN
    implementation = IMPLEMENTATIONS[name]()
    out = mx.nd.full((7, classes + 1), -5.0)
    implementation.subcenter_max(mx.nd.array(sub), k, out)
    got = out.asnumpy()
    with np.errstate(invalid="ignore"):
        expected = sub.reshape(7, classes, k).max(axis=2)
    if classes > 1:
        expected[1, 1] = np.nan
    np.testing.assert_array_equal(got[:, :classes], expected)
    assert (got[:, classes] == -5.0).all()  # the spare column is the softmax's to set
    prob = rng.random((7, classes + 1)).astype(np.float32)
    finite = np.nan_to_num(sub, nan=-np.inf)
    array = mx.nd.array(finite)
    implementation.subcenter_scatter(array, mx.nd.array(prob), k)
    best = finite.reshape(7, classes, k).argmax(axis=2)  # numpy's: the first of a tie
    want = np.zeros((7, classes, k), np.float32)
    np.put_along_axis(want, best[..., None], prob[:, :classes, None], 2)
    np.testing.assert_array_equal(array.asnumpy(), want.reshape(7, -1))


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_the_filtered_softmax_leaves_out_what_is_above_the_threshold_but_the_target(name):
    """Entries above the threshold count as 0 in the max and the exp-sum and take
    probability 0; a row's target never, whatever its logit; the spare column as in
    the plain softmax; each row's count of filtered entries; a NaN stays in."""
    rng = np.random.default_rng(4)
    logits = (rng.standard_normal((6, 41)) * 20).astype(np.float32)
    target = np.array([3, -1, 40 - 1, 0, -1, 7])
    logits[0, 3] = 50.0  # a target far above the threshold
    logits[4, 5] = np.nan
    rows = np.flatnonzero(target >= 0)
    where = mx.nd.array(np.stack([rows, target[rows]]), dtype="int64")
    interclass = InterclassFilter(8.0, mx.nd.array(target, dtype="int64"), where)
    array = mx.nd.array(logits)
    row_max, filtered = IMPLEMENTATIONS[name]().filtered_softmax_with_spare(array, interclass)
    x = logits[:, :-1].astype(np.float64)
    dirty = x > 8.0
    dirty[rows, target[rows]] = False
    kept = np.where(dirty, 0.0, x)
    expected, expected_max = softmax_with_spare_reference(
        np.concatenate([kept, logits[:, -1:]], 1))
    expected[:, :-1][dirty] = 0
    finite = np.arange(6) != 4
    np.testing.assert_allclose(array.asnumpy()[finite], expected[finite], rtol=1e-6, atol=1e-12)
    np.testing.assert_array_equal(row_max.asnumpy()[finite], expected_max[finite])
    assert filtered.asnumpy().tolist() == dirty.sum(1).tolist()
    assert array.asnumpy()[0, 3] == array.asnumpy()[0, -1] > 0.49  # the target is the max
    with np.errstate(divide="ignore", invalid="ignore"):  # MXNet's is 0, the kernel's NaN
        assert not np.isfinite(1 / array.asnumpy()[4, -1])  # the NaN row's exp-sum
