"""One candidate configuration as a real `ouro serve` process (`ouro tune --workload serve`).

The candidate's fields are written as a config file and served with `ouro serve --config`, on a
free port of 127.0.0.1, exactly as a user would run the tuned file; the workload is then the
load generator of `ouro bench serve` (streaming completions, at most `concurrency` in flight, the
arrivals at `request_rate`), so what is timed includes the HTTP front end, the engine process's
queue and the detokeniser. It answers the same commands as `worker.Worker`:
- run: the load once -> {"seconds", "output_tokens", "decode_step_s" (the median inter-token
  latency: a running request's decode step as the client sees it), "ttft_s", "failed"};
- greedy: greedy tokens and top-2 logprobs, through /v1/completions with token ids named by id.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ..bench.server_process import ServerExited, wait_ready
from ..parallel.groups import free_port
from .worker import threads_for


def refusal(log: str) -> str:
    """The line of a server's output that says why it did not start (its last error line)."""
    lines = [x.strip() for x in log.splitlines() if x.strip()]
    errors = [x for x in lines if "rror" in x or x.startswith("ouro")]
    return (errors or lines or ["no output"])[-1][:500]


class ServerWorker:
    def __init__(self, model_dir, fields: dict, workload: dict, timeout_s: float = 1800.0):
        from ..config.file import write_config_file
        self.fields, self.workload, self.timeout_s = fields, workload, timeout_s
        self.dir = Path(tempfile.mkdtemp(prefix="ouro-tune-"))
        write_config_file(self.dir / "candidate.toml", fields, comment="an ouro tune candidate")
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "ouro.cli", "serve", "--model", str(model_dir), "--config",
               str(self.dir / "candidate.toml"), "--port", str(self.port),
               "--max-num-seqs", str(workload["concurrency"]), "--max-memory", str(workload["max_memory"]),
               "--max-model-len", str(workload["input_len"] + workload["output_len"] + 8),
               "--max-queued-requests", str(max(256, workload["num_prompts"] + 1))]
        env = dict(os.environ, OURO_NUM_THREADS=str(threads_for(fields)), TOKENIZERS_PARALLELISM="false")
        self.log = open(self.dir / "server.log", "w+")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        try:
            wait_ready(self.proc, self.base, timeout_s, self.log)
        except ServerExited as e:          # a refused combination, a missing kernel
            self.close()
            raise ValueError(f"ouro serve exited ({e.returncode}): {refusal(e.log)}") from None
        except BaseException:
            self.close()
            raise
        self.ready = {"ready": True, "pid": self.proc.pid}
        self._prompts = None

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def _run(self) -> dict:
        from ..bench.load_gen import run_load
        from ..bench.offline import make_prompts
        from ..bench.serve import calculate_metrics
        from ..config import ModelConfig
        w = self.workload
        if self._prompts is None:
            vocab = ModelConfig.from_hf(self._model_dir()).vocab_size
            self._prompts = make_prompts(w["num_prompts"], w["input_len"], vocab, w["seed"])
        load = run_load(self.base, "/v1/completions", None, self._prompts, w["output_len"],
                        w.get("request_rate", float("inf")), w["concurrency"], w["seed"], progress=False)
        try:        # a server that stops answering fails the candidate, never hangs the search
            records, duration = asyncio.run(asyncio.wait_for(load, self.timeout_s))
        except asyncio.TimeoutError:
            raise RuntimeError(f"the workload did not finish in {self.timeout_s:.0f} s: "
                               f"{refusal(self.output())}") from None
        m = calculate_metrics([r.to_dict() for r in records], duration)
        if m["failed"]:
            errors = sorted({r.error for r in records if r.error})
            raise RuntimeError(f"{m['failed']} of {len(records)} requests failed: {'; '.join(errors)[:500]}")
        itl, ttft = m["itl_ms"]["median"], m["ttft_ms"]["median"]
        return {"seconds": duration, "output_tokens": m["total_output_tokens"], "failed": m["failed"],
                "decode_step_s": itl / 1e3 if itl is not None else None,
                "ttft_s": ttft / 1e3 if ttft is not None else None}

    def _greedy(self, prompts, max_tokens) -> list[dict]:
        import httpx
        body = {"prompt": prompts, "max_tokens": max_tokens, "temperature": 0.0, "logprobs": 2, "ignore_eos": True,
                "return_tokens_as_token_ids": True}
        r = httpx.post(self.base + "/v1/completions", json=body, timeout=self.timeout_s)
        if r.status_code != 200:
            raise RuntimeError(f"greedy check request failed: HTTP {r.status_code}: {r.text[:300]}")
        by_index = {c["index"]: c["logprobs"] for c in r.json()["choices"]}
        tid = lambda s: int(s.removeprefix("token_id:"))        # noqa: E731
        return [{"tokens": [tid(t) for t in by_index[i]["tokens"]],
                 "top": [{str(tid(k)): v for k, v in (top or {}).items()} for top in by_index[i]["top_logprobs"]]}
                for i in range(len(prompts))]

    def _model_dir(self) -> str:
        return self.proc.args[self.proc.args.index("--model") + 1]

    def ask(self, cmd: dict) -> dict:
        if self.proc.poll() is not None:
            raise RuntimeError(f"ouro serve exited ({self.proc.returncode}): {refusal(self.output())}")
        if cmd["cmd"] == "run":
            return self._run()
        if cmd["cmd"] == "greedy":
            return {"outputs": self._greedy(cmd["prompts"], cmd["max_tokens"])}
        raise ValueError(f"unknown command {cmd['cmd']!r}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)
