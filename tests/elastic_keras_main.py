"""An elastic Keras training script (Horovod's elastic Keras example, in small) for
tests/multiproc/test_elastic_run.py.

``model.fit`` under ``hvd.elastic.run`` with ``KerasState`` and the elastic callbacks; each
rank trains on its own shard of a fixed synthetic set.  ELASTIC_KILL="R:E:B": the worker
that is rank R in the job's first round kills itself (SIGKILL) before batch B of epoch E.
Rank 0 writes a report (JSON) to ELASTIC_OUT: the epochs done, the final size, every rank's
weights, and each process's (round, rank, pid) per call of the training function.
"""
import json
import os
import signal

import numpy as np

EPOCHS = 3
STEPS = 6


def main():
    import keras
    import hora.keras as hvd
    from hora.core import allgather_object, membership

    hvd.init()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((240, 8)).astype(np.float32)
    y = (x @ rng.standard_normal((8, 1))).astype(np.float32)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss="mse")
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    who, kill_epoch, kill_batch = os.environ.get("ELASTIC_KILL", "-1:-1:-1").split(":")
    rounds = []

    class Killer(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if (membership.current_round() == 0 and str(hvd.rank()) == who
                    and (state.epoch, batch) == (int(kill_epoch), int(kill_batch))):
                os.kill(os.getpid(), signal.SIGKILL)

    callbacks = [hvd.callbacks.MetricAverageCallback(),
                 hvd.elastic.UpdateEpochStateCallback(state),
                 hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.CommitStateCallback(state, batches_per_commit=2), Killer()]

    @hvd.elastic.run
    def train(state):
        rounds.append((membership.current_round(), hvd.rank(), os.getpid()))
        shard = slice(hvd.rank(), None, hvd.size())
        state.model.fit(x[shard], y[shard], batch_size=240 // hvd.size() // STEPS,
                        epochs=EPOCHS - state.epoch, callbacks=callbacks,
                        verbose=0, shuffle=False)

    train(state)
    weights = allgather_object([w.tolist() for w in model.get_weights()])
    pids = allgather_object(rounds)
    if hvd.rank() == 0 and os.environ.get("ELASTIC_OUT"):
        with open(os.environ["ELASTIC_OUT"], "w") as f:
            json.dump({"epoch": state.epoch, "final_size": hvd.size(), "weights": weights,
                       "pids": pids}, f)
    hvd.shutdown()


if __name__ == "__main__":
    main()
