"""A pickle decoder that cannot run code: the only one hora uses on its control plane.

``pickle.loads`` runs whatever a frame names (``os.system`` with arguments is three opcodes).
Every frame a process reads from the network on hora's control plane (rendezvous requests
and replies, the engine's control messages) is decoded here instead: plain data needs no
class lookup at all (``None``, bools, numbers, str, bytes, bytearray, tuples, lists, dicts,
sets), and a lookup of anything else is refused unless it is on an explicit list of
classes whose construction runs no code of the sender's choosing: ``complex``, numpy's
dtypes, scalars and arrays (through guarded reconstructors), and what the caller adds
(the engine: its ``Request`` and the typed extras of :mod:`hora.core.wire`).  A refused frame raises
:class:`PayloadRefusedError`; the caller logs it and drops the connection.

Layer: rendezvous.  Imports only hora.errors (numpy lazily, when a frame names it).
"""
import copyreg
import importlib
import io
import pickle
import pickletools

from ..errors import AuthenticationError

__all__ = ["PayloadRefusedError", "SafeDecoder", "safe_loads", "safe_dumps"]


class PayloadRefusedError(AuthenticationError):
    """An authenticated peer sent a frame that does not decode to plain data: it names a
    class or function outside the control plane's short list (what a pickle that runs code
    needs), or it is not a pickle at all."""


def _reconstruct(subtype, shape, dtype):
    # numpy pickles an array as _reconstruct(ndarray, (0,), b"b") then __setstate__ with its
    # real shape and bytes; any other call (a subclass, a huge empty shape) is not one of its
    import numpy as np
    if subtype is not np.ndarray or tuple(shape) != (0,):
        raise PayloadRefusedError(f"numpy _reconstruct({subtype!r}, {shape!r}) is not how "
                                  f"numpy pickles an array")
    return np.ndarray.__new__(np.ndarray, (0,), dtype)


def _numpy(module, name):
    import numpy as np
    if name == "ndarray":
        return np.ndarray
    if name == "dtype":
        return np.dtype
    if name == "_reconstruct":
        return _reconstruct
    # scalar(dtype, bytes) and _frombuffer(bytes, dtype, shape, order): both read only the
    # bytes the frame carries (a shape that does not match them raises)
    return getattr(importlib.import_module(module), name)


# (module, name) -> resolver; every entry constructs data only
_BASE = {("builtins", "complex"): lambda m, n: complex,
         ("builtins", "set"): lambda m, n: set,
         ("builtins", "frozenset"): lambda m, n: frozenset}
for _mod in ("numpy", "numpy.core.multiarray", "numpy._core.multiarray",
             "numpy.core.numeric", "numpy._core.numeric"):
    for _name in ("dtype", "ndarray", "scalar", "_reconstruct", "_frombuffer"):
        _BASE[(_mod, _name)] = _numpy
del _mod, _name


class _Unpickler(pickle.Unpickler):
    def __init__(self, data, extra):
        super().__init__(io.BytesIO(data))
        self._extra = extra

    def find_class(self, module, name):
        cls = self._extra.get((module, name))
        if cls is not None:
            return cls
        resolve = _BASE.get((module, name))
        if resolve is None:
            raise PayloadRefusedError(f"the frame names {module}.{name}, which hora's control "
                                      f"plane does not accept (plain data only)")
        return resolve(module, name)

    def persistent_load(self, pid):
        raise PayloadRefusedError("the frame carries a persistent id")


class SafeDecoder:
    """Decodes frames of plain data and of the classes in ``allow``.

    Args:
        allow: classes (namedtuples, say) that may appear beside plain data; each is
            constructed from the frame's arguments by its own ``__new__``, so only list
            classes whose construction runs no code of the sender's choosing.
        names: more ``{(module, name): object}`` a frame may name, for objects that are
            not classes (``("torch", "float32")``: a dtype constant), with the same care.
    """

    def __init__(self, allow=(), names=None):
        self._extra = {(c.__module__, c.__qualname__): c for c in allow}
        self._extra.update(names or {})

    def loads(self, data):
        """The object pickled in ``data``.

        Raises:
            PayloadRefusedError: the frame names anything else, or it is not a pickle.
        """
        if copyreg._extension_cache and _names_extension(data):
            # an extension code the process has resolved before comes from a cache,
            # without a find_class: refuse them all (hora never sends any)
            raise PayloadRefusedError("the frame uses a copyreg extension code")
        try:
            return _Unpickler(data, self._extra).load()
        except PayloadRefusedError:
            raise
        except Exception as e:  # noqa: BLE001 - any malformed pickle, whatever numpy raised
            raise PayloadRefusedError(f"undecodable frame: {type(e).__name__}: {e}") from e


safe_loads = SafeDecoder().loads


def _names_extension(data):
    try:
        return any(op.name.startswith("EXT")
                   for op, _, _ in pickletools.genops(io.BytesIO(data)))   # (any bytes-like)
    except Exception:  # noqa: BLE001 - malformed: the unpickler refuses it next
        return False


def safe_dumps(obj):
    """``obj`` as a frame payload (the newest pickle protocol: plain data needs no lookup)."""
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
