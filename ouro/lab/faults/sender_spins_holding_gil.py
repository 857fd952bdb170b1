from .patch import Fault

FAULT = Fault(
    name="sender_spins_holding_gil",
    description="the engine process's output-sender thread waits for work by spinning, holding the GIL",
    file="ouro/serve/engine_process.py", function="_next_item",
    replace=[("return q.get()", """while True:   # FAULT: a busy wait never releases the GIL for long
                  try:
                      return q.get_nowait()
                  except queue.Empty:
                      pass""")],
    localised=[{"thread": "ouro-output-sender"}, {"file": "ouro/serve/engine_process.py", "function": ["_next_item"]}],
    probes=[["timeline", "--model", "tiny", "--scenario", "serve"]],
    symptom="the server's time per output token is far worse than the offline engine's",
)
