"""Training throughput on synthetic images in TensorFlow 2: hora's DistributedGradientTape, or
TensorFlow's MultiWorkerMirroredStrategy.

    hora run -np 2 python examples/tensorflow2_synthetic_benchmark.py
    hora run -np 2 python examples/tensorflow2_synthetic_benchmark.py --use-mwms
    hora run -np 2 python examples/tensorflow2_synthetic_benchmark.py --model ResNet50

Horovod's classic TensorFlow 2 benchmark: every rank trains on one fixed random batch, in a
``tf.function`` step (``jit_compile=False``: hora's collectives run in Python, which XLA
cannot compile) whose tape is wrapped in ``hvd.DistributedGradientTape``; after the first
step rank 0's model and optimizer variables are broadcast.  The first
``--num-warmup-batches`` steps are not timed (rank 0 says how far they are, with the time
left: the first step traces the model, which takes minutes for ResNet50 on a CPU), then
``--num-iters`` iterations of ``--num-batches-per-iter`` steps are.  Rank 0 prints the
images per second of each iteration, then the mean per worker and for the whole job, with
a 95% interval (1.96 standard deviations over the iterations).

``--model`` is either a CIFAR ResNet defined here (``resnet8`` ... ``resnet32``, 32x32
images by default: the default, ``resnet20``, is the model of
``examples/pytorch_synthetic_benchmark.py``, and a step takes tens of milliseconds on one
CPU core) or any ``keras.applications`` model by name (``ResNet50``, ``MobileNetV2``, ...;
224x224 images by default, Horovod's benchmark: seconds per step on a CPU).

``--use-horovod`` runs it on Horovod itself (``import horovod.tensorflow as hvd``, launched
by ``horovodrun``): the script is the same either way.

``--use-mwms`` runs the same model and loop with ``tf.distribute.MultiWorkerMirroredStrategy``
instead of hora: TensorFlow's own collective ring allreduce between the workers, over gRPC.
The gradients are summed by the Keras optimizer's ``apply_gradients`` (the strategy's
all-reduce) of a loss scaled by 1/workers, which averages them as hora does.  Under
``hora run`` every rank picks a free port, the ranks exchange them through hora to build
``TF_CONFIG``, and hora shuts down before TensorFlow starts, so its engine takes no CPU time
from the strategy; a ``TF_CONFIG`` already in the environment is used as it is (workers
started by hand).  BatchNorm statistics stay local in both.

``--sync-only`` is a reference for benchmarks, not data-parallel training: the ranks
exchange no gradients, but every step waits for all of them with a 4-byte allreduce of the
loss after the gradients are computed, as a data-parallel step must.  Its scaling efficiency
is what synchronising alone costs on the machine.

``--num-threads`` (TensorFlow's intra-op pool) and ``--num-inter-threads`` (its inter-op
pool) apply to every system alike.  Both default to 1, one core per rank as
``torch.set_num_threads(1)`` gives the PyTorch benchmark: with 2 inter-op threads one process
runs independent ops of its step side by side, and alone on a 2-CPU machine it borrows the
second core (a ResNet-20 step took 84 ms instead of 106 ms), which 2 ranks cannot.
"""
import argparse
import contextlib
import json
import os
import socket
import time
import timeit

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np                                             # noqa: E402
import tensorflow as tf                                        # noqa: E402

import hora.tensorflow as hvd                                  # noqa: E402
from hora.bench.progress import warm_up                        # noqa: E402

CIFAR_MODELS = {"resnet8": 1, "resnet14": 2, "resnet20": 3, "resnet32": 5}  # blocks per stage


# -- the model ------------------------------------------------------------------------------
def _block(x, cout, stride):
    """Two 3x3 convolutions with BatchNorm and a residual connection."""
    layers = tf.keras.layers
    out = layers.Conv2D(cout, 3, stride, padding="same", use_bias=False)(x)
    out = layers.ReLU()(layers.BatchNormalization(epsilon=1e-5, momentum=0.9)(out))
    out = layers.Conv2D(cout, 3, 1, padding="same", use_bias=False)(out)
    out = layers.BatchNormalization(epsilon=1e-5, momentum=0.9)(out)
    if stride != 1 or x.shape[-1] != cout:
        x = layers.Conv2D(cout, 1, stride, use_bias=False)(x)
        x = layers.BatchNormalization(epsilon=1e-5, momentum=0.9)(x)
    return layers.ReLU()(out + x)


