from .patch import Fault

FAULT = Fault(
    name="kv_sender_spins_holding_gil",
    description="the prefill worker's transfer thread waits for work by spinning, holding the GIL",
    file="ouro/disagg/kv_sender.py", function="_next_job",
    replace=[("return jobs.get(timeout=TICK_S)", """while True:   # FAULT: a busy wait never releases the GIL for long
                      try:
                          return jobs.get_nowait()
                      except queue.Empty:
                          pass""")],
    localised=[{"thread": "ouro-kv-sender"}, {"file": "ouro/disagg/kv_sender.py", "function": ["_next_job"]}],
    probes=[["timeline", "--model", "tiny", "--scenario", "pd"]],
    symptom="disaggregated prefill is far slower than prefill alone, though little data moves",
)
