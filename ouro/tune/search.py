"""`ouro tune`: the serving configuration this machine runs fastest, each step of it verified first.

Starting from the unoptimised engine (`space.BASELINE`), every option's choices are tried in turn
on top of the best configuration so far (a coordinate search). A candidate is first checked:
- an exact option (compile, batching, page size, speculation, TP/EP) must give the greedy tokens
  of the same configuration without it (a difference only where that run's top two logprobs lie
  within `TIE` of each other: a tie broken the other way);
- an output-changing option (dtype, quantisation, KV cache rows) must keep the quality model's
  held-out bits/byte within `budget` of float32's (its lossy fields together, not one at a time).
Only then is it timed against the best so far on the workload, in separate processes, alternating
(A B B A ...), and kept when the A/B verdict says faster beyond noise. Every candidate goes to the
journal (resumable). The winner is written as a config file; then each kept option is removed
from it in turn and timed against it (the ablation), and the winner against the baseline.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass

from ..measure.ab import verdict_from_times
from .journal import Journal
from .space import BASELINE, apply, choice_of, lossy_fields, search_space
from .worker import Worker

OBJECTIVES = ("throughput", "ttft")
TIE = 1e-3      # nats: a greedy pick this close to the runner-up may go either way
NOISE_TIES = 4  # ... or within this many times the two runs' measured logprob noise
NOISE_MAX = 0.05    # nats: runs whose logprobs of the same picks differ more do not compute the same model


def logprob_noise(ref: list[dict], got: list[dict]) -> float:
    """The largest difference between the two runs' logprobs of the same pick, over the positions
    where their tokens agree: the resolution at which they compute the same thing (float32
    rounding alone: ~1e-6; a W8A8 rounding step that flips: ~1e-2)."""
    worst = 0.0
    for r, g in zip(ref, got):
        for p, (a, b) in enumerate(zip(r["tokens"], g["tokens"])):
            if a != b:
                break
            ra, gb = r["top"][p].get(str(a)), g["top"][p].get(str(b))
            if ra is not None and gb is not None:
                worst = max(worst, abs(ra - gb))
    return worst


@dataclass
class Workload:
    num_prompts: int = 8
    input_len: int = 64
    output_len: int = 32
    concurrency: int = 8
    seed: int = 0
    max_memory: int = 512 << 20
    kind: str = "offline"              # offline: the engine in a process; serve: `ouro serve` under load
    request_rate: float = math.inf     # serve: arrivals per second (Poisson), inf = all at once
    objective: str = "throughput"      # what a kept candidate must improve: the workload's time, or (serve) median TTFT


def greedy_agree(ref: list[dict], got: list[dict]) -> str | None:
    """None when every prompt's tokens agree up to a tie in `ref` (its top two within TIE, or
    within NOISE_TIES times the runs' measured logprob noise); else where they part."""
    noise = logprob_noise(ref, got)
    if noise > NOISE_MAX:
        return f"the same picks' logprobs differ by up to {noise:.3f} > {NOISE_MAX} nats"
    tie = max(TIE, NOISE_TIES * noise)
    for i, (r, g) in enumerate(zip(ref, got)):
        for p, (a, b) in enumerate(zip(r["tokens"], g["tokens"])):
            if a == b:
                continue
            top = sorted(r["top"][p].values(), reverse=True)
            if len(top) >= 2 and top[0] - top[1] < tie:
                break                    # a tie: the rest legitimately differs
            gap = top[0] - top[1] if len(top) >= 2 else float("inf")
            return (f"prompt {i} position {p}: token {b} where the reference has {a} (its margin {gap:.2e} "
                    f"is no tie at the runs' noise {tie / NOISE_TIES:.1e})")
    return None


