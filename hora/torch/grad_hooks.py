"""Gradient hooks for the torch optimizer: a call once autograd has accumulated a
parameter's gradient for one backward pass.

A hook holds its owner (the optimizer) through a weak reference, so that the hooks never
keep it alive; the owner removes them when it is collected (``weakref.finalize``).

Layer: torch.
"""
__all__ = ["grad_accumulator", "hook_grad_ready", "remove_hooks"]


def hook_grad_ready(p, owner_ref):
    """Call ``owner._grad_ready(p)`` each time autograd has accumulated ``p.grad`` (while
    ``owner_ref()`` is alive); returns what :func:`remove_hooks` takes."""
    hook = _hook(owner_ref, p)
    if hasattr(p, "register_post_accumulate_grad_hook"):
        return p.register_post_accumulate_grad_hook(hook)
    acc = grad_accumulator(p)                # torch < 2.1: hook the grad accumulator
    return acc, acc.register_hook(hook)


def grad_accumulator(p):
    """The autograd node that accumulates ``p``'s gradient (``p`` requires one; grad mode
    must be on)."""
    return p.expand_as(p).grad_fn.next_functions[0][0]


def remove_hooks(hooks):
    """Remove hooks made by :func:`hook_grad_ready`."""
    for h in hooks:
        (h[1] if isinstance(h, tuple) else h).remove()


def _hook(owner_ref, p):
    def hook(*_):
        owner = owner_ref()
        if owner is not None:
            owner._grad_ready(p)
    return hook
