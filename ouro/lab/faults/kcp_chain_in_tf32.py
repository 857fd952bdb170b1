from .patch import Fault

FAULT = Fault(
    name="kcp_chain_in_tf32",
    description="the context-parallel KDA state products run in tf32 whatever precision is configured",
    file="ouro/ops/kda/cp.py", function="_mm",
    replace=[("return None if precision == \"fp32\" else (lambda a, b: matmul(a, b, precision))",
              "return lambda a, b: matmul(a, b, \"tf32\")  # FAULT")],
    localised=[{"file": "ouro/ops/kda/cp.py", "function": ["_mm", "chain_states", "kda_sliced"]}],
    probes=[["numerics", "--model", "tiny", "--kcp-sweep", "2048,8192", "--kcp-slice", "512"]],
    symptom="long prompts prefilled across ranks drift from single-rank prefill; short ones agree",
)
