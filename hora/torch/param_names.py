"""The names of a torch optimizer's parameters, which key their allreduces (Horovod's
``_parameter_names``): the same on every rank, taken from ``named_parameters`` or, without
it, from each parameter's position.

Layer: torch.
"""
import torch

from ..core.gradients import noname

__all__ = ["parameter_names"]


def parameter_names(param_groups, named_parameters):
    """Horovod's ``_parameter_names``: each parameter's name, checking ``named_parameters``.

    Without ``named_parameters`` a parameter is ``allreduce.noname.<group>.<index>``.  As in
    Horovod the dict is in the order of the sorted names, and a tensor named twice (tied
    weights) keeps the last of its names in that order.
    """
    params = [p for g in param_groups for p in g["params"]]
    if named_parameters is None:
        named = [(noname(i, j), p)
                 for i, g in enumerate(param_groups) for j, p in enumerate(g["params"])]
        return {p: name for name, p in sorted(named, key=_by_name)}
    if isinstance(named_parameters, dict):
        named_parameters = named_parameters.items()
    named = list(named_parameters)
    if not all(isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], torch.Tensor)
               for x in named):
        raise ValueError("named_parameters should be a sequence of (name, parameter) tuples, "
                         "usually produced by model.named_parameters()")
    seen, dups = set(), []
    for name, _ in named:
        if name in seen and name not in dups:
            dups.append(name)
        seen.add(name)
    if dups:
        raise ValueError(f"Parameter names in named_parameters must be unique. Found "
                         f"duplicates: {', '.join(map(str, dups))}")
    names = {p: name for name, p in sorted(named, key=_by_name)}
    missing = [i for i, p in enumerate(params) if p not in names]
    if missing:
        raise ValueError(f"named_parameters was specified, but {len(missing)} parameter(s) of "
                         f"the optimizer are not named in it (positions {missing[:10]} in "
                         f"param_groups order)")
    return names


def _by_name(pair):
    return str(pair[0])
