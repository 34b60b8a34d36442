"""The worker side of :func:`hora.runner.run` (its workers call :func:`main`; ``python -m
hora.runner.task`` does too, as Spark's tasks start it).

Reads the ``HORA_*`` contract, fetches the pickled ``(fn, args, kwargs)`` from the job's
rendezvous store (``run/fn``), calls it, and stores ``run/result/<rank>`` (an elastic worker: ``run/result/w<its id>``) =
``cloudpickle.dumps(("ok", value))`` or ``(("error", traceback_text))``.  Exits 0 or 1.

SIGUSR1 makes this process print every thread's Python traceback to stderr (the launcher
sends it when a job times out, before killing it).

Layer: runner.  Imports hora.config and hora.rendezvous only; the function itself calls
``hora.init()`` when it needs collectives.
"""
import faulthandler
import signal
import sys
import traceback

import cloudpickle

from ..config import env_value
from ..rendezvous import RendezvousClient
from .run_func import FN_KEY, RESULT_PREFIX

__all__ = ["main"]


def _call(blob):
    """Run the pickled call; return (exit status, pickled outcome)."""
    try:
        fn, args, kwargs = cloudpickle.loads(blob)
        value = fn(*args, **kwargs)
        return 0, cloudpickle.dumps(("ok", value))
    except BaseException:  # noqa: BLE001 - report everything, SystemExit included
        text = traceback.format_exc()
        sys.stderr.write(text)
        return 1, cloudpickle.dumps(("error", text))


def main():
    """Entry point of one worker of :func:`hora.runner.run`; returns the exit status."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    rank = env_value("RANK")
    if rank is None and env_value("ELASTIC_ID") is not None:
        rank = f"w{env_value('ELASTIC_ID')}"      # an elastic worker: keyed by its name
    addr, port, secret = (env_value("RENDEZVOUS_ADDR"), env_value("RENDEZVOUS_PORT"),
                          env_value("SECRET"))
    if None in (rank, addr, port, secret):
        sys.stderr.write("hora.runner.task: run me through hora.run(); HORA_RANK, "
                         "HORA_RENDEZVOUS_ADDR/PORT and HORA_SECRET must be set\n")
        return 2
    timeout = env_value("START_TIMEOUT")
    client = RendezvousClient(addr, port, secret, timeout=timeout)
    try:
        status, outcome = _call(client.get(FN_KEY, timeout))
        client.put(f"{RESULT_PREFIX}{rank}", outcome)
    finally:
        client.close()
    sys.stdout.flush()
    sys.stderr.flush()
    return status


if __name__ == "__main__":
    sys.exit(main())
