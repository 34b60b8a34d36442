"""The core: init and topology, the background engine, negotiation, and the NumPy API.

The API's names load on first use (PEP 562): importing a submodule (:mod:`hora.core.sagemaker`,
read by the ``hora`` command's SageMaker entry) does not import the engine and NumPy.
"""
import importlib
import importlib.util

# name -> the submodule that defines it (ops's own names are added from its __all__)
_FROM = {"Handle": "handles", "Average": "messages", "Sum": "messages", "Adasum": "messages",
         "Min": "messages", "Max": "messages", "Product": "messages",
         "ProcessSet": "process_sets", "add_process_set": "process_sets",
         "global_process_set": "process_sets", "remove_process_set": "process_sets",
         "init": "lifecycle", "shutdown": "lifecycle",
         "is_initialized": "state", "rank": "state", "size": "state",
         "local_rank": "state", "local_size": "state",
         "cross_rank": "state", "cross_size": "state", "is_homogeneous": "state",
         "broadcast_object": "objects", "allgather_object": "objects",
         "metrics": "stats", "write_metrics": "stats"}


def _api():
    ops = importlib.import_module(".ops", __name__)
    return {**_FROM, **{name: "ops" for name in ops.__all__}}


def __getattr__(name):
    if name.startswith("__") and name != "__all__" or _is_submodule(name):
        # a submodule not imported yet: ``from hora.core import dataplane`` asks this first,
        # and must not pay for the whole API
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name == "__all__":
        value = list(_api())
    else:
        where = _FROM.get(name) or _api().get(name)
        if where is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{where}", __name__), name)
    globals()[name] = value
    return value


def _is_submodule(name):
    return importlib.util.find_spec(f"{__name__}.{name}") is not None


def __dir__():
    return sorted(set(globals()) | set(_api()))
