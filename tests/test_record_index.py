"""train.idx parsed in numpy and cached: the same records as a line-by-line parse, a
cache that is used only while it is this index's and intact, read-only datasets, and
datasets past 2^24 images (whose header count float32 rounds)."""

from __future__ import annotations

import os
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

from partial_fc_mx.data import DataError, record_index
from partial_fc_mx.data.record_index import open_index, parse_index, parse_lines


def write_index(path: Path, pairs) -> Path:
    path.write_bytes("".join(f"{k}\t{o}\n" for k, o in pairs).encode())
    return path


def random_pairs(seed: int, count: int = 500) -> list[tuple[int, int]]:
    """Shuffled ids with repeats, offsets of 1 to 15 digits."""
    rng = np.random.default_rng(seed)
    keys = rng.permutation(count * 2)[:count]
    keys[::50] = keys[1::50]  # an id listed twice: the later line wins
    offsets = rng.integers(0, 10 ** rng.integers(1, 16, count), dtype=np.int64)
    return list(zip(keys.tolist(), offsets.tolist()))


def as_dict(index) -> dict:
    return {int(k): int(o) for k, o in zip(index.keys, index.offsets)}


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("chunk", [7, 64, 1 << 26])
def test_numpy_parse_is_the_line_by_line_parse(tmp_path, monkeypatch, seed, chunk):
    """Lines split across chunks, shuffled ids, a repeated id: the arrays, sorted by
    id, and the fingerprint (size and CRC-32 of the file) are the slow parse's."""
    monkeypatch.setattr(record_index, "CHUNK", chunk)
    pairs = random_pairs(seed)
    path = write_index(tmp_path / "train.idx", pairs)
    keys, offsets, fingerprint = parse_index(path)
    slow_keys, slow_offsets, slow_fingerprint = parse_lines(path)
    assert keys.tolist() == slow_keys.tolist() == sorted(dict(pairs))
    last = dict(pairs)
    assert offsets.tolist() == slow_offsets.tolist() == [last[k] for k in sorted(last)]
    data = path.read_bytes()
    assert fingerprint == slow_fingerprint == {"bytes": len(data), "crc32": zlib.crc32(data)}


def test_other_whitespace_is_accepted_and_a_bad_line_is_named(tmp_path):
    path = tmp_path / "train.idx"
    path.write_bytes(b"0\t0\n1 40\r\n2\t 96\n3\t128")  # no newline at the end either
    keys, offsets, _ = parse_index(path)
    assert keys.tolist() == [0, 1, 2, 3] and offsets.tolist() == [0, 40, 96, 128]
    path.write_bytes(b"0\t0\n1\t40\n2\t-96\n")
    with pytest.raises(DataError, match=r"train\.idx line 3 is not 'record_id<TAB>offset': "
                                        r"b'2\\t-96'"):
        parse_index(path)


def test_the_cache_is_used_while_it_is_this_index_and_intact(tmp_path, monkeypatch):
    path = write_index(tmp_path / "train.idx", random_pairs(3))
    expected = as_dict(open_index(path))
    cache = tmp_path / "train.idx.cache"
    assert cache.is_file() and not list(tmp_path.glob(".*partial"))

    def no_parse(path):
        raise AssertionError("parsed although the cache is valid")

    with monkeypatch.context() as patch:
        patch.setattr(record_index, "parse_index", no_parse)
        cached = open_index(path)
        assert as_dict(cached) == expected and isinstance(cached.keys, np.memmap)

    payload = record_index.HEADER_BYTES + 100  # a bit flipped inside the arrays
    damaged = bytearray(cache.read_bytes())
    damaged[payload] ^= 0x10
    for broken in (bytes(damaged), cache.read_bytes()[:-8], b"garbage" * 700, b""):
        cache.write_bytes(broken)
        assert as_dict(open_index(path)) == expected
        assert cache.read_bytes() != broken  # rebuilt

    stale = random_pairs(4)  # the index rewritten: the cache names the old one
    write_index(path, stale)
    assert as_dict(open_index(path)) == dict(stale)


def test_lookups_and_counts(tmp_path):
    index = open_index(write_index(tmp_path / "train.idx", [(0, 0), (1, 10), (2, 20), (5, 50)]))
    assert len(index) == 4 and list(index) == [0, 1, 2, 5]
    assert 5 in index and 3 not in index and index[2] == 20
    with pytest.raises(KeyError):
        index[3]
    assert index.count_between(1, 3) == 2 and index.count_between(0, 6) == 4
    assert index.count_between(3, 5) == 0


def test_a_read_only_dataset_keeps_its_cache_in_the_users_cache(tmp_path):
    """Real read-only bind mounts: a new index is cached in cache_dir, nothing is
    written beside it, and the next open maps that cache; an index whose cache was
    built beside it before the folder became read-only uses that one."""
    fresh, built, cache = tmp_path / "fresh", tmp_path / "built", tmp_path / "cache"
    for folder in (fresh, built):
        folder.mkdir()
        write_index(folder / "train.idx", random_pairs(5))
    open_index(built / "train.idx")  # train.idx.cache beside it, while writable
    opens = "; ".join(
        f"a = open_index(Path({str(d / 'train.idx')!r}), Path({str(cache)!r})); "
        f"b = open_index(Path({str(d / 'train.idx')!r}), Path({str(cache)!r})); "
        "print('SAME', (a.keys == b.keys).all() and (a.offsets == b.offsets).all(), "
        "type(b.keys).__name__)" for d in (fresh, built))
    check = (f"import sys; sys.path.insert(0, {os.getcwd()!r}); from pathlib import Path; "
             f"from partial_fc_mx.data.record_index import open_index; {opens}")
    mounts = " && ".join(f"mount --bind {d} {d} && mount -o remount,bind,ro {d}"
                         for d in (fresh, built))
    result = subprocess.run(["unshare", "--mount", "sh", "-c",
                             f"{mounts} && {sys.executable} -c \"{check}\""],
                            capture_output=True, text=True, timeout=120)
    assert result.stdout.count("SAME True memmap") == 2, result.stdout + result.stderr
    assert sorted(p.name for p in fresh.iterdir()) == ["train.idx"]
    assert len(list((cache / "index").glob("train.idx-*.cache"))) == 1  # fresh's alone
    assert result.stderr.count("parsing ") == 1


