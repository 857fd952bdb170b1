from .patch import Fault

FAULT = Fault(
    name="scheduler_leaks_slot_on_abort",
    description="the scheduler forgets an aborted request's KDA state slot",
    file="ouro/engine/scheduler.py", function="Scheduler.finish",
    replace=[("self.free(req)", """if reason == "abort":
                  req.slot = None   # FAULT: the slot is dropped, never freed
              self.free(req)""")],
    localised=[{"file": "ouro/engine/scheduler.py", "function": ["finish"]}],
    probes=[["leaks", "--model", "tiny"]],
    symptom="after many cancelled requests the server admits fewer and fewer at once",
)