class Tuner:
    def __init__(self, model_dir, workload: Workload, journal_path, budget: float = 0.007, quality_dir=None,
                 rounds: int = 3, check_prompts: int = 4, check_tokens: int = 16, quality_bytes: int = 20000,
                 progress: bool = True, log=print):
        from ..config import ModelConfig
        self.model_dir, self.workload, self.budget = str(model_dir), workload, budget
        self.quality_dir, self.rounds, self.progress, self.log = quality_dir, rounds, progress, log
        self.check = {"prompts": None, "max_tokens": check_tokens, "n": check_prompts}
        self.quality_bytes = quality_bytes
        from ..machine.dtype_pick import cached_entry, pick_dtype
        pick_dtype("cpu")                  # measured once per machine, then cached
        rates = (cached_entry("cpu") or {}).get("gflop_s")
        if workload.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got {workload.objective!r}")
        if workload.objective == "ttft" and workload.kind != "serve":
            raise ValueError("--objective ttft needs --workload serve (the clients' first tokens are what it measures)")
        self.space = search_space(ModelConfig.from_hf(model_dir), workload.concurrency, gemm_rates=rates,
                                  input_len=workload.input_len)
        self.journal = Journal(journal_path, workload=asdict(workload))
        self._best_worker = None

    # ---- measurements ----
    def worker(self, config: dict):
        if self.workload.kind == "serve":
            from .server_worker import ServerWorker
            return ServerWorker(self.model_dir, config, asdict(self.workload))
        return Worker(self.model_dir, config, asdict(self.workload))

    def quality(self, lossy: dict) -> float:
        """Held-out bits/byte of the quality model with these output-changing fields (journaled)."""
        got = self.journal.get("quality", lossy)
        if got is not None:
            return got["bits_per_byte"]
        from ..engine.llm import LLM
        from ..eval.corpus import load_split
        from ..eval.ppl import evaluate_bits_per_byte
        docs = load_split("held_out", max_bytes=self.quality_bytes)
        ignore = lossy.get("quantization_ignore")
        llm = LLM(str(self.quality_dir), dtype=lossy.get("dtype", "float32"), quantization=lossy.get("quantization"),
                  quantization_ignore=tuple(ignore) if ignore is not None else None,
                  kv_cache_dtype=lossy.get("kv_cache_dtype", "auto"), max_memory=128 << 20, page_size=16)
        r = evaluate_bits_per_byte(llm, llm.engine.tokenizer, docs, context_len=512, progress=False)
        llm.engine.close()
        return self.journal.add("quality", lossy, {"bits_per_byte": r.bits_per_byte})["bits_per_byte"]

    def ab(self, a: Worker, b: Worker) -> dict:
        """Both workloads, alternating A B B A ...; the paired verdict of B against A."""
        ta, tb, steps, ttft = [], [], {"a": [], "b": []}, {"a": [], "b": []}
        for r in range(self.rounds):
            for side in (("a", "b") if r % 2 == 0 else ("b", "a")):
                out = (a if side == "a" else b).ask({"cmd": "run"})
                (ta if side == "a" else tb).append(out["seconds"])
                for key, into in (("decode_step_s", steps), ("ttft_s", ttft)):
                    if out.get(key) is not None:
                        into[side].append(out[key])
                tokens = out["output_tokens"]
        if self.workload.objective == "ttft":     # each round's median first-token time decides
            if len(ttft["a"]) != len(ta) or len(ttft["b"]) != len(tb):
                raise RuntimeError("a round reported no TTFT (every request failed?)")
            v = verdict_from_times(ttft["a"], ttft["b"], "best", "candidate", paired=True).to_dict()
        else:
            v = verdict_from_times(ta, tb, "best", "candidate", paired=True).to_dict()
        v["objective"] = self.workload.objective
        v["output_tok_s"] = {"a": tokens / statistics.median(ta), "b": tokens / statistics.median(tb)}
        v["decode_step_s"] = {k: statistics.median(s) if s else None for k, s in steps.items()}
        if self.workload.kind == "serve":      # the step as the clients saw it, and their first tokens
            v["ttft_s"] = {k: statistics.median(s) if s else None for k, s in ttft.items()}
        return v

    def greedy(self, w: Worker) -> list[dict]:
        if self.check["prompts"] is None:
            from ..bench.offline import make_prompts
            from ..config import ModelConfig
            vocab = ModelConfig.from_hf(self.model_dir).vocab_size
            self.check["prompts"] = make_prompts(self.check["n"], self.workload.input_len, vocab, 1234)
        return w.ask({"cmd": "greedy", "prompts": self.check["prompts"], "max_tokens": self.check["max_tokens"]})["outputs"]

    # ---- the search ----
    def best_worker(self, best: dict) -> Worker:
        if self._best_worker is None or self._best_worker.fields != best:
            if self._best_worker is not None:
                self._best_worker.close()
            self._best_worker = self.worker(best)
        return self._best_worker

    def try_candidate(self, best: dict, cand: dict, option) -> dict:
        entry = {"option": option.name, "choice": choice_of(cand, option), "exact": option.exact}
        if not option.exact:           # the quality model's bits/byte: no worker of the candidate needed
            q0, q = self.quality({"dtype": "float32"}), self.quality(lossy_fields(cand, self.space))
            rel = (q - q0) / q0
            entry.update(bits_per_byte=q, bits_per_byte_fp32=q0, quality_cost=rel)
            why = f"held-out bits/byte +{rel:.2%} > budget {self.budget:.2%}" if rel > self.budget else None
            entry["check"] = why or f"held-out bits/byte {rel:+.3%} within {self.budget:.2%}"
            if why is not None:
                return dict(entry, kept=False, why=f"check failed: {why}")
        try:
            w = self.worker(cand)
        except (ValueError, RuntimeError) as e:
            return dict(entry, kept=False, why=f"refused: {e}")
        try:
            try:
                if option.exact:
                    ref, got = self.greedy(self.best_worker(best)), self.greedy(w)
                    why = greedy_agree(ref, got)
                    entry["check"] = why or f"greedy tokens agree (logprob noise {logprob_noise(ref, got):.1e})"
                    if why is not None:
                        return dict(entry, kept=False, why=f"check failed: {why}")
                v = self.ab(self.best_worker(best), w)
            except (RuntimeError, ValueError) as e:     # a process died or stopped answering mid-measurement
                self._drop_best_worker()
                return dict(entry, kept=False, why=f"failed while measured: {e}")
            entry["ab"] = v
            kept = v["verdict"] == "faster"
            entry.update(kept=kept, why="faster" if kept else f"A/B: {v['verdict']} (ratio {v['ratio']:.3f})")
            if kept:            # the candidate's process is the new best's
                self._best_worker.close()
                self._best_worker, w = w, None
            return entry
        finally:
            if w is not None:
                w.close()

    def search(self) -> dict:
        from tqdm import tqdm
        best = dict(BASELINE)
        todo = [(o, c) for o in self.space.options for c in o.choices[1:]]
        bar = tqdm(total=len(todo), desc="tune", unit="candidate", disable=not self.progress)
        for option, (label, choice) in todo:
            cand = apply(best, option, choice)
            bar.set_postfix_str(f"{option.name}={label}")
            entry = self.journal.get("candidate", cand)
            if entry is None:
                t0 = time.perf_counter()
                entry = self.journal.add("candidate", cand, dict(self.try_candidate(best, cand, option),
                                                                 seconds=time.perf_counter() - t0))
            self.log(f"  {option.name}={label}: {'kept' if entry['kept'] else 'not kept'} ({entry['why']})")
            if entry["kept"]:
                best = cand
            bar.update(1)
        bar.close()
        return best

    def ablation(self, best: dict) -> dict:
        """The winner against the baseline, then against the winner without each kept option."""
        rows = []
        total = self.journal.get("total", best)
        if total is None:
            total = self.journal.add("total", best, {"ab": self._timed(dict(BASELINE), best)})
        for option in self.space.options:
            label = choice_of(best, option)
            if label == option.choices[0][0]:
                continue
            without = apply(best, option, {})
            got = self.journal.get("ablation", without)
            if got is None:
                got = self.journal.add("ablation", without, {"option": option.name, "choice": label,
                                                             "ab": self._timed(without, best)})
            rows.append(got)
        # each removal's time saved, as shares adding to one; their sum against the end-to-end
        # saving (measured in its own A/B) says how much interactions and noise move them
        slow = {r["option"]: max(0.0, r["ab"]["median_a_s"] - r["ab"]["median_b_s"]) for r in rows}
        saved = sum(slow.values())
        for r in rows:
            r["share"] = slow[r["option"]] / saved if saved > 0 else None
        gain = total["ab"]["median_a_s"] - total["ab"]["median_b_s"]
        return {"total": total, "rows": rows, "removals_over_total": saved / gain if gain > 0 else None}

    def gap(self, best: dict) -> dict:
        """The winner's decode step part by part against each part's floor (journaled): what keeps
        it from the target, named. Measured in the engine's own process, whatever the workload."""
        got = self.journal.get("gap", best)
        if got is None:
            w = Worker(self.model_dir, best, asdict(self.workload))
            try:
                got = self.journal.add("gap", best, {"breakdown": w.ask({"cmd": "breakdown"})})
            finally:
                w.close()
        return got["breakdown"]

    def _timed(self, a: dict, b: dict) -> dict:
        wa, wb = self.worker(a), self.worker(b)
        try:
            return self.ab(wa, wb)
        finally:
            wa.close()
            wb.close()

    def _drop_best_worker(self) -> None:
        """After a failure either side may be broken: the best's process is started anew when next needed."""
        if self._best_worker is not None:
            self._best_worker.close()
            self._best_worker = None

    def close(self) -> None:
        self._drop_best_worker()