def cifar_resnet(blocks, image_size, num_classes):
    """He et al.'s CIFAR ResNet: 16, 32 and 64 channels, ``blocks`` blocks per stage; logits."""
    layers = tf.keras.layers
    inputs = tf.keras.Input((image_size, image_size, 3))
    x = layers.Conv2D(16, 3, 1, padding="same", use_bias=False)(inputs)
    x = layers.ReLU()(layers.BatchNormalization(epsilon=1e-5, momentum=0.9)(x))
    for cout, stride in ((16, 1), (32, 2), (64, 2)):
        for i in range(blocks):
            x = _block(x, cout, stride if i == 0 else 1)
    x = layers.GlobalAveragePooling2D()(x)
    return tf.keras.Model(inputs, layers.Dense(num_classes)(x))


def make_model(args):
    if args.model in CIFAR_MODELS:
        return cifar_resnet(CIFAR_MODELS[args.model], args.image_size, args.num_classes)
    # a keras.applications model, untrained, returning logits
    return getattr(tf.keras.applications, args.model)(
        weights=None, input_shape=(args.image_size, args.image_size, 3),
        classes=args.num_classes, classifier_activation=None)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default="resnet20",
                        help=f"{', '.join(CIFAR_MODELS)}, or a keras.applications model "
                             f"(ResNet50, MobileNetV2, ...)")
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--image-size", type=int,
                        help="default: 32 for the CIFAR ResNets, 224 for keras.applications")
    parser.add_argument("--num-classes", type=int,
                        help="default: 10 for the CIFAR ResNets, 1000 for keras.applications")
    parser.add_argument("--num-warmup-batches", type=int, default=10,
                        help="steps before timing starts")
    parser.add_argument("--num-batches-per-iter", type=int, default=10,
                        help="steps per timed iteration")
    parser.add_argument("--num-iters", type=int, default=10, help="timed iterations")
    parser.add_argument("--fp16-allreduce", action="store_true",
                        help="send gradients as float16 (Compression.fp16)")
    parser.add_argument("--use-mwms", action="store_true",
                        help="tf.distribute.MultiWorkerMirroredStrategy instead of hora")
    parser.add_argument("--use-horovod", action="store_true",
                        help="Horovod (horovod.tensorflow, under horovodrun) instead of hora")
    parser.add_argument("--sync-only", action="store_true",
                        help="reference: no gradient exchange, only a 4-byte allreduce per "
                             "step (what waiting for the slowest rank costs)")
    parser.add_argument("--num-threads", type=int, default=1,
                        help="TensorFlow intra-op threads per rank on CPU")
    parser.add_argument("--num-inter-threads", type=int, default=1,
                        help="TensorFlow inter-op threads per rank on CPU")
    parser.add_argument("--no-cuda", action="store_true", help="train on the CPU")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--json", metavar="PATH", help="rank 0 writes the results here")
    args = parser.parse_args()
    cifar = args.model in CIFAR_MODELS
    if not cifar and not hasattr(tf.keras.applications, args.model):
        parser.error(f"--model {args.model}: neither {', '.join(CIFAR_MODELS)} nor a "
                     f"keras.applications model")
    if args.image_size is None:
        args.image_size = 32 if cifar else 224
    if args.num_classes is None:
        args.num_classes = 10 if cifar else 1000
    if args.use_mwms and (args.sync_only or args.fp16_allreduce or args.use_horovod):
        parser.error("--use-mwms runs TensorFlow's strategy: no --sync-only, "
                     "--fp16-allreduce or --use-horovod with it")
    return args


# -- the two ways to run data-parallel ------------------------------------------------------
def init_mwms():
    """Join a MultiWorkerMirroredStrategy job; returns (strategy, rank, size).  Must run before
    TensorFlow executes anything: the strategy configures the runtime's collectives."""
    if "TF_CONFIG" not in os.environ:
        # hora run (or a plain single process): each rank reserves a port for its worker's
        # gRPC server, and hora only carries the addresses from rank to rank
        hvd.init()
        rank, local = hvd.rank(), hvd.local_size() == hvd.size()
        host = "localhost" if local else socket.getfqdn()
        with socket.socket() as s:
            s.bind(("" if not local else "127.0.0.1", 0))
            port = s.getsockname()[1]
        workers = hvd.allgather_object(f"{host}:{port}", name="mwms_workers")
        hvd.shutdown()
        os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": workers},
                                              "task": {"type": "worker", "index": rank}})
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    return strategy, rank, strategy.num_replicas_in_sync