def test_no_home_folder_keeps_the_cache_beside_the_index(tmp_path, monkeypatch):
    """A container's uid without a passwd entry and no HOME: the index still opens,
    cached beside it, and no folder named "~" appears in the current one."""
    def homeless():
        raise RuntimeError("Could not determine home directory.")

    for name in ("PFC_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(record_index.Path, "home", homeless)
    monkeypatch.chdir(tmp_path)
    path = write_index(tmp_path / "train.idx", random_pairs(3))
    assert as_dict(open_index(path)) == dict(random_pairs(3))
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [
        "train.idx", "train.idx.cache"]


def test_a_dataset_mounted_at_another_path_uses_the_same_cache(tmp_path):
    """Hosts that mount one dataset at different paths (a real bind mount here): the
    second path maps the cache the first built, parses nothing and replaces nothing
    (a host still mapping a replaced file can fault on NFS)."""
    data, alias = tmp_path / "data", tmp_path / "alias"
    data.mkdir()
    alias.mkdir()
    write_index(data / "train.idx", random_pairs(4))
    check = (f"import os, sys; sys.path.insert(0, {os.getcwd()!r}); from pathlib import Path; "
             "from partial_fc_mx.data.record_index import open_index; "
             f"open_index(Path({str(data / 'train.idx')!r})); "
             f"first = os.stat({str(data / 'train.idx.cache')!r}).st_ino; "
             f"index = open_index(Path({str(alias / 'train.idx')!r})); "
             f"print('SAME', os.stat({str(data / 'train.idx.cache')!r}).st_ino == first, "
             "type(index.keys).__name__)")
    result = subprocess.run(["unshare", "--mount", "sh", "-c",
                             f"mount --bind {data} {alias} && {sys.executable} -c \"{check}\""],
                            capture_output=True, text=True, timeout=120)
    assert "SAME True memmap" in result.stdout, result.stdout + result.stderr
    assert result.stderr.count("parsing ") == 1


def test_ranks_opening_at_once_build_one_cache(tmp_path):
    """Three processes open a new index at once: one parses it (each builder says so),
    the others wait on the lock and map its cache."""
    path = write_index(tmp_path / "train.idx", random_pairs(6, 20000))
    code = (f"import sys; sys.path.insert(0, {os.getcwd()!r}); from pathlib import Path; "
            "from partial_fc_mx.data.record_index import open_index; "
            f"i = open_index(Path({str(path)!r})); print(len(i), int(i.offsets.sum()))")
    workers = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for _ in range(3)]
    results = [worker.communicate(timeout=120) for worker in workers]
    assert all(worker.returncode == 0 for worker in workers), results
    expected = dict(random_pairs(6, 20000))
    assert {out for out, _ in results} == {f"{len(expected)} {sum(expected.values())}\n"}
    assert sum(err.count("parsing ") for _, err in results) == 1, results
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".train.idx.cache.lock", "train.idx", "train.idx.cache"]


def test_numbers_past_int64_are_a_data_error(tmp_path):
    path = tmp_path / "train.idx"
    path.write_bytes(b"0\t0\n1\t123456789012345678901\n")
    with pytest.raises(DataError, match="line 2 is not 'record_id<TAB>offset'"):
        parse_index(path)


# ----- past 2^24 images -----

@pytest.mark.parametrize("images", [16_777_218, 16_777_216])
def test_a_dataset_past_2_24_images_counts_them_in_the_index(tmp_path, images):
    """The header's end (images + 1) reads back from float32 rounded: 16,777,219 as
    16,777,220 (the first id float32 stores alike is the end), 16,777,217 as
    16,777,216 (the second one is). The index decides (the last image, then an
    identity record), and inspect says where the count came from."""
    from partial_fc_mx.bench.index import generate_dataset
    from partial_fc_mx.data.recordio import RecordDataset, float32_candidates
    from partial_fc_mx.prep.inspect import header_summary

    stated = float(np.float32(images + 1))
    assert stated != images + 1 and images + 1 in float32_candidates(stated)
    generate_dataset(tmp_path, images)
    dataset = RecordDataset(tmp_path)
    assert len(dataset) == images and dataset.header_images == stated - 1
    assert dataset.record_ids(np.array([0, images - 1])).tolist() == [1, images]
    assert f"{images:,} images counted in the index" in header_summary(dataset)
    assert f"stores {stated - 1:,.0f}" in header_summary(dataset)


def test_float32_candidates_below_2_24_are_exact():
    from partial_fc_mx.data.recordio import float32_candidates

    assert float32_candidates(12345.0) == [12345]
    assert float32_candidates(float(2**24 - 1)) == [2**24 - 1]
    assert float32_candidates(float(2**24)) == [2**24, 2**24 + 1]  # 2^24 + 1 rounds down
