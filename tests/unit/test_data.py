"""hora.data: shard() and shard_files() give disjoint, deterministic, complete shares."""
import itertools
import os

import pytest

import hora.data as data
from hora.errors import NotInitializedError

pytestmark = pytest.mark.timeout(30)


def _all(n, size, **kw):
    return [list(data.shard(list(range(n)), rank=r, size=size, **kw)) for r in range(size)]


@pytest.mark.parametrize("n,size", [(0, 1), (1, 3), (7, 3), (9, 3), (10, 4), (3, 5), (100, 7)])
def test_default_uses_every_item_once_and_says_how_uneven(n, size):
    shares = _all(n, size)
    assert sorted(itertools.chain(*shares)) == list(range(n))
    # rank r takes positions r, r+size, ... (DistributedSampler's interleaving)
    for r, share in enumerate(shares):
        assert share == [i for i in range(n) if i % size == r]
    one = data.shard(list(range(n)), rank=0, size=size)
    assert (one.min_len, one.max_len) == (min(map(len, shares)), max(map(len, shares)))
    assert one.is_even == (n % size == 0)
    assert one.total == n


@pytest.mark.parametrize("n,size", [(7, 3), (9, 3), (2, 5)])
def test_drop_last_gives_equal_shares_without_the_tail(n, size):
    shares = _all(n, size, drop_last=True)
    assert {len(s) for s in shares} == {n // size}
    used = sorted(itertools.chain(*shares))
    assert used == list(range(n // size * size))


@pytest.mark.parametrize("n,size", [(7, 3), (9, 3), (2, 5), (1, 4)])
def test_pad_repeats_from_the_start_to_equal_shares(n, size):
    shares = _all(n, size, pad=True)
    per = -(-n // size)
    assert {len(s) for s in shares} == {per}
    flat = list(itertools.chain(*shares))
    assert set(flat) == set(range(n))
    padded = [(list(range(n)) * size)[i] for i in range(per * size)]
    assert sorted(flat) == sorted(padded)


def test_shuffle_is_deterministic_disjoint_and_changes_with_epoch():
    a = _all(50, 4, shuffle_seed=3, epoch=1)
    assert a == _all(50, 4, shuffle_seed=3, epoch=1)
    assert sorted(itertools.chain(*a)) == list(range(50))
    assert a != _all(50, 4, shuffle_seed=3, epoch=2)
    assert a != _all(50, 4, shuffle_seed=4, epoch=1)
    assert a != _all(50, 4)


def test_items_of_any_kind():
    assert list(data.shard("abcdefg", rank=2, size=3)) == ["c", "f"]
    assert list(data.shard((x * x for x in range(5)), rank=1, size=2)) == [1, 9]
    s = data.shard(list("abcdefg"), rank=0, size=3)
    assert s[1] == "d" and s[-1] == "g" and s[0:2] == ["a", "d"]
    assert list(data.shard_indices(5, rank=1, size=2)) == [1, 3]


def test_single_process_without_a_launcher_gets_everything(monkeypatch):
    for k in ("HORA_RANK", "HORA_SIZE", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID", "RANK",
              "PMI_RANK"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HORA_SAGEMAKER_ROOT", "/nonexistent-hora-test")
    assert list(data.shard(range(4))) == [0, 1, 2, 3]


def test_launched_but_not_initialized_refuses(monkeypatch):
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    with pytest.raises(NotInitializedError, match="rank 1 of 2"):
        data.shard(range(4))
    # explicit rank and size need no job
    assert list(data.shard(range(4), rank=1, size=2)) == [1, 3]


@pytest.mark.parametrize("kw,err", [
    (dict(rank=3, size=3), ValueError), (dict(rank=-1, size=2), ValueError),
    (dict(rank=0, size=0), ValueError), (dict(rank=0.0, size=2), TypeError),
    (dict(rank=0, size=2, drop_last=True, pad=True), ValueError)])
def test_bad_arguments(kw, err):
    with pytest.raises(err):
        data.shard(range(4), **kw)


def test_shard_files_sorted_disjoint_complete(tmp_path):
    names = [f"part-{i:02d}.csv" for i in (5, 1, 9, 3, 0, 7, 2)]
    for name in names:
        (tmp_path / name).write_text(name)
    (tmp_path / "skip.txt").write_text("")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "part-99.csv").write_text("")
    expected = sorted(str(tmp_path / n) for n in names)
    shares = [list(data.shard_files(tmp_path / "*.csv", rank=r, size=3)) for r in range(3)]
    assert shares == [expected[r::3] for r in range(3)]
    # a directory: every non-hidden file below it
    (tmp_path / ".hidden").write_text("")
    every = list(data.shard_files(tmp_path, rank=0, size=1))
    assert every == sorted([*expected, str(tmp_path / "skip.txt"),
                            str(tmp_path / "sub" / "part-99.csv")])
    recursive = list(data.shard_files(str(tmp_path / "**" / "*.csv"), rank=0, size=1))
    assert recursive == sorted([*expected, str(tmp_path / "sub" / "part-99.csv")])


def test_shard_files_without_matches(tmp_path):
    with pytest.raises(FileNotFoundError, match="no files match"):
        data.shard_files(tmp_path / "*.nothing", rank=0, size=1)


# -- read_tfrecords ---------------------------------------------------------------------------
def test_read_tfrecords_reads_a_fifo_front_to_back(tmp_path):
    import threading

    from tests.sagemaker_tree import tfrecord
    records = [b"", b"x", bytes(range(256)) * 40]
    fifo = tmp_path / "train_0_0"
    os.mkfifo(fifo)

    def write():
        with open(fifo, "wb") as f:
            for r in records:
                f.write(tfrecord(r))
    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    assert list(data.read_tfrecords(fifo)) == records
    writer.join(timeout=5)


@pytest.mark.parametrize("cut", [5, 12 + 3])
def test_read_tfrecords_names_a_stream_cut_short(tmp_path, cut):
    from tests.sagemaker_tree import tfrecord
    path = tmp_path / "part.tfrecord"
    path.write_bytes(tfrecord(b"first") + tfrecord(b"second")[:cut])
    reader = data.read_tfrecords(path)
    assert next(reader) == b"first"
    with pytest.raises(ValueError, match="part.tfrecord: the stream ends inside"):
        next(reader)
