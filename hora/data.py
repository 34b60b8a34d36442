"""Give each rank its own share of the data: lists, files, SageMaker channels.

    import hora, hora.data
    hora.init()
    for path in hora.data.shard_files("data/train-*.csv", shuffle_seed=0, epoch=epoch):
        ...

Every rank computes the same order (sorted, then shuffled with the same seed) and takes every
``size``-th element starting at its rank, as PyTorch's ``DistributedSampler`` does, so the
shares are disjoint and together cover the data.  When the data does not divide evenly the
remainder is explicit, never silent:

- ``drop_last=False`` (default): every item is used once; the first ``len % size`` ranks get
  one more item than the others.  :class:`Shard` says so (``min_len``, ``max_len``,
  ``is_even``); the ranks that run out first call ``hora.join()`` (Horovod's answer to
  uneven data) or stop after ``min_len`` items.
- ``drop_last=True``: the tail is dropped; every rank gets ``len // size`` items.
- ``pad=True``: items from the start are repeated; every rank gets ``ceil(len / size)``
  (``DistributedSampler``'s default).

Rank and size default to the running job's.  Before ``hora.init()`` a process that no
launcher started is a job of one (it gets everything); one that a launcher started as one of
several raises :class:`~hora.errors.NotInitializedError` rather than read every rank's data.

Layer: beside the framework bindings; imports hora.core and hora.errors only.
"""
from __future__ import annotations

import collections.abc
import glob
import math
import os
import struct
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Sequence, TypeVar, Union

from .core import state
from .core.sagemaker import read_sagemaker_env, sagemaker_root
from .core.topology import detect_placement
from .errors import NotInitializedError, SageMakerConfigError, SharedPipeError

__all__ = ["Shard", "shard", "shard_indices", "shard_files", "sagemaker_channel",
           "sagemaker_files", "read_tfrecords"]

T = TypeVar("T")
PathLike = Union[str, "os.PathLike[str]"]


class Shard(Sequence[T]):
    """One rank's share: a read-only sequence of items, plus how the data was divided.

    Attributes:
        rank, size: whose share this is, out of how many.
        indices: positions of this share's items in the (sorted) input.
        total: number of items in the input.
        min_len, max_len: the shortest and the longest share of any rank.
        is_even: every rank has the same number of items.
    """

    def __init__(self, items: Sequence[T], indices: Iterable[int], rank: int, size: int,
                 total: int, min_len: int, max_len: int) -> None:
        self._items = items
        self.indices = tuple(indices)
        self.rank = rank
        self.size = size
        self.total = total
        self.min_len = min_len
        self.max_len = max_len

    @property
    def is_even(self) -> bool:
        return self.min_len == self.max_len

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: Union[int, slice]) -> Any:
        if isinstance(i, slice):
            return [self._items[j] for j in self.indices[i]]
        return self._items[self.indices[i]]

    def __repr__(self) -> str:
        return (f"Shard(rank={self.rank}, size={self.size}, len={len(self)}, total={self.total}, "
                f"min_len={self.min_len}, max_len={self.max_len})")


