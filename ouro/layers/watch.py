"""Whether anything watches a module: a fused op that covers several modules' work (merged
projections, a KDA step that includes its output norm, the mHC merge of one layer with the next
layer's weights) runs only when no hook sits on those modules, so a probe that taps one of them
(the lab's numerics taps) sees it run as written and can localise a fault to it.

A hook that only observes a module's boundary as a whole (the op recorder's module stack, the
decode breakdown's timers) carries `ouro_passive = True` (`passive(fn)`): it does not stop the
fusion, so what it measures is the fused step a user runs."""


def passive(fn):
    """Marks a hook as one that needs no module to run on its own (see the module's text)."""
    fn.ouro_passive = True
    return fn


def watched(*modules) -> bool:
    return any(not getattr(h, "ouro_passive", False)
               for m in modules for hooks in (m._forward_hooks, m._forward_pre_hooks) for h in hooks.values())
