"""The `pd` scenario: what handing a prefilled request to a decode worker costs the prefill side.

A real decode worker (`ouro serve --role decode`, its own process, the KV receiver on loopback
TCP) and a prefill engine in this process (`PrefillEngine`, the transfer thread beside the
compute). In ROUNDS rounds, each running the three variants in a turning order, medians:
- `pd_prefill_ms`: the prompt prefilled here alone (the first token sampled, nothing sent);
- `pd_with_transfer_ms`: the same prefill while its state streams layer by layer into the
  decode worker's room, until the transfer's last frame is out (the prefill side is free then);
- `pd_no_overlap_ms`: the same, with every layer sent only after the prefill (no overlap).
`pd_overhead = pd_with_transfer_ms / pd_prefill_ms - 1` (the reference stack's budget: <= 0.05),
`pd_overhead_no_overlap` likewise, each with its 95% interval (a bootstrap over whole rounds: a
budget passes only where the whole interval does) and the A/B verdict of the two variants;
`pd_wait_overhead`: what the transfer adds to the compute thread as waiting (wall minus its CPU
time, against the same round's prefill alone: the machine's jitter, which slows compute on and off
the core alike, cancels, so this one resolves a few per cent in nine rounds where the wall-clock
ratio cannot); `pd_compute_cpu_overhead`: the compute thread's own CPU time, likewise;
`pd_send_overlap`: the share of the transfer thread's send time that falls inside the prefill's
compute, from the run's spans, and `pd_handoff_ms`: until the decode worker's first output
arrives. The trace of the last overlapped round comes back for the timeline (heartbeat on: a
transfer thread holding the GIL shows as starvation there).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

PROMPT_LEN = 2048
ROUNDS = 9          # one round: each variant once; medians and a paired bootstrap interval over rounds
# both sides' dtype, named: `auto` is resolved by each process for its own thread count, and where
# bfloat16 wins (AVX-512 BF16 machines) the two caches differed and no transfer could complete
DTYPE = "float32"


def pd(model_dir, prompt_len: int = PROMPT_LEN, rounds: int = ROUNDS, heartbeat: bool = True, timeout: float = 180.0) -> dict:
    from ..config import EngineConfig
    from ..disagg.prefill_engine import PrefillEngine
    from ..engine.llm_engine import LLMEngine
    from ..engine.sampling import SamplingParams
    from ..models.loader import load_model
    from .workload import prompts

    memory = 6 * prompt_len * 64 * 1024 + (64 << 20)
    worker = DecodeWorker(model_dir, memory, timeout)
    try:
        worker.ask({"type": "hello"}, "ready")
        cfg = EngineConfig(max_memory=memory, page_size=64, max_num_seqs=4, max_num_batched_tokens=prompt_len,
                           dtype=DTYPE)
        engine = LLMEngine(load_model(model_dir, dtype=cfg.torch_dtype()), None, cfg, verbose=False)
        ids = prompts(1, prompt_len, vocab=min(engine.model.config.vocab_size, 30000), seed=9)[0]
        run = Variants(engine, PrefillEngine(engine), worker, ids, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        run.alone("warm")                                  # warm-up (also picks the GEMM forms)
        run.handed("warm", True)
        run.times["handoff"].clear()
        threads, doc = run.rounds(rounds, heartbeat)
        run.prefill.close()
    finally:
        worker.close()
    return summarise(run.times, doc, threads)


class DecodeWorker:
    """A real decode worker (`ouro serve --role decode`, its own process) and the two sockets to it."""

    def __init__(self, model_dir, memory: int, timeout: float):
        import zmq

        from ..disagg.command import spawn_workers
        from ..serve.messages import decode, encode
        self.decode, self.encode, self.timeout = decode, encode, timeout
        env = {**os.environ, "OURO_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        env.pop("OURO_TRACE", None)
        [(self.process, port)] = spawn_workers(
            [[sys.executable, "-m", "ouro.cli", "serve", "--role", "decode", "--model", str(model_dir),
              "--max-memory", str(memory), "--page-size", "64", "--dtype", DTYPE, "--exit-with-parent"]], quiet=True,
            env=env)
        self.ctx = zmq.Context()
        self.push, self.pull = self.ctx.socket(zmq.PUSH), self.ctx.socket(zmq.PULL)
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.connect(f"tcp://127.0.0.1:{port}")
        self.pull.connect(f"tcp://127.0.0.1:{port + 1}")

    def ask(self, msg: dict, want: str, rid=None) -> dict:
        """Send `msg`; the first reply of type `want` (for `rid`), else an error naming why none came."""
        self.push.send(self.encode(msg))
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the decode worker exited (code {self.process.returncode})")
            if self.pull.poll(100):
                got = self.decode(self.pull.recv())
                if got["type"] == want and (rid is None or got.get("rid") == rid):
                    return got
                if got["type"] == "error" and got.get("rid") == rid:
                    raise RuntimeError(f"the decode worker refused: {got['message']}")
        raise RuntimeError(f"no {want!r} from the decode worker within {self.timeout:.0f} s")

    def await_output(self, rid) -> None:
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.pull.poll(100):
                got = self.decode(self.pull.recv())
                if got["type"] == "outputs" and any(i["rid"] == rid for i in got["items"]):
                    return
                if got["type"] == "error" and got.get("rid") == rid:
                    raise RuntimeError(f"the decode worker failed {rid}: {got['message']}")
        raise RuntimeError(f"the decode worker gave no output for {rid} within {self.timeout:.0f} s")

    def close(self) -> None:
        import zmq
        try:
            self.push.send(self.encode({"type": "shutdown"}))
        except zmq.ZMQError:
            pass
        self.ctx.destroy(linger=0)
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()


class Variants:
    """The three ways the prompt runs (alone; handed over with the transfer overlapped or not),
    each timed as (wall s, the compute thread's CPU s) into `times`."""

    def __init__(self, engine, prefill, worker: DecodeWorker, ids, params):
        self.engine, self.prefill, self.worker, self.ids, self.params = engine, prefill, worker, ids, params
        self.times = {k: [] for k in ("alone", "overlap", "no_overlap", "handoff", "cpu_alone", "cpu_overlap",
                                      "cpu_no_overlap")}

    def alone(self, tag) -> tuple[float, float]:
        t, c = time.perf_counter(), time.thread_time()
        self.engine.add_request({"prompt_token_ids": self.ids}, self.params, f"alone-{tag}")
        while self.engine.has_unfinished():
            self.engine.step()
        return time.perf_counter() - t, time.thread_time() - c

    def handed(self, tag, overlap: bool) -> tuple[float, float]:
        from ..serve.messages import params_to_wire
        p = self.prefill
        p.overlap = overlap
        rid = f"pd-{tag}-{int(overlap)}"
        room = self.worker.ask({"type": "reserve", "rid": rid, "prompt_token_ids": self.ids,
                                "params": params_to_wire(self.params)}, "reserved", rid)["room"]
        t, c = time.perf_counter(), time.thread_time()
        p.add(rid, self.ids, self.params, room)
        while rid not in p.outcomes:
            p.step()
            if not p.runnable():
                time.sleep(0.0005)     # the transfer thread finishes: a short sleep, no spin
        sent, cpu = time.perf_counter() - t, time.thread_time() - c
        self.worker.await_output(rid)
        if p.outcomes.pop(rid) != "done":
            raise RuntimeError(f"the transfer of {rid} did not complete")
        if overlap:
            self.times["handoff"].append(time.perf_counter() - t)
        return sent, cpu

    def rounds(self, rounds: int, heartbeat: bool) -> tuple[dict, dict]:
        """Each round runs the three variants in a turning order (a drift of the machine hits each
        alike); the last overlapped one is traced. Returns (variant -> per round: {process:
        {thread: CPU s}}, the trace)."""
        from ..measure import heartbeat as hb
        from ..measure import spans, thread_cpu
        threads: dict[str, list] = {}
        for r in range(rounds):
            for name in ORDER[r % len(ORDER)]:
                traced = r == rounds - 1 and name == "overlap"
                if traced:
                    spans.clear(), hb.clear()
                    spans.enable()
                    if heartbeat:
                        hb.start()
                before = _threads(self.worker.process.pid)
                try:
                    wall, cpu = self.alone(r) if name == "alone" else self.handed(r, name == "overlap")
                finally:
                    if traced:
                        hb.stop()
                        spans.disable()
                after = _threads(self.worker.process.pid)
                self.times[name].append(wall)
                self.times["cpu_" + name].append(cpu)
                threads.setdefault(name, []).append({k: thread_cpu.delta(before[k], after[k]) for k in before})
        return threads, {"traceEvents": spans.chrome_events(process_name="ouro prefill")}


def _threads(worker_pid: int) -> dict:
    from ..measure.thread_cpu import snapshot
    return {"prefill": snapshot(), "decode worker": snapshot(worker_pid)}


def thread_medians(rounds: list[dict]) -> dict:
    """{process: {thread: [median CPU ms, median run-queue wait ms]}} over the rounds (a thread
    absent in a round counts 0)."""
    def med(p, t, i):
        return round(1e3 * statistics.median(r.get(p, {}).get(t, (0.0, 0.0))[i] for r in rounds), 1)
    procs = sorted({p for r in rounds for p in r})
    return {p: {t: [med(p, t, 0), med(p, t, 1)] for t in sorted({t for r in rounds for t in r.get(p, {})})}
            for p in procs}


# every order of the three variants, in turn: each comes first, second and last as often
ORDER = (("alone", "overlap", "no_overlap"), ("overlap", "no_overlap", "alone"), ("no_overlap", "alone", "overlap"),
         ("alone", "no_overlap", "overlap"), ("no_overlap", "overlap", "alone"), ("overlap", "alone", "no_overlap"))


def summarise(times: dict, doc: dict, threads: dict | None = None) -> dict:
    """Medians, the overheads as paired ratios of medians with their bootstrap interval and the
    lab's A/B verdict (`ab.verdict_from_times`, rounds resampled whole), and the send overlap."""
    from ..measure.ab import verdict_from_times
    med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    verdicts, intervals = {}, {}
    for name, key in (("pd_overhead", "overlap"), ("pd_overhead_no_overlap", "no_overlap")):
        v = verdict_from_times(times["alone"], times[key], "prefill alone", f"prefill + transfer ({key})", paired=True)
        verdicts[name] = v.to_dict()
        intervals[name] = [v.low - 1, v.high - 1]
    # the waiting the transfer adds to the compute thread (wall minus its CPU time: the GIL, a
    # core, the tail after its last layer), per round against that round's prefill alone: the
    # machine's jitter (the same prefill took 3.4..4.6 s here, on and off the core alike) cancels
    waits = [((wo - co) - (wa - ca)) / wa for wo, co, wa, ca in
             zip(times["overlap"], times["cpu_overlap"], times["alone"], times["cpu_alone"])]
    intervals["pd_wait_overhead"] = median_interval(waits)
    return {"measurements": {"pd_prefill_ms": med["alone"], "pd_with_transfer_ms": med["overlap"],
                             "pd_wait_overhead": statistics.median(waits),
                             # the compute thread's own CPU time: work added on it, not waiting or preemption
                             "pd_compute_cpu_overhead": med["cpu_overlap"] / med["cpu_alone"] - 1,
                             "pd_no_overlap_ms": med["no_overlap"], "pd_handoff_ms": med["handoff"],
                             "pd_overhead": med["overlap"] / med["alone"] - 1,
                             "pd_overhead_no_overlap": med["no_overlap"] / med["alone"] - 1,
                             "pd_send_overlap": send_overlap(doc)},
            "intervals": intervals, "verdicts": verdicts, "rounds": len(times["alone"]),
            "times_ms": {k: [round(1e3 * t, 2) for t in v] for k, v in times.items()},
            # who ran during each variant: every thread of both processes (OpenMP workers as native:)
            "thread_cpu_ms": {k: thread_medians(v) for k, v in (threads or {}).items()}, "trace": doc}


def median_interval(values: list[float], resamples: int = 2000, seed: int = 0) -> list[float]:
    """95% bootstrap interval of the median of `values` (one per round)."""
    import random
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return [meds[int(0.025 * resamples)], meds[int(0.975 * resamples) - 1]]


def send_overlap(doc: dict) -> float:
    """The share of `kv send` time inside `forward` spans (1.0: every send overlapped compute)."""
    from ..measure.chrome_trace import spans_of
    ss = spans_of(doc)
    compute = [(s["start_ms"], s["end_ms"]) for s in ss if s["name"] == "forward"]
    sends = [(s["start_ms"], s["end_ms"]) for s in ss if s["name"] == "kv send"]
    total = sum(e - b for b, e in sends)
    inside = sum(max(0.0, min(e, ce) - max(b, cb)) for b, e in sends for cb, ce in compute)
    return inside / total if total > 0 else 0.0
