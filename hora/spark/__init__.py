"""Horovod's import path for running a hora job on Spark: ``hora.spark.run``.

A thin re-export of :mod:`hora.integrations.spark` (``import horovod.spark`` becomes
``import hora.spark``).  pyspark itself is imported only when :func:`run` is called.
"""
from ..integrations.spark import run

__all__ = ["run"]
