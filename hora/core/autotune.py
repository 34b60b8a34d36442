"""Online tuning of the fusion threshold and the cycle time (HORA_AUTOTUNE=1).

Rank 0 measures the job's allreduce throughput (bytes reduced per second of wall time, which
in training is bytes per step over the step time) for one setting at a time, and moves to the
next setting when a *sample* ends: ``steps_per_sample`` batches of allreduce responses.  The
search is a coordinate descent over two short lists, the fusion threshold first (with the
cycle time as set), then the cycle time (with the best threshold); each candidate is scored
by the median of ``samples_per_trial`` samples, after ``warmup_samples`` samples that are not
scored (start-up, first-time allocations; at least one).  Then the best setting stays.
With the defaults that is (3 + 2 x 11) x 10 = 250 batches: a few hundred training steps.

The tuner never raises into the job: the engine stops tuning (and logs why) on any error.
Layer: core.
"""
import statistics

__all__ = ["Autotuner", "FUSION_CANDIDATES", "CYCLE_CANDIDATES_MS"]

_MiB = 1 << 20
FUSION_CANDIDATES = (_MiB, 4 * _MiB, 16 * _MiB, 32 * _MiB, 64 * _MiB, 128 * _MiB)
CYCLE_CANDIDATES_MS = (0.0, 0.5, 1.0, 2.5, 5.0)


class Autotuner:
    """Chooses ``(fusion_threshold, cycle_time_ms)``; feed it with :meth:`record`.

    Args:
        fusion, cycle_ms: the settings the job starts with.
        log: optional file-like object; one CSV line per scored trial, and a final line.
        clock: seconds (monotonic); the engine passes its own.
    """

    def __init__(self, fusion, cycle_ms, log=None, warmup_samples=3, steps_per_sample=10,
                 samples_per_trial=2):
        self.fusion, self.cycle_ms = fusion, cycle_ms
        self.done = False
        self._log = log
        self._warmup = warmup_samples
        self._steps = max(1, steps_per_sample)
        self._per_trial = max(1, samples_per_trial)
        # the trials: every fusion candidate, then every cycle candidate with the best fusion
        self._plan = [("fusion", f) for f in FUSION_CANDIDATES]
        self._phase_cycle = [("cycle", c) for c in CYCLE_CANDIDATES_MS]
        self._trial = None
        self._scores = {}
        self._samples = []
        self._count = 0
        self._bytes = 0
        self._start = None
        self._n_trials = 0
        if self._log is not None:
            self._log.write("trial,fusion_threshold_bytes,cycle_time_ms,throughput_bytes_per_s,"
                            "samples\n")

    def record(self, nbytes, now):
        """One batch of allreduce responses that reduced ``nbytes`` finished at ``now``.
        Returns ``(fusion, cycle_ms)`` when the settings change, else None."""
        if self.done:
            return None
        if self._start is None:
            self._start = now
            return None
        self._count += 1
        self._bytes += nbytes
        if self._count < self._steps:
            return None
        elapsed = now - self._start
        rate = self._bytes / elapsed if elapsed > 0 else 0.0
        self._count, self._bytes, self._start = 0, 0, now
        if self._trial is None:                 # warming up (at least one sample)
            self._warmup -= 1
            return self._begin_next() if self._warmup <= 0 else None
        self._samples.append(rate)
        if len(self._samples) < self._per_trial:
            return None
        score = statistics.median(self._samples)
        self._samples = []
        self._scores[self._trial] = score
        self._n_trials += 1
        if self._log is not None:
            self._log.write(f"{self._n_trials},{self.fusion},{self.cycle_ms:g},{score:.6g},"
                            f"{self._per_trial}\n")
            self._log.flush()
        return self._begin_next()

    def _begin_next(self):
        if not self._plan and self._phase_cycle:
            best = max((t for t in self._scores if t[0] == "fusion"),
                       key=self._scores.get, default=None)
            if best is not None:
                self.fusion = best[1]
            self._plan, self._phase_cycle = self._phase_cycle, []
        if not self._plan:
            best = max((t for t in self._scores if t[0] == "cycle"), key=self._scores.get,
                       default=None)
            if best is not None:
                self.cycle_ms = best[1]
            self.done = True
            if self._log is not None:
                self._log.write(f"final,{self.fusion},{self.cycle_ms:g},,\n")
                self._log.flush()
            return self.fusion, self.cycle_ms
        self._trial = self._plan.pop(0)
        if self._trial[0] == "fusion":
            self.fusion = self._trial[1]
        else:
            self.cycle_ms = self._trial[1]
        self._start = None          # the new setting's first batch starts the clock
        return self.fusion, self.cycle_ms
