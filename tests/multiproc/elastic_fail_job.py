"""The worker of test_ray_elastic.py's tests of how a run fails: an elastic loop on hora alone.

Those tests check what the executor raises and the rounds it wrote, not the training, so
their actors go without torch (tests/elastic_main.py's training imports it, seconds of CPU in
every actor); this module imports nothing but hora and numpy, in the actor.
"""
import os
import signal

COMMIT_EVERY = 2
BATCHES = 8


def dies_at_batch_3():
    """Batches of one allreduce, a commit every COMMIT_EVERY; rank 1 of the first round
    SIGKILLs itself before batch 3 (as ELASTIC_KILL "1:0:3" has elastic_main's training
    do), and the others re-form without it (or wait for a round); returns the batches done."""
    import numpy as np

    import hora
    import hora.elastic
    from hora.core import membership
    hora.init()

    @hora.elastic.run
    def train(state):
        while state.batch < BATCHES:
            if state.batch == 3 and hora.rank() == 1 and membership.current_round() == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            hora.allreduce(np.ones(4), name="batch")
            state.batch += 1
            if state.batch % COMMIT_EVERY == 0:
                state.commit()
        return state.batch

    done = train(hora.elastic.ObjectState(hora.broadcast_object, hora.rank, batch=0))
    hora.shutdown()
    return done
