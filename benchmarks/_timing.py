"""The per-call timing loop of the call-cost benchmarks (``tf_graph_cost.py``,
``jax_call_cost.py``), run on every rank of a hora job.  Imported by the scripts beside it."""
import time


def time_rounds(hora, call, per, key, warmup, rounds, round_s):
    """``(calls, seconds per operation of each round)`` for ``call`` (which does ``per``
    operations): after ``warmup`` untimed and ``warmup`` timed calls, rank 0 picks how many
    calls take about ``round_s`` and every rank runs ``rounds`` rounds of that many, each
    after a barrier.  ``key`` names the broadcast of the count (the same on every rank)."""
    for _ in range(warmup):
        call()
    hora.barrier()
    t0 = time.perf_counter()
    for _ in range(warmup):
        call()
    warm = (time.perf_counter() - t0) / warmup
    calls = hora.broadcast_object(max(10, int(round_s / max(warm, 1e-7))), root_rank=0,
                                  name=f"calls.{key}")
    out = []
    for _ in range(rounds):
        hora.barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        out.append((time.perf_counter() - t0) / (calls * per))
    return calls, out
