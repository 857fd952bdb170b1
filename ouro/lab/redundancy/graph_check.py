"""Whether the decode step traces as one graph: `ouro probe redundancy --graph`.

Builds the compiled decode step (`ouro.engine.decode_graph`) on a small cache and traces it with
`fullgraph=True` at two batch-size buckets through a counting `aot_eager` backend (the capture
and functionalisation inductor would compile, no C++ build). One graph for both buckets is the
capturable step the issue asks for (info). A graph break (a host sync, data-dependent Python) is
an error naming the file and line where the trace stopped; more than one graph means a size was
specialised (a warning naming the count)."""

from __future__ import annotations

import re
import time

import torch

from ..findings import Finding


def graph_finding(model, batch_sizes=(3, 5), context: int = 24) -> Finding:
    from ...engine.decode_graph import DecodeGraph, counting_backend
    from ...engine.simple_runner import SimpleRunner
    n = max(batch_sizes)
    runner = SimpleRunner(model, n + 1, context + 4)          # the last slot and its pages: scratch
    backend = counting_backend("aot_eager")
    graph = DecodeGraph(model, runner.cache, n, int(runner.page_table[n, 0]), max_bs=n, backend=backend)
    g = torch.Generator().manual_seed(0)
    runner.step([torch.randint(1, model.config.vocab_size, (context,), generator=g).tolist()] * n + [[]])
    ps = runner.page_size
    start = time.perf_counter()
    try:
        with torch.inference_mode():
            for b in batch_sizes:
                rows = list(range(b))
                graph.run([1] * b, [runner.lengths[i] for i in rows], rows,
                          [runner.page_table[i, : runner.lengths[i] // ps + 1].tolist() for i in rows])
    except Exception as e:       # fullgraph: the first break ends the trace with its reason
        text = str(e)
        where = [w for w in re.findall(r'File "([^"]+)", line (\d+), in (\w+)', text) if "site-packages" not in w[0]]
        file, line, fn = where[-1] if where else (None, None, None)
        return Finding("redundancy", "error", f"the decode step does not trace as one graph: {text.splitlines()[0][:200]}",
                       {"file": file, "line": int(line) if line else None, "function": fn},
                       evidence={"error": text[:1500]},
                       next="make that code tensor-only on the decode path (a GraphContext method, a tensor mask)")
    graphs = [sum(1 for node in gm.graph.nodes if node.op == "call_function") for gm in backend.graphs]
    buckets = sorted({next(x for x in graph.buckets if x >= b) for b in batch_sizes})
    measured = {"graphs": len(graphs), "graph_ops": graphs, "buckets": buckets,
                "trace_s": round(time.perf_counter() - start, 1)}
    if len(graphs) != 1:
        return Finding("redundancy", "warning", f"the decode step traced {len(graphs)} graphs for buckets {buckets}: "
                       "a batch size or table width was specialised", {"function": "DecodeGraph._forward"},
                       measured=measured, expected={"graphs": 1},
                       next="TORCH_LOGS=recompiles names the guard that failed")
    return Finding("redundancy", "info", f"the decode step traces as one graph ({graphs[0]} ops) for buckets "
                   f"{buckets}, no graph break and no host sync inside", {"function": "DecodeGraph._forward"},
                   measured=measured)
