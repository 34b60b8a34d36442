#!/usr/bin/env python
"""Allreduce latency and bus bandwidth: hora side by side with its peers (= ``hora bench``).

    python benchmarks/allreduce.py                      # full run: 4 B .. 256 MiB, N = 2 and 4
    python benchmarks/allreduce.py --quick              # smoke run (seconds)
    python benchmarks/allreduce.py --np 2 --max-size 16M --json /tmp/ar.json

The benchmark lives in the package (:mod:`hora.bench`); see benchmarks/README.md.
"""
import sys

from hora.bench import main

if __name__ == "__main__":
    sys.exit(main(prog="allreduce.py"))
