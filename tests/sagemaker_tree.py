"""A fake SageMaker ``/opt/ml`` tree for tests: the config files SageMaker writes, and
Pipe-mode channels that are real FIFOs fed by a writer process.

    root = make_tree(tmp_path, ["algo-1"], "algo-1", channels={"train_0": "Pipe"},
                     pipe_epochs=2)
    writer = PipeWriter(root, {"train_0": [[b"rec", ...], [b"rec", ...]]})   # per epoch
    ...                          # readers open input/data/train_0_0, then train_0_1
    assert writer.wait(timeout_s=30) == {"train_0_0": 2, "train_0_1": 2}

As SageMaker does, a channel in Pipe mode is one FIFO per pass, ``<channel>_<epoch>``, each
written once, in epoch order, as TFRecords; every channel is fed independently of the
others (one reader blocking on its FIFO never holds up another's).  The TFRecord framing is
written here by hand (:func:`tfrecord`), so the writer needs no TensorFlow.

Run as a script (``python sagemaker_tree.py feed ROOT``), this file is the writer process.
"""
import json
import os
import struct
import subprocess
import sys
import threading

_SOURCES = ".pipe-sources"          # under the tree's root: what the writer will send


def make_tree(root, hosts, current_host, hyperparameters=None, channels=None, pipe_epochs=2):
    """Write ``root/input/config/*.json`` and return ``root``.

    Args:
        channels: ``{name: mode}`` ("File" or "Pipe"), or ``{name: {settings}}``.
        pipe_epochs: how many FIFOs (``<name>_0`` ...) each Pipe-mode channel has.
    """
    conf = root / "input" / "config"
    conf.mkdir(parents=True, exist_ok=True)
    (conf / "resourceconfig.json").write_text(json.dumps(
        {"current_host": current_host, "hosts": list(hosts), "network_interface_name": "eth0"}))
    # SageMaker passes every hyperparameter value as a string
    (conf / "hyperparameters.json").write_text(json.dumps(
        {k: v if isinstance(v, str) else json.dumps(v)
         for k, v in (hyperparameters or {}).items()}))
    config = {}
    for name, mode in (channels or {}).items():
        settings = mode if isinstance(mode, dict) else {"TrainingInputMode": mode}
        config[name] = {"ContentType": "application/x-recordio", "RecordWrapperType": "None",
                        "S3DistributionType": "FullyReplicated", **settings}
        if config[name]["TrainingInputMode"] == "Pipe":
            for epoch in range(pipe_epochs):
                path = root / "input" / "data" / f"{name}_{epoch}"
                path.parent.mkdir(parents=True, exist_ok=True)
                os.mkfifo(path)
        else:
            (root / "input" / "data" / name).mkdir(parents=True, exist_ok=True)
    (conf / "inputdataconfig.json").write_text(json.dumps(config))
    (root / "model").mkdir(exist_ok=True)
    return root


# -- TFRecord framing -------------------------------------------------------------------------
def _crc32c_table():
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1      # Castagnoli, reflected
        table.append(c)
    return table


_CRC32C = _crc32c_table()


def crc32c(data):
    c = 0xFFFFFFFF
    for b in data:
        c = _CRC32C[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def _masked_crc(data):
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def tfrecord(data):
    """One TFRecord: length (u64), its masked CRC-32C, the data, the data's masked CRC-32C."""
    length = struct.pack("<Q", len(data))
    return (length + struct.pack("<I", _masked_crc(length)) + data
            + struct.pack("<I", _masked_crc(data)))


# -- the writer process -----------------------------------------------------------------------
class PipeWriter:
    """A writer process feeding the tree's Pipe-mode FIFOs with TFRecords.

    Args:
        root: a tree from :func:`make_tree`, whose channels named here are in Pipe mode.
        records: ``{channel: [[bytes, ...] for each epoch]}``: the records of each FIFO
            ``<channel>_<epoch>``.

    The process is started at once; each FIFO's open blocks until its reader opens it.
    """

    def __init__(self, root, records):
        sources = root / _SOURCES
        sources.mkdir(exist_ok=True)
        plan = {}
        for channel, epochs in records.items():
            plan[channel] = []
            for epoch, recs in enumerate(epochs):
                fifo = root / "input" / "data" / f"{channel}_{epoch}"
                if not fifo.exists():
                    os.mkfifo(fifo)
                src = sources / f"{channel}_{epoch}"
                src.write_bytes(b"".join(map(tfrecord, recs)))
                plan[channel].append([str(fifo), str(src), len(recs)])
        (sources / "plan.json").write_text(json.dumps(plan))
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "feed",
                                      str(root)], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)

    def wait(self, timeout_s):
        """``{fifo name: records written}`` for every FIFO fed to its end; raises
        AssertionError naming what was not, and kills the writer, after ``timeout_s``."""
        try:
            out, _ = self.proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
            raise AssertionError(f"the pipe writer did not finish in {timeout_s} s; it "
                                 f"said:\n{out}") from None
        fed = {}
        for line in out.splitlines():
            if line.startswith("fed "):
                _, name, count = line.split()
                fed[name] = int(count)
        assert self.proc.returncode == 0, out
        return fed

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _feed_channel(fifos, lock):
    for fifo, src, count in fifos:
        with open(src, "rb") as f:
            data = f.read()
        name = os.path.basename(fifo)
        try:
            with open(fifo, "wb") as out:     # blocks until the reader opens it
                out.write(data)
        except BrokenPipeError:
            with lock:
                print(f"broken {name}: the reader closed it early", flush=True)
            return
        with lock:
            print(f"fed {name} {count}", flush=True)


def _feed(root):
    with open(os.path.join(root, _SOURCES, "plan.json")) as f:
        plan = json.load(f)
    lock = threading.Lock()
    threads = [threading.Thread(target=_feed_channel, args=(fifos, lock), daemon=True)
               for fifos in plan.values()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "feed":
        sys.exit(f"usage: {sys.argv[0]} feed ROOT")
    _feed(sys.argv[2])
