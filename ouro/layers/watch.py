"""Whether anything watches a module: a fused op that covers a submodule's work runs only when no
hook sits on that submodule, so a probe that hooks it (the lab's numerics taps, the decode
breakdown's timers) sees the module run as written, and localises a fault to it."""


def watched(*modules) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks for m in modules)
