"""Training throughput on synthetic images: hora's DistributedOptimizer, or torch DDP.

    hora run -np 2 python examples/pytorch_synthetic_benchmark.py
    hora run -np 2 python examples/pytorch_synthetic_benchmark.py --use-ddp
    torchrun --standalone --nproc-per-node 2 examples/pytorch_synthetic_benchmark.py --use-ddp

Horovod's classic benchmark, on a model defined here (a CIFAR-style ResNet; no torchvision
needed): every rank trains on one fixed random batch, the first ``--num-warmup-batches``
steps are not timed (rank 0 says how far they are, with the time left), then
``--num-iters`` iterations of ``--num-batches-per-iter`` steps are.  Rank 0 prints the images per second of each iteration, then the mean per worker and
for the whole job, with a 95% interval (1.96 standard deviations over the iterations).

``--use-horovod`` runs it on Horovod itself (``import horovod.torch as hvd``, launched by
``horovodrun``): the script is the same either way, which is the point of hora's API.

``--use-ddp`` runs the same model and loop with ``torch.nn.parallel.DistributedDataParallel``
over gloo (nccl on CUDA) instead of hora, for comparison.  Under torchrun it uses torchrun's
rendezvous; under ``hora run`` it reads the ranks from hora's environment, agrees a port for
torch.distributed through hora (``MASTER_ADDR``/``MASTER_PORT`` override it), and shuts hora
down before timing anything, so hora's engine takes no CPU time from DDP.  BatchNorm
statistics are synced at the start and then stay local in both, as in Horovod (DDP runs with
``forward_sync_buffers=False``, or ``broadcast_buffers=False`` before torch 2.13).

``--sync-only`` is a reference for benchmarks, not data-parallel training: the ranks
exchange no gradients (each trains its own copy of the model), but every step waits for all
of them with a 4-byte allreduce of the loss after backward, as a data-parallel step must.
Its scaling efficiency is what synchronising alone costs on the machine: the faster rank
idling until the slower one is done, step after step.  No synchronous data-parallel trainer
can scale better.
"""
import argparse
import gc
import json
import os
import socket
import time
import timeit

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import hora.torch as hvd
from hora.bench.progress import warm_up

MODELS = {"resnet8": 1, "resnet14": 2, "resnet20": 3, "resnet32": 5}   # blocks per stage


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and a residual connection."""

    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                          nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet(nn.Module):
    """He et al.'s CIFAR ResNet: 16, 32 and 64 channels, ``blocks`` blocks per stage."""

    def __init__(self, blocks, num_classes):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16),
                                  nn.ReLU())
        layers, cin = [], 16
        for cout, stride in ((16, 1), (32, 2), (64, 2)):
            for i in range(blocks):
                layers.append(BasicBlock(cin, cout, stride if i == 0 else 1))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="resnet20")
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--num-classes", type=int, default=10)
    parser.add_argument("--num-warmup-batches", type=int, default=10,
                        help="steps before timing starts")
    parser.add_argument("--num-batches-per-iter", type=int, default=10,
                        help="steps per timed iteration")
    parser.add_argument("--num-iters", type=int, default=10, help="timed iterations")
    parser.add_argument("--fp16-allreduce", action="store_true",
                        help="send gradients as float16 (hora: Compression.fp16; "
                             "DDP: the fp16 compression comm hook)")
    parser.add_argument("--use-ddp", action="store_true",
                        help="torch DistributedDataParallel instead of hora")
    parser.add_argument("--use-horovod", action="store_true",
                        help="Horovod (horovod.torch, under horovodrun) instead of hora")
    parser.add_argument("--sync-only", action="store_true",
                        help="reference: no gradient exchange, only a 4-byte allreduce per "
                             "step (what waiting for the slowest rank costs)")
    parser.add_argument("--num-threads", type=int, default=1,
                        help="torch threads per rank on CPU")
    parser.add_argument("--no-cuda", action="store_true", help="train on the CPU")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--json", metavar="PATH", help="rank 0 writes the results here")
    args = parser.parse_args()
    if args.sync_only and args.use_ddp:
        parser.error("--sync-only runs on hora's API (or Horovod's), not with --use-ddp")
    return args


# -- the two ways to run data-parallel ------------------------------------------------------
def init_ddp(backend):
    """Join a torch.distributed job; returns (rank, size, local_rank)."""
    import torch.distributed as dist
    if "RANK" in os.environ and "MASTER_ADDR" in os.environ:       # torchrun
        dist.init_process_group(backend)
        return dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0))
    # hora run (or a plain single process): hora only tells the ranks where rank 0's
    # torch.distributed store listens (on a port the store itself picked: no race for it).
    import datetime
    hvd.init()
    rank, size, local_rank = hvd.rank(), hvd.size(), hvd.local_rank()
    timeout = datetime.timedelta(seconds=60)
    store, where = None, None
    if rank == 0:
        addr = os.environ.get("MASTER_ADDR") or (
            "127.0.0.1" if hvd.local_size() == size else socket.getfqdn())
        store = dist.TCPStore(addr, int(os.environ.get("MASTER_PORT") or 0), size,
                              is_master=True, timeout=timeout, wait_for_workers=False)
        where = (addr, store.port)
    addr, port = hvd.broadcast_object(where, root_rank=0, name="ddp_master")
    hvd.shutdown()
    if store is None:
        store = dist.TCPStore(addr, port, size, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size)
    return rank, size, local_rank