def hora_step(model, optimizer, data, target, args):
    """The step of Horovod's benchmark: DistributedGradientTape, then rank 0's variables
    broadcast after the first step (when the optimizer's exist)."""
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

    @tf.function(jit_compile=False)
    def step(first_batch):
        with tf.GradientTape() as tape:
            logits = model(data, training=True)
            loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
                target, logits, from_logits=True))
        if not args.sync_only:
            tape = hvd.DistributedGradientTape(tape, compression=compression)
        grads = tape.gradient(loss, model.trainable_variables)
        if args.sync_only:
            # every rank waits for the others once its gradients exist, and updates after
            with tf.control_dependencies(grads):
                synced = hvd.allreduce(loss, name="sync_only")
            with tf.control_dependencies([synced]):
                grads = [tf.identity(g) for g in grads]
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        if first_batch and not args.sync_only:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(optimizer.variables, root_rank=0)
    return step


def mwms_step(strategy, model, optimizer, data, target, size):
    """The same step as one replica of the strategy: the optimizer sums the gradients of the
    loss divided by the number of workers, i.e. averages them."""
    def replica_step():
        with tf.GradientTape() as tape:
            logits = model(data, training=True)
            loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
                target, logits, from_logits=True)) / size
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    @tf.function(jit_compile=False)
    def step(first_batch):
        del first_batch             # the strategy made every worker's variables rank 0's
        strategy.run(replica_step)
    return step


# -- the benchmark ----------------------------------------------------------------------------
def main():
    global hvd
    args = parse_args()
    if args.use_horovod:
        import horovod.tensorflow as hvd     # the same calls, on Horovod
    # thread pools first: they are fixed once TensorFlow's runtime starts
    tf.config.threading.set_intra_op_parallelism_threads(args.num_threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.num_inter_threads)
    gpus = [] if args.no_cuda else tf.config.list_physical_devices("GPU")
    if args.no_cuda:
        tf.config.set_visible_devices([], "GPU")
    strategy = None
    if args.use_mwms:
        strategy, rank, size = init_mwms()
        local_rank = rank
    else:
        hvd.init()
        rank, size, local_rank = hvd.rank(), hvd.size(), hvd.local_rank()
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus and not args.use_mwms:                  # one GPU per local rank
        tf.config.set_visible_devices(gpus[local_rank % len(gpus)], "GPU")
    unit = "GPU" if gpus else "CPU"

    tf.keras.utils.set_random_seed(args.seed)
    with strategy.scope() if strategy else contextlib.nullcontext():
        model = make_model(args)
        optimizer = tf.keras.optimizers.SGD(learning_rate=0.01 * size, momentum=0.9)
        optimizer.build(model.trainable_variables)
    data = tf.random.uniform([args.batch_size, args.image_size, args.image_size, 3])
    target = tf.random.uniform([args.batch_size], minval=0, maxval=args.num_classes,
                               dtype=tf.int64)
    if strategy:
        step = mwms_step(strategy, model, optimizer, data, target, size)
    else:
        step = hora_step(model, optimizer, data, target, args)

    batch_ends = []     # wall-clock end of every timed batch (for benchmarks that overlap runs)
    recording = False

    def benchmark_step():
        step(first_batch=False)
        if recording:
            batch_ends.append(time.time())

    def log(message):
        if rank == 0:
            print(message, flush=True)

    system = ("TensorFlow MultiWorkerMirroredStrategy" if args.use_mwms
              else "Horovod" if args.use_horovod else "hora")
    system += ", synchronisation only" if args.sync_only else ""
    params = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    log(f"Model: {args.model} ({params / 1e6:.2f} M parameters), "
        f"{args.image_size}x{args.image_size} images")
    log(f"Batch size: {args.batch_size} per {unit}")
    log(f"Number of {unit}s: {size} ({system}"
        f"{'' if gpus else f', {args.num_threads} thread(s) each'})")
    warm_up([lambda: step(first_batch=True)] + [benchmark_step] * args.num_warmup_batches, log,
            first="it traces and builds the step")
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
            json.dump({"system": "mwms" if args.use_mwms else
                       "horovod" if args.use_horovod else "hora", "size": size,
                       "model": args.model, "parameters": params, "device": unit,
                       "num_threads": None if gpus else args.num_threads,
                       "num_inter_threads": None if gpus else args.num_inter_threads,
                       "batch_size": args.batch_size, "image_size": args.image_size,
                       "fp16_allreduce": args.fp16_allreduce, "sync_only": args.sync_only,
                       "num_batches_per_iter": args.num_batches_per_iter,
                       "img_sec_per_iter": img_secs, "img_sec_per_worker": mean,
                       "img_sec_per_worker_conf": conf, "img_sec_total": size * mean,
                       "img_sec_total_conf": size * conf, "timed_start": timed_start,
                       "batch_ends": batch_ends}, f, indent=1)
    if not args.use_mwms:
        hvd.shutdown()


if __name__ == "__main__":
    main()
