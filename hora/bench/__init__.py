"""``hora bench``: allreduce latency and bandwidth, hora side by side with its peers.

Not part of the launcher: a program that uses it.  :mod:`hora.bench.cli` is the command line
(light to import: ``hora`` builds its parser on every start); :mod:`hora.bench.jobs` runs one
job per (system, N), :mod:`hora.bench.ranks` is what each rank runs,
:mod:`hora.bench.limits` measures the machine, :mod:`hora.bench.report` prints and plots.

Layer: bench, beside the runner (DESIGN.md): imports hora.runner's Python API and
hora.config; never hora.core (its ranks import what they measure).
"""
from .cli import add_command, main

__all__ = ["add_command", "main"]