def _job(rank, size):
    """(rank, size, local_size) from the arguments, the running job, or the launcher's env."""
    if state.is_initialized():
        topo = state.topology()
        job = (topo.rank, topo.size, topo.local_size)
    else:
        placement = detect_placement()
        if placement.size > 1 and (rank is None or size is None):
            raise NotInitializedError(
                f"this process is rank {placement.rank} of {placement.size} "
                f"({placement.source}), but hora")
        job = (0, 1, 1)
    rank = job[0] if rank is None else rank
    size = job[1] if size is None else size
    for name, value in (("rank", rank), ("size", size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"rank {rank} of size {size}: expected 0 <= rank < size, size >= 1")
    return rank, size, job[2]


def shard_indices(n: int, rank: Optional[int] = None, size: Optional[int] = None,
                  shuffle_seed: Optional[int] = None, epoch: int = 0, drop_last: bool = False,
                  pad: bool = False) -> Shard[int]:
    """This rank's positions in ``range(n)``: see :func:`shard`.  Returns a :class:`Shard`
    of ints."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    if drop_last and pad:
        raise ValueError("drop_last=True and pad=True contradict each other; choose one")
    rank, size, _ = _job(rank, size)
    order = list(range(n))
    if shuffle_seed is not None:
        import numpy as np
        # the same seed and epoch give the same permutation on every rank
        order = np.random.default_rng([int(shuffle_seed), int(epoch)]).permutation(n).tolist()
    if drop_last:
        per = n // size
        order = order[:per * size]
        min_len = max_len = per
    elif pad:
        per = math.ceil(n / size)
        missing = per * size - n
        while missing > 0 and order:        # repeat from the start (more than once if n < size)
            extra = order[:missing]
            order = order + extra
            missing -= len(extra)
        min_len = max_len = per if n else 0
    else:
        min_len, max_len = n // size, math.ceil(n / size)
    return Shard(range(n), order[rank::size], rank, size, n, min_len, max_len)


def shard(items: Iterable[T], rank: Optional[int] = None, size: Optional[int] = None,
          shuffle_seed: Optional[int] = None, epoch: int = 0, drop_last: bool = False,
          pad: bool = False) -> Shard[T]:
    """This rank's share of ``items``: disjoint from every other rank's, the same on every call.

    Args:
        items: a sequence (list, tuple, range, numpy array, dataset with ``__len__`` and
            ``__getitem__``), or any iterable, which is read into a list first.
        rank, size: default to the job's (see the module docstring before ``init()``).
        shuffle_seed: None keeps the input order; an int shuffles, identically on every rank.
        epoch: mixed into the shuffle so that each epoch has a new order
            (``DistributedSampler.set_epoch``).
        drop_last: drop the tail so that every rank has ``len // size`` items.
        pad: repeat items so that every rank has ``ceil(len / size)`` items.

    Returns:
        A :class:`Shard` (a sequence of this rank's items, with ``min_len``/``max_len``).

    Raises:
        ValueError: a bad rank/size, or both ``drop_last`` and ``pad``.
        NotInitializedError: launched as one of several ranks, called before ``hora.init()``
            without explicit ``rank`` and ``size``.

    Example:
        >>> list(shard(list("abcdefg"), rank=1, size=3))
        ['b', 'e']
        >>> shard(list("abcdefg"), rank=1, size=3).max_len
        3
    """
    if not (isinstance(items, collections.abc.Sequence)
            or (hasattr(items, "__len__") and hasattr(items, "__getitem__"))):
        items = list(items)
    chosen = shard_indices(len(items), rank, size, shuffle_seed, epoch, drop_last, pad)
    return Shard(items, chosen.indices, chosen.rank, chosen.size, chosen.total,
                 chosen.min_len, chosen.max_len)


def _list_files(pattern):
    path = Path(pattern)
    if path.is_dir():
        found = []
        for top, dirs, files in os.walk(path):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            found.extend(os.path.join(top, f) for f in files if not f.startswith("."))
    else:
        found = [p for p in glob.glob(os.fspath(pattern), recursive=True) if os.path.isfile(p)]
    # sorted: directory listing order differs between hosts and file systems
    return sorted(found)


def shard_files(pattern: PathLike, rank: Optional[int] = None, size: Optional[int] = None,
                shuffle_seed: Optional[int] = None, epoch: int = 0, drop_last: bool = False,
                pad: bool = False) -> Shard[str]:
    """This rank's share of the files matching ``pattern`` (a glob; ``**`` recurses), or of
    every file under a directory (hidden names skipped).  Files are sorted by path before
    sharding, so every rank sees the same list; see :func:`shard` for the options.

    Raises:
        FileNotFoundError: nothing matches ``pattern``.
    """
    files = _list_files(pattern)
    if not files:
        raise FileNotFoundError(f"shard_files({os.fspath(pattern)!r}): no files match")
    return shard(files, rank, size, shuffle_seed, epoch, drop_last, pad)


# -- SageMaker channels ---------------------------------------------------------------------
def _sagemaker(root):
    sm = read_sagemaker_env(root)
    if sm is None:
        where = sagemaker_root(root) / "input" / "config" / "resourceconfig.json"
        raise SageMakerConfigError(f"not in a SageMaker training container: {where} does not "
                                   f"exist (set HORA_SAGEMAKER_ROOT or root= for another tree)")
    return sm


def _choose_channel(sm, name, rank):
    """(channel, shared): the per-rank channel ``name_<rank>`` when the job has one, else
    ``name`` itself, which every rank of the host shares."""
    own = f"{name}_{rank}"
    listed = sm.channels
    if own in listed or (not listed and sm.channel_dir(own).is_dir()):
        return own, False
    pipes = list(sm.data_dir.glob(f"{glob.escape(name)}_[0-9]*")) if not listed else []
    if name in listed or (not listed and (sm.channel_dir(name).is_dir() or pipes)):
        return name, True
    known = ", ".join(sorted(listed)) or "none listed"
    raise SageMakerConfigError(f"SageMaker job has no channel {own!r} or {name!r} "
                               f"(channels: {known})")


def sagemaker_channel(name: str = "train", epoch: int = 0, root: Optional[PathLike] = None,
                      rank: Optional[int] = None, local_size: Optional[int] = None) -> Path:
    """Where this rank reads SageMaker input channel ``name``.

    A job that gives every rank its own channel (``train_0``, ``train_1``, ...: SageMaker's
    way to feed several Pipe-mode readers on one host) gets ``train_<rank>``.  Otherwise
    the channel ``name`` is shared: in File mode its directory is returned (shard its files
    with :func:`sagemaker_files`); in Pipe mode its FIFO may have only one reader per host.

    Args:
        name: the channel's name, as in the training job's ``InputDataConfig``.
        epoch: for Pipe mode: which FIFO (``<channel>_<epoch>``); SageMaker opens a new one
            for each pass.
        root: the SageMaker base directory (default HORA_SAGEMAKER_ROOT or ``/opt/ml``).
        rank, local_size: default to the job's.

    Returns:
        The channel's directory (File, FastFile) or FIFO path (Pipe).

    Raises:
        SharedPipeError: the channel is in Pipe mode, shared, and this host runs more than
            one rank: the readers would split the stream and deadlock.
        SageMakerConfigError: not in SageMaker, or no such channel.
    """
    if rank is None or local_size is None:
        job_rank, _, job_local = _job(None, None)
        rank = job_rank if rank is None else rank
        local_size = job_local if local_size is None else local_size
    sm = _sagemaker(root)
    channel, shared = _choose_channel(sm, name, rank)
    if sm.input_mode(channel) != "Pipe":
        return sm.channel_dir(channel)
    if shared and local_size > 1:
        raise SharedPipeError(
            f"channel {channel!r} is in Pipe mode and {local_size} ranks on host "
            f"{sm.current_host} would all read its FIFO {sm.data_dir / f'{channel}_{epoch}'}; "
            f"a FIFO has one reader, so they would split the stream and hang.  Give each rank "
            f"its own channel ({name}_0 .. {name}_{local_size - 1}), use File mode, or run one "
            f"process per host")
    return sm.data_dir / f"{channel}_{epoch}"


def sagemaker_files(name: str = "train", root: Optional[PathLike] = None,
                    rank: Optional[int] = None, size: Optional[int] = None,
                    **options: Any) -> Shard[str]:
    """This rank's files of a File-mode SageMaker channel.

    With a per-rank channel ``name_<rank>``: all of its files.  With a shared channel: a
    :func:`shard_files` share of its directory, among every rank of the job when the data is
    ``FullyReplicated`` on each host, or among this host's ranks when SageMaker already split
    it between hosts (``S3DistributionType: ShardedByS3Key``).

    Args:
        options: ``shuffle_seed``, ``epoch``, ``drop_last``, ``pad`` as for :func:`shard`.

    Raises:
        SageMakerConfigError: not in SageMaker, no such channel, or the channel is in Pipe
            mode (read its FIFO from :func:`sagemaker_channel`).
    """
    rank, size, _ = _job(rank, size)
    sm = _sagemaker(root)
    channel, shared = _choose_channel(sm, name, rank)
    if sm.input_mode(channel) == "Pipe":
        raise SageMakerConfigError(f"channel {channel!r} is in Pipe mode: it has no files; "
                                   f"read its FIFO (hora.data.sagemaker_channel)")
    directory = sm.channel_dir(channel)
    if not shared:
        return shard_files(directory, rank=0, size=1)
    if (sm.channels.get(channel) or {}).get("S3DistributionType") == "ShardedByS3Key":
        if state.is_initialized():
            rank, size = state.local_rank(), state.local_size()
        else:
            rank, size = 0, 1
    return shard_files(directory, rank=rank, size=size, **options)


def read_tfrecords(path: PathLike) -> Iterator[bytes]:
    """The records of the TFRecord stream at ``path`` (a Pipe-mode FIFO, or any file), in order.

    ``tf.data.TFRecordDataset`` cannot read a FIFO (it seeks, and a pipe cannot: "Illegal
    seek"); this reads it front to back, so a Pipe-mode channel streams into ``tf.data``::

        ds = tf.data.Dataset.from_generator(
            lambda: hora.data.read_tfrecords(hora.data.sagemaker_channel("train", epoch=e)),
            output_signature=tf.TensorSpec((), tf.string))

    Each record is framed as its length (u64, little-endian), a CRC of the length, the record
    and its CRC; the lengths are checked (a stream cut short raises ``ValueError``), the CRCs
    are not.  Opening a FIFO blocks until its writer (SageMaker) opens it.
    """
    name = os.fsdecode(path)
    with open(name, "rb") as f:
        while True:
            head = f.read(12)
            if not head:
                return
            if len(head) < 12:
                raise ValueError(f"{name}: the stream ends inside a record's header")
            (length,) = struct.unpack("<Q", head[:8])
            body = f.read(length + 4)
            if len(body) < length + 4:
                raise ValueError(f"{name}: the stream ends inside a {length}-byte record")
            yield body[:length]
