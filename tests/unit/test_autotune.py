"""The autotuner's search, on a synthetic job whose throughput depends on the settings."""
import io

from hora.core.autotune import CYCLE_CANDIDATES_MS, FUSION_CANDIDATES, Autotuner

MiB = 1 << 20


def _throughput(fusion, cycle_ms):
    """A made-up job: best at 32 MiB and 1 ms, worse the further from either."""
    return 1e9 / (1 + abs(fusion - 32 * MiB) / (8 * MiB) + abs(cycle_ms - 1.0))


def _drive(tuner, batches, nbytes=4 * MiB):
    """Feed ``batches`` batches, each taking the time the current settings imply."""
    now, changes = 0.0, []
    for _ in range(batches):
        now += nbytes / _throughput(tuner.fusion, tuner.cycle_ms)
        change = tuner.record(nbytes, now)
        if change is not None:
            changes.append(change)
    return changes


def test_finds_the_best_setting_within_a_few_hundred_batches_and_logs_every_trial():
    log = io.StringIO()
    tuner = Autotuner(128 * MiB, 0.0, log, warmup_samples=3, steps_per_sample=10,
                      samples_per_trial=2)
    changes = _drive(tuner, 400)
    assert tuner.done
    assert (tuner.fusion, tuner.cycle_ms) == (32 * MiB, 1.0)
    assert changes[-1] == (32 * MiB, 1.0)
    lines = log.getvalue().splitlines()
    assert lines[0].startswith("trial,")
    trials = [line.split(",") for line in lines[1:] if not line.startswith("final")]
    assert len(trials) == len(FUSION_CANDIDATES) + len(CYCLE_CANDIDATES_MS)
    tried = {(int(t[1]), float(t[2])) for t in trials}
    assert {f for f, _ in tried} >= set(FUSION_CANDIDATES)
    assert {c for f, c in tried if f == 32 * MiB} >= set(CYCLE_CANDIDATES_MS)
    for t in trials:                          # the logged score is what the job delivered
        assert abs(float(t[3]) / _throughput(int(t[1]), float(t[2])) - 1) < 1e-5
    assert lines[-1] == f"final,{32 * MiB},1,,"


def test_does_nothing_after_it_is_done_and_never_needs_a_log():
    tuner = Autotuner(64 * MiB, 5.0, None, warmup_samples=0, steps_per_sample=1,
                      samples_per_trial=1)
    _drive(tuner, 100)
    assert tuner.done
    before = (tuner.fusion, tuner.cycle_ms)
    assert _drive(tuner, 50) == [] and (tuner.fusion, tuner.cycle_ms) == before
