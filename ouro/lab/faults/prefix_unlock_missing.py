from .patch import Fault

FAULT = Fault(
    name="prefix_unlock_missing",
    description="a request that hit the prefix cache never unlocks its match, so those pages are never evictable",
    file="ouro/engine/scheduler.py", function="Scheduler.free",
    replace=[("self.prefix_cache.unlock(req.prefix_match)", "pass  # FAULT: the match stays locked")],
    localised=[{"file": "ouro/engine/scheduler.py", "function": ["free"]}],
    probes=[["leaks", "--model", "tiny"]],
    symptom="with prefix caching on, free pages shrink over a day of traffic",
)
