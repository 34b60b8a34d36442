"""What hora.torch's asynchronous collectives return: :class:`Handle` (a core handle and the
conversion of its result back to tensors) and :class:`SparseHandle` (the two allgathers of a
sparse allreduce, summed when waited for).  Layer: torch.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["Handle", "SparseHandle"]


class Handle:
    """What the ``*_async`` functions return: pass it to :func:`poll` or :func:`synchronize`.

    It holds the core engine's handle and the conversion of the result back to tensors.
    """

    __slots__ = ("_core", "_convert", "_done", "_result")

    def __init__(self, core_handle: Any, convert: Callable[[Any], Any]) -> None:
        self._core = core_handle
        self._convert: Callable[[Any], Any] | None = convert
        self._done = False
        self._result: Any = None

    def poll(self) -> bool:
        """True once the collective has finished (``wait`` will not block)."""
        return self._done or self._core.poll()

    def wait(self, timeout: float | None = None) -> Any:
        """Wait for the collective and return its result (raises its error)."""
        if not self._done:
            convert: Callable[[Any], Any] = self._convert  # type: ignore[assignment]
            self._result = convert(self._core.wait(timeout))
            self._done = True
            self._core = self._convert = None
        return self._result


class SparseHandle:
    """What :func:`sparse_allreduce_async` returns.  Call it, as Horovod's users do
    (``handle()``), or pass it to :func:`synchronize`: either waits for both allgathers and
    returns the reduced sparse tensor."""

    __slots__ = ("_indices", "_values", "_shape", "_divisor", "_result")

    def __init__(self, indices: Handle, values: Handle, shape: torch.Size,
                 divisor: int) -> None:
        self._indices = indices
        self._values = values
        self._shape = shape
        self._divisor = divisor
        self._result: torch.Tensor | None = None

    def poll(self) -> bool:
        """True once both allgathers have finished."""
        return self._result is not None or (self._values.poll() and self._indices.poll())

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        """Wait for every rank's indices and values; returns the sum (or average) as a
        coalesced sparse tensor shaped like the input."""
        if self._result is None:
            values = self._values.wait(timeout)
            indices = self._indices.wait(timeout)
            # every rank's (index, value) pairs side by side: coalescing adds up the rows
            # that several ranks touched, which is what a dense allreduce would do
            out = torch.sparse_coo_tensor(indices.t(), values, self._shape,
                                          check_invariants=False).coalesce()
            if self._divisor != 1:
                # divide once the rows are summed, as a dense Average rounds (coalesce made
                # the values a new tensor: dividing them in place touches nothing else)
                out._values().div_(self._divisor)
            self._result = out
        return self._result

    def __call__(self) -> torch.Tensor:
        return self.wait()
