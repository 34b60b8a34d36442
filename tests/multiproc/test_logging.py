"""hora's log in the user's process: printed once, whatever the script does with logging.

Each case is a real script run alone (``hora.init()`` makes a job of one), so the process's
logging is exactly what the script configured.  The warning is a real one: with
``HORA_AUTOTUNE=1`` and an autotune log file that cannot be created, rank 0 warns
"autotune disabled" from ``hora.core.engine`` during ``init()``.
"""
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(60)

WARNING = "autotune disabled: [Errno 2] No such file or directory"


def _python(code, tmp_path, **env):
    base = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
    base["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    base.update(HORA_AUTOTUNE="1", HORA_AUTOTUNE_LOG=str(tmp_path / "missing" / "tune.csv"))
    base.update(env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=45, env=base, stdin=subprocess.DEVNULL)


def _lines_with(text, needle):
    return [line for line in text.splitlines() if needle in line]


def test_with_basic_config_a_hora_warning_prints_once(tmp_path):
    out = _python("""
        import logging
        logging.basicConfig()
        import hora
        hora.init()
        hora.shutdown()
        """, tmp_path)
    assert out.returncode == 0, out.stderr
    said = _lines_with(out.stderr, "autotune disabled")
    assert len(said) == 1 and said[0].startswith(f"[hora rank 0] WARNING: {WARNING}"), out.stderr


def test_without_logging_config_a_hora_warning_prints_once_with_the_rank(tmp_path):
    out = _python("""
        import hora
        hora.init()
        hora.shutdown()
        """, tmp_path)
    assert out.returncode == 0, out.stderr
    said = _lines_with(out.stderr, "autotune disabled")
    assert len(said) == 1 and said[0].startswith(f"[hora rank 0] WARNING: {WARNING}"), out.stderr


def test_hora_owns_its_output_and_the_application_can_take_it(tmp_path):
    # the library convention: hora's handler sits on the "hora" logger, which does not
    # propagate, so the root's handlers never print hora's records a second time; an
    # application that wants them adds its handler to the "hora" logger
    out = _python("""
        import logging
        import hora
        logging.basicConfig(format="app: %(name)s %(message)s")
        hora.init()
        log = logging.getLogger("hora.core.engine")
        log.warning("first")
        hora_log = logging.getLogger("hora")
        assert not hora_log.propagate and len(hora_log.handlers) == 1
        hora_log.removeHandler(hora_log.handlers[0])
        hora_log.propagate = True
        log.warning("second")
        hora.shutdown()
        """, tmp_path, HORA_AUTOTUNE="0")
    assert out.returncode == 0, out.stderr
    assert out.stderr.splitlines() == ["[hora rank 0] WARNING: first",
                                       "app: hora.core.engine second"], out.stderr


def test_log_level_trace_shows_debug_records(tmp_path):
    out = _python("""
        import logging
        import hora
        hora.init()
        logging.getLogger("hora.core.engine").debug("details")
        hora.shutdown()
        """, tmp_path, HORA_AUTOTUNE="0", HORA_LOG_LEVEL="trace")
    assert out.returncode == 0, out.stderr
    assert _lines_with(out.stderr, "details") == ["[hora rank 0] DEBUG: details"], out.stderr


def test_unknown_log_level_fails_init_naming_it(tmp_path):
    out = _python("""
        import hora
        try:
            hora.init()
        except ValueError as e:
            print(e)
        """, tmp_path, HORA_AUTOTUNE="0", HOROVOD_LOG_LEVEL="verbose")
    assert out.returncode == 0, out.stderr
    assert out.stdout == ("HOROVOD_LOG_LEVEL='verbose': expected one of TRACE, DEBUG, INFO, "
                          "WARNING, WARN, ERROR, FATAL, CRITICAL\n")


def test_hora_run_verbose_prints_progress_once_without_logging_config(tmp_path):
    out = _python("""
        import hora
        print(hora.run(int, num_proc=2, verbose=True))
        """, tmp_path, HORA_AUTOTUNE="0")
    assert out.returncode == 0, out.stderr
    assert out.stdout == "[0, 0]\n"
    for rank in range(2):
        assert len(_lines_with(out.stderr, f"[hora] DEBUG: started rank {rank} ")) == 1, \
            out.stderr


def test_horovod_timeline_names_are_honoured_without_a_log_line(tmp_path):
    # Horovod's HOROVOD_TIMELINE and hvd.start_timeline(): each writes its file (rank 0),
    # the second stopping the first, and neither says anything in the log
    out = _python("""
        import numpy as np
        import hora
        import hora.torch as hvd
        hvd.init()
        hora.allreduce(np.ones(2, np.float32), name="first")
        hvd.start_timeline(T2)
        hora.allreduce(np.ones(2, np.float32), name="second")
        hvd.shutdown()
        """.replace("T2", repr(str(tmp_path / "t2.json"))), tmp_path, HORA_AUTOTUNE="0",
        HOROVOD_TIMELINE=str(tmp_path / "t.json"))
    assert out.returncode == 0, out.stderr
    assert _lines_with(out.stderr, "timeline") == [], out.stderr
    import json
    first = json.loads((tmp_path / "t.json").read_text())
    second = json.loads((tmp_path / "t2.json").read_text())
    rows = lambda events: {e["args"]["name"] for e in events  # noqa: E731
                           if e.get("name") == "thread_name"}
    assert rows(first) == {"first"} and rows(second) == {"second"}