def setup_ddp(model, optimizer, device, args):
    import inspect
    from torch.nn.parallel import DistributedDataParallel as DDP
    # BatchNorm buffers: synced once at the start, then local (as with hora); the option's
    # name changed in torch 2.13.
    local_buffers = ({"forward_sync_buffers": False}
                     if "forward_sync_buffers" in inspect.signature(DDP).parameters
                     else {"broadcast_buffers": False})
    model = DDP(model, device_ids=[device] if device.type == "cuda" else None, **local_buffers)
    if args.fp16_allreduce:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    return model, optimizer


def setup_hora(model, optimizer, args):
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    return model, optimizer


# -- the benchmark ----------------------------------------------------------------------------
def main():
    global hvd
    args = parse_args()
    if args.use_horovod:
        import horovod.torch as hvd         # the same calls, on Horovod
    cuda = torch.cuda.is_available() and not args.no_cuda
    if args.use_ddp:
        rank, size, local_rank = init_ddp("nccl" if cuda else "gloo")
    else:
        hvd.init()
        rank, size, local_rank = hvd.rank(), hvd.size(), hvd.local_rank()
    if cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(args.num_threads)

    torch.manual_seed(args.seed)
    model = ResNet(MODELS[args.model], args.num_classes).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * size, momentum=0.9)
    if args.use_ddp:
        model, optimizer = setup_ddp(model, optimizer, device, args)
    elif not args.sync_only:
        model, optimizer = setup_hora(model, optimizer, args)

    data = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    target = torch.randint(0, args.num_classes, (args.batch_size,), device=device)

    batch_ends = []     # wall-clock end of every timed batch (for benchmarks that overlap runs)

    def benchmark_step():
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        if args.sync_only:
            hvd.allreduce(loss.detach(), name="sync_only")
        optimizer.step()
        if cuda:
            torch.cuda.synchronize()
        if recording:
            batch_ends.append(time.time())

    def log(message):
        if rank == 0:
            print(message, flush=True)

    unit = "GPU" if cuda else "CPU"
    system = "torch DDP" if args.use_ddp else "Horovod" if args.use_horovod else "hora"
    system += ", synchronisation only" if args.sync_only else ""
    params = sum(p.numel() for p in model.parameters())
    log(f"Model: {args.model} ({params / 1e6:.2f} M parameters), "
        f"{args.image_size}x{args.image_size} images")
    log(f"Batch size: {args.batch_size} per {unit}")
    log(f"Number of {unit}s: {size} ({system}"
        f"{'' if cuda else f', {args.num_threads} thread(s) each'})")
    recording = False
    warm_up([benchmark_step] * args.num_warmup_batches, log)
    log("Running benchmark...")
    recording = True
    timed_start = time.time()
    img_secs = []
    for i in range(args.num_iters):
        elapsed = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        img_secs.append(args.batch_size * args.num_batches_per_iter / elapsed)
        log(f"Iter #{i}: {img_secs[-1]:.1f} img/sec per {unit}")
    mean, conf = float(np.mean(img_secs)), float(1.96 * np.std(img_secs))
    log(f"Img/sec per {unit}: {mean:.1f} +-{conf:.1f}")
    log(f"Total img/sec on {size} {unit}(s): {size * mean:.1f} +-{size * conf:.1f}")

    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"system": "ddp" if args.use_ddp else
                       "horovod" if args.use_horovod else "hora", "size": size,
                       "model": args.model, "parameters": params, "device": unit,
                       "num_threads": None if cuda else args.num_threads,
                       "batch_size": args.batch_size, "image_size": args.image_size,
                       "fp16_allreduce": args.fp16_allreduce, "sync_only": args.sync_only,
                       "num_batches_per_iter": args.num_batches_per_iter,
                       "img_sec_per_iter": img_secs, "img_sec_per_worker": mean,
                       "img_sec_per_worker_conf": conf, "img_sec_total": size * mean,
                       "img_sec_total_conf": size * conf, "timed_start": timed_start,
                       "batch_ends": batch_ends}, f, indent=1)
    if args.use_ddp:
        # DDP holds the process group: drop it first, so that destroying the group joins
        # gloo's worker threads now. Left to interpreter exit, a worker thread may free its
        # last finished allreduce while Python is finalizing, and torch 2.13 aborts the
        # process ("terminate called without an active exception", about 1 run in 8).
        model = optimizer = benchmark_step = None
        gc.collect()
        torch.distributed.destroy_process_group()
    else:
        hvd.shutdown()


if __name__ == "__main__":
    main()
