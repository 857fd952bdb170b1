"""The engine: requests in, incremental outputs out, one scheduler step at a time."""

from __future__ import annotations

import itertools
import logging
import sys

import torch

from ..config import EngineConfig
from ..measure.spans import span
from ..parallel import cp_prefill
from ..quant.w8a8 import quantize_model
from .admission import checked_request
from .checkpointer import Checkpointer, CheckpointStore
from .disagg_requests import DisaggRequests
from .detokenizer import IncrementalDetokenizer
from .memory import cache_budget, plan_memory
from .outputs import OutputProcessor
from .model_runner import ModelRunner
from .page_pool import PagePool, SlotPool
from .grammar_queue import GrammarQueue
from .host_allocator import keep_activation_buffers
from .options import check_engine_options
from .request import Request, RequestFailed, RequestOutput
from .sampling import Sampler, SamplingParams, make_generator
from . import speculative, tp_workers
from .scheduler import Scheduler

log = logging.getLogger("ouro.engine")


class LLMEngine(DisaggRequests):
    def __init__(self, model, tokenizer=None, config: EngineConfig = EngineConfig(), verbose: bool = True,
                 record_logits: bool = False, logits_processors=(), model_dir=None, mtp_layer=None,
                 tp_follower_module=None, options_checked: bool = False):
        """model_dir: the checkpoint `model` came from; context parallelism loads it on its helper ranks,
        speculative decoding its MTP layer (or pass `mtp_layer`, an `ouro.models.mtp.MTPLayer`), an
        image its vision tower.
        tp_follower_module: the tensor-parallel followers' entry, for a role with more operations.
        options_checked: the caller ran `check_engine_options(config, model.config)` before loading weights."""
        if not options_checked:
            check_engine_options(config, model.config)
        if config.device == "cpu":
            keep_activation_buffers()      # a step's multi-MB activations reused, not faulted in again
        self.tp = tp_workers.start(model, config, model_dir, tp_follower_module)     # the model now holds this rank's shard
        mc = model.config
        self.model, self.tokenizer, self.config, self.model_dir = model, tokenizer, config, model_dir
        self._images = None       # `image_encoder()`, at the first image
        self.record_logits = record_logits    # keep each sampled step's logits (tests, probes)
        # callables (prompt_ids, output_ids, logits [V]) -> logits, applied before sampling
        self.logits_processors = list(logits_processors)
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        self.outputs = OutputProcessor(mc.eos_token_ids, self.max_model_len)
        self.logits_history = self.outputs.logits_history     # request id -> each step's logits (record_logits)
        # with speculation the cache also holds the MTP draft layer's rows (one more DSA layer)
        cache_config = mc.with_mtp_layer() if config.speculative_algorithm else mc
        self._plan_cache(cache_config, verbose)
        self.pages, self.slots = PagePool(self.plan.n_pages), SlotPool(self.plan.n_slots)
        self.cp = cp_prefill.start(model, config, model_dir, self.tp, self.kv_kinds)     # None without --cp
        if config.deterministic_inference:
            _deterministic(verbose)
        # in place, before the runner measures its products: the engine runs what it was built with
        self.quantized = (quantize_model(model, config.quantization, config.quantization_ignore)
                          if config.quantization else None)
        self._build_runner(cache_config)
        self.speculator = speculative.start(self, mtp_layer)     # None without --speculative-algorithm
        if config.compile:
            done = self.runner.warm_up(progress=verbose)
            if verbose:
                print(f"ouro: compiled the decode step for batch sizes {done['buckets']} in {done['seconds']:.1f} s",
                      file=sys.stderr)
        self._start_prefix_cache()
        self.scheduler = Scheduler(self.pages, self.slots, config.page_size, config.max_num_seqs,
                                   config.max_num_batched_tokens, self.prefix_cache,
                                   chunk_align=config.prefix_checkpoint_interval * config.page_size
                                   if self.prefix_cache else 0,
                                   cp_threshold=config.cp_threshold if self.cp else 0)
        self.sampler = Sampler()
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.grammars = GrammarQueue(tokenizer, model.config, model_dir)    # structured outputs compiling
        self.failed: list[RequestFailed] = []   # released requests, raised one per step()
        self.num_failed_steps = 0

    def _plan_cache(self, cache_config, verbose: bool) -> None:
        """The memory budget, measured once here (the tensor-parallel ranks share it: each rank's
        cache is planned from its share, the followers build what this rank planned), and the pools'
        sizes from it, said in one line."""
        config = self.config
        self.budget = cache_budget(config)
        self.kv_kinds = config.kv_kinds(self.model.config)      # DSA layers whose cache rows are quantised
        self.plan = plan_memory(cache_config, self.budget.per_rank, config.page_size, config.max_num_seqs,
                                self.model.embed_tokens.weight.dtype, kv_kinds=self.kv_kinds,
                                checkpoint_fraction=0.1 if config.enable_prefix_caching else 0.0,
                                max_model_len=self.max_model_len, checkpoint_interval=config.prefix_checkpoint_interval,
                                budget=self.budget)
        if verbose:
            print(f"ouro: {self.plan.describe(min(self.max_model_len, 4096))}", file=sys.stderr, flush=True)
        else:
            log.info("%s", self.plan.describe(min(self.max_model_len, 4096)))

    def _build_runner(self, cache_config) -> None:
        """The runner (the cache, the compiled step), the rank group it tells, and the KDA checkpoints."""
        config = self.config
        self.runner = ModelRunner(self.model, self.plan, config.device,
                                  min(config.torch_compile_max_bs, config.max_num_seqs) if config.compile else 0,
                                  cp=self.cp, kv_kinds=self.kv_kinds, cache_config=cache_config,
                                  keep_hidden=bool(config.speculative_algorithm))
        if self.tp is not None:          # the followers build the same caches; the runner tells them each step
            self.tp.build_caches(self.runner, self.plan.n_checkpoints, self.kv_kinds)
            self.runner.ranks = self.tp
        self.cache = self.runner.cache      # KV rows and KDA states: what a disaggregated transfer reads and writes
        self.checkpointer = Checkpointer(CheckpointStore(self.runner.cache, self.plan.n_checkpoints, self.runner.ranks)
                                         if self.plan.n_checkpoints else None, config.page_size)

    def _start_prefix_cache(self) -> None:
        """The prefix tree where prefix caching is on and the plan left room for a checkpoint; else
        None, and where it was asked for, why not (logged)."""
        config = self.config
        self.prefix_cache, self.prefix_caching_off_reason = None, None
        if config.enable_prefix_caching and self.checkpointer.store is None:
            self.prefix_caching_off_reason = (f"the memory budget ({self.budget.per_rank / 2**20:.1f} MiB) leaves no "
                                              "room for one KDA-state checkpoint next to the pages; raise --max-memory")
            log.warning("prefix caching is OFF: %s", self.prefix_caching_off_reason)
        elif config.enable_prefix_caching:
            from .prefix_cache import PrefixCache
            self.prefix_cache = PrefixCache(config.page_size, self.pages, self.plan.n_checkpoints,
                                            checkpoint_interval=config.prefix_checkpoint_interval,
                                            on_evict_checkpoint=self.checkpointer.store.release)
            self.checkpointer.prefix_cache = self.prefix_cache

    def close(self) -> None:
        """Stop the helper ranks (tensor and context parallelism); the engine computes no more after."""
        for helper in (self.tp, self.cp):
            if helper is not None:
                helper.close()

    # ---- requests ----
    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    mm=None) -> str:
        """Queue one sequence. Everything is checked before the engine changes, so a rejected
        request leaves no trace. Fan-out (n > 1) is the caller's: see `SamplingParams.child`.
        `mm`: the prompt's image rows encoded elsewhere (`ImageInputs`, an encode worker's)."""
        ids, params, images = checked_request(self, prompt, params, request_id)    # `admission.py`
        if mm is not None:
            mm.check(ids, self.model.config)
        elif images:
            mm = self.image_encoder().encode(ids, images)    # the encode step
        n = next(self._ids)
        if request_id is None:
            request_id = f"req-{n}"
            while request_id in self.requests:   # a user may have taken this name
                request_id = f"req-{next(self._ids)}"
        req = Request(request_id, ids, params, generator=make_generator(params.seed, self.config.seed + n), mm=mm)
        if params.prompt_logprobs is not None:
            req.prompt_logprobs, req.prompt_ranks = [None] * len(ids), [None] * len(ids)
        if self.tokenizer is not None:
            req.detokenizer = IncrementalDetokenizer(self.tokenizer, ids, params.stop_list, params.skip_special_tokens)
        if params.structured is not None:      # waits for its grammar (compiled off the step)
            self.grammars.add(req)
        else:
            self.scheduler.add(req)
        self.requests[request_id] = req
        return request_id

    def check_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None):
        """Validate a request without queuing it; returns (prompt token ids, params)."""
        return checked_request(self, prompt, params, request_id)[:2]

    def image_encoder(self):
        """The checkpoint's image processor and vision tower, loaded at the first image."""
        if self._images is None:       # (under --tp rank 0 encodes; the followers get the rows with each forward)
            from .multimodal import ImageEncoder
            self._images = ImageEncoder(self.model_dir, self.model.config, device=self.config.device)
        return self._images

    def abort(self, request_id: str) -> bool:
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        if self.grammars.abort(request_id):     # never reached the scheduler
            return True
        self.checkpointer.drop(req)
        self.scheduler.finish(req, "abort")
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self.grammars) or bool(self.failed)

    def stats(self) -> dict:
        """Counters for logs and /metrics: queue sizes, pool use, preemptions, what limits admission."""
        s = self.scheduler
        out = {"running": len(s.running), "waiting": len(s.waiting), "held": len(s.held),
               "pages_free": self.pages.num_free, "pages_total": self.pages.num_total,
               "slots_free": self.slots.num_free, "slots_total": self.slots.num_total,
               "preemptions": s.num_preemptions, "slot_limited_steps": s.slot_limited_steps,
               "failed_steps": self.num_failed_steps, "prefix_caching": self.prefix_cache is not None}
        if self.prefix_cache is not None:
            out.update({f"prefix_{k}": v for k, v in self.prefix_cache.stats().items()})
        if self.speculator is not None:
            out.update(self.speculator.stats.summary())
        return out

    # ---- one step ----
    @span("step", cat="step")
    def step(self) -> list[RequestOutput]:
        if self.grammars:
            ready, failed = self.grammars.ready()
            for r in ready:
                self.scheduler.add(r)
            for r, why in failed:
                self.requests.pop(r.request_id, None)
                self.failed.append(RequestFailed(r.request_id, why, status=400))
        if self.failed:         # each lost request is raised on its own, none dropped
            raise self.failed.pop(0)
        batch = self.scheduler.schedule()
        if not batch:
            return []
        # tensor parallel: a batch whose picks read only the best k tokens needs only each rank's k
        # best, unless something reads the logits themselves
        self.runner.candidates_allowed = self.tp is not None and not self.logits_processors and not self.record_logits
        try:
            self.checkpointer.restore_batch(batch)       # prefix hits' KDA states back into their slots
            logits = self.runner.execute(batch)
        except RequestFailed as e:       # that request is released; the rest carry on next step
            self.num_failed_steps += 1
            self.abort(e.request_id)
            if self.cp is not None and self.cp.broken and self.scheduler.cp_threshold:
                log.error("context parallelism is off (%s): long prompts now prefill on this rank alone", self.cp.broken)
                self.scheduler.cp_threshold = 0
            raise
        except BaseException as e:
            # The forward may have advanced KDA states and written cache rows of every request
            # in the batch while their computed-token counts did not move: such a state must
            # never be resumed. Recompute them from scratch (their tokens so far are kept).
            self.num_failed_steps += 1
            for r in batch.requests:
                if r.request_id in self.requests:
                    self.checkpointer.drop(r)
                    self.scheduler.reset(r)
            if self.tp is not None:     # the ranks may be out of step: no later forward can be trusted
                self.tp.fail(self.tp.broken or self.tp.diagnose(e), e)
            raise
        with span("checkpoint", cat="cache"):
            self.checkpointer.after_step(batch)
        starts = [r.num_computed - n if r.spec_record is None else r.num_computed
                  for r, n in zip(batch.requests, batch.num_new_tokens)]
        outputs = self._sample(batch, logits)
        if self.speculator is not None:
            outputs += self.speculator.finish_step(batch, starts)
        return outputs

    def _sample(self, batch, logits) -> list[RequestOutput]:
        rows = [i for i, r in enumerate(batch.requests) if r.num_computed == r.num_tokens and r.spec_record is None]
        outputs = []
        for r in [batch.requests[i] for i in rows if batch.requests[i].params.max_tokens == 0]:
            self._finish(r, "length")             # max_tokens 0: the prompt prefilled (and scored), no token
            outputs.append(self.outputs.output(r, [], ""))
        rows = [i for i in rows if batch.requests[i].params.max_tokens > 0]
        if not rows:
            return outputs
        reqs = [batch.requests[i] for i in rows]
        # a copy of the logits only where it is needed: rows that do not pick, or rows written in place
        if len(rows) < logits.shape[0] or self.logits_processors or self.grammars.writes(reqs):
            logits = logits[rows]
        for proc in self.logits_processors:
            for k, r in enumerate(reqs):
                logits[k] = proc(r.prompt_ids, r.output_ids, logits[k])
        dead = self.grammars.constrain(logits, reqs)     # forced prefixes, structured outputs' bitmasks
        if dead:                # constraints that leave no token: that request fails, the rest sample
            for k in dead:
                self._finish(reqs[k], "abort")
                self.failed.append(RequestFailed(reqs[k].request_id, "its constraints leave no token to sample "
                                                 "(a forced prefix the grammar refuses?)", status=400))
            keep = [k for k in range(len(reqs)) if k not in dead]
            reqs, logits = [reqs[k] for k in keep], logits[keep]
            if not reqs:
                return outputs
        with span("sample", cat="sample"):
            sampled = self.sampler.sample(logits, [r.params for r in reqs], [r.generator for r in reqs])
        with span("outputs", cat="outputs"):   # detokenize, stop checks, output objects
            for k, r in enumerate(reqs):
                tok = sampled.token_ids[k]
                new_text = self.emit(r, tok, sampled.logprobs[k], sampled.top_logprobs[k],
                                      logits[k] if self.record_logits else None)
                outputs.append(self.outputs.output(r, [tok], new_text))
        return outputs

    def emit(self, r: Request, tok: int, logprob, top, logits_row=None) -> str:
        """One output token through the output processor; a request it stops is let go here. The new text."""
        text, reason = self.outputs.emit(r, tok, logprob, top, logits_row)
        if reason:
            self._finish(r, reason)
        return text

    def reset_prefix_cache(self) -> int:
        """Drop every unreferenced cached prefix page and checkpoint; returns the pages freed."""
        if self.prefix_cache is None:
            return 0
        return self.prefix_cache.evict_pages(self.pages.num_total)

    def _finish(self, r: Request, reason: str) -> None:
        self.requests.pop(r.request_id, None)
        self.checkpointer.drop(r)
        self.scheduler.finish(r, reason)


def _deterministic(verbose: bool) -> None:
    """Batch-invariant kernels, process-wide, before any product is measured or run."""
    from ..ops import batch_invariant
    block = batch_invariant.enable()
    if verbose:
        print(f"ouro: deterministic inference: products padded to {block}-row blocks; batch-invariant "
              f"kernels for {', '.join(batch_invariant.replaced())}", file=sys.stderr)
