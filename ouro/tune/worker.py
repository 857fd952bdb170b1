"""One candidate configuration in its own process: `ouro tune` starts two at a time (the best so
far and the candidate) and alternates them, so each runs with its own threads, its own
torch.distributed world (a TP candidate) and its own compiled graphs, and nothing of one
lingers in the other.

`python -m ouro.tune.worker MODEL_DIR FIELDS_JSON WORKLOAD_JSON` builds the engine (a refused
combination answers {"error": ...} and exits), prints {"ready": ...}, then answers one JSON line
per command on stdin:
- {"cmd": "run"}: the workload once -> {"seconds", "output_tokens", "decode_step_s"};
- {"cmd": "greedy", "prompts", "max_tokens"}: greedy tokens and the top-2 logprobs of each step;
- {"cmd": "breakdown"}: the decode step at the workload's concurrency part by part, each part
  against its floor (`measure.step_breakdown`).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time


def threads_for(fields: dict) -> int:
    """Every candidate uses the whole machine: TP ranks share its cores."""
    return max(1, (os.cpu_count() or 1) // fields.get("tensor_parallel_size", 1))


class Worker:
    """The parent's handle on a worker process."""

    def __init__(self, model_dir, fields: dict, workload: dict, timeout_s: float = 1800.0):
        env = dict(os.environ, OMP_NUM_THREADS=str(threads_for(fields)), TOKENIZERS_PARALLELISM="false")
        self.fields, self.timeout_s = fields, timeout_s
        self.proc = subprocess.Popen([sys.executable, "-m", "ouro.tune.worker", str(model_dir), json.dumps(fields),
                                      json.dumps(workload)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, env=env, text=True)
        self.ready = self._answer()

    def _answer(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            err = self.proc.stderr.read()[-2000:]
            raise RuntimeError(f"the worker exited: {err.strip().splitlines()[-1] if err.strip() else 'no output'}")
        out = json.loads(line)
        if "error" in out:
            raise ValueError(out["error"])
        return out

    def ask(self, cmd: dict) -> dict:
        try:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
        except OSError:            # the process is gone: say so as `_answer` does
            pass
        return self._answer()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _engine(model_dir, fields, workload):
    import torch

    from ..config import EngineConfig
    from ..engine.llm_engine import LLMEngine
    from ..models.loader import load_model
    torch.set_num_threads(threads_for(fields))
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}     # JSON arrays
    cfg = EngineConfig(**{"max_num_seqs": workload["concurrency"], "max_memory": workload["max_memory"],
                          "max_model_len": workload["input_len"] + workload["output_len"] + 8, **fields})
    model = load_model(model_dir, dtype=cfg.torch_dtype(), device=cfg.device, kda_chunk_size=cfg.kda_chunk_size)
    return LLMEngine(model, None, cfg, verbose=False, model_dir=model_dir)


def _greedy(engine, prompts, max_tokens):
    from ..engine.sampling import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    ids = [engine.add_request({"prompt_token_ids": p}, params) for p in prompts]
    done = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    return [{"tokens": done[i].token_ids, "top": [{str(k): v for k, v in (t or [])} for t in done[i].top_logprobs]}
            for i in ids]


def _breakdown(engine, workload) -> dict:
    from ..bench.offline import low_precision_rate, make_prompts
    from ..engine.sampling import SamplingParams
    from ..measure.roofline import Roofline
    from ..measure.step_breakdown import decode_breakdown
    roof = Roofline.measure(engine.config.device)
    low_precision_rate(engine.model, roof)
    steps = max(1, min(4, (workload["output_len"] - 4) // 2))
    prompts = make_prompts(workload["concurrency"], workload["input_len"], engine.model.config.vocab_size,
                           workload["seed"] + 1)
    return decode_breakdown(engine, prompts, steps, roof,
                            SamplingParams(temperature=0, max_tokens=2 * steps + 4, ignore_eos=True))


def main(model_dir, fields, workload) -> None:
    fields, workload = json.loads(fields), json.loads(workload)
    try:
        engine = _engine(model_dir, fields, workload)
    except (ValueError, RuntimeError) as e:       # a refused combination, a missing kernel
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
        return
    from ..bench.offline import make_prompts, run_ouro
    prompts = make_prompts(workload["num_prompts"], workload["input_len"], engine.model.config.vocab_size,
                           workload["seed"])
    print(json.dumps({"ready": True, "pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "run":
            t0 = time.perf_counter()
            seconds, log, outs = run_ouro(engine, prompts, workload["output_len"])
            decode = [s["s"] for s in log if s["decode"] and s["batch"] == workload["concurrency"]]
            print(json.dumps({"seconds": seconds, "wall_s": time.perf_counter() - t0,
                              "output_tokens": sum(len(o) for o in outs),
                              "decode_step_s": statistics.median(decode) if decode else None}), flush=True)
        elif cmd["cmd"] == "greedy":
            print(json.dumps({"outputs": _greedy(engine, cmd["prompts"], cmd["max_tokens"])}), flush=True)
        elif cmd["cmd"] == "breakdown":
            print(json.dumps(_breakdown(engine, workload)), flush=True)
    engine.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
