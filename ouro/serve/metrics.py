"""Prometheus metrics, named and shaped like vLLM's and SGLang's, prefixed `ouro:`."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0)


EPD_GAUGES = {"encoders_up": "Encode workers up", "images_encoded": "Images encoded (cumulative)",
              "encode_seconds": "Seconds the encode workers spent encoding (cumulative)",
              "image_waits": "Requests on the prefill workers waiting for their image rows",
              "encoder_cache_hits": "Image rows found in a prefill worker's encoder cache (cumulative)",
              "encoder_cache_misses": "Image rows missing from a prefill worker's encoder cache (cumulative)",
              "encoder_cache_bytes": "Bytes of image rows in the prefill workers' encoder caches"}


class Metrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        lbl = ["model_name"]
        self.model_name = model_name
        g = lambda name, doc: Gauge(name, doc, lbl, registry=r).labels(model_name)
        self.running = g("ouro:num_requests_running", "Requests in the engine's running batch")
        self.waiting = g("ouro:num_requests_waiting", "Requests waiting for pages or a state slot")
        self.pages_used = g("ouro:kv_pages_used", "Paged DSA cache pages in use")
        self.pages_total = g("ouro:kv_pages_total", "Paged DSA cache pages")
        self.kv_usage = g("ouro:kv_cache_usage_perc", "Fraction of KV pages in use (0..1)")
        self.slots_used = g("ouro:state_slots_used", "KDA state slots in use")
        self.slots_total = g("ouro:state_slots_total", "KDA state slots")
        self.prefix_hit_rate = g("ouro:prefix_cache_hit_rate", "Prefix-cache lookups that hit (0..1)")
        self.in_flight = g("ouro:num_requests_in_flight", "Sequences (a request's prompts x n) admitted by the frontend and not finished")
        h = lambda name, doc: Histogram(name, doc, lbl, buckets=LATENCY_BUCKETS, registry=r).labels(model_name)
        self.ttft = h("ouro:time_to_first_token_seconds", "Time to first token")
        self.itl = h("ouro:inter_token_latency_seconds", "Time between consecutive output tokens")
        self.e2e = h("ouro:e2e_request_latency_seconds", "End-to-end request latency")
        self.queue = h("ouro:request_queue_time_seconds", "Time a request waited before it was first scheduled")
        c = lambda name, doc: Counter(name, doc, lbl, registry=r).labels(model_name)
        self.prompt_tokens = c("ouro:prompt_tokens", "Prompt tokens processed")
        self.generation_tokens = c("ouro:generation_tokens", "Generated tokens")
        self.cached_tokens = c("ouro:prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache")
        self.finished = Counter("ouro:request_success", "Finished requests by finish reason",
                                lbl + ["finished_reason"], registry=r)
        self.rejected = Counter("ouro:request_rejected", "Requests refused by the frontend, by HTTP status",
                                lbl + ["status"], registry=r)
        self.preemptions = g("ouro:num_preemptions", "Preemptions since start (cumulative)")
        self.engine_up = g("ouro:engine_up", "1 while the engine process is alive and ready")
        # speculative decoding (SGLang's spec_accept_length; ouro adds the rate and its value per draft position)
        self.spec_accept_length = g("ouro:spec_accept_length", "Mean tokens a speculative verification emits")
        self.spec_accept_rate = g("ouro:spec_accept_rate", "Fraction of verified draft tokens accepted")
        self.spec_verify_steps = g("ouro:spec_verify_steps", "Speculative verifications (cumulative)")
        self.spec_accept_at = Gauge("ouro:spec_accept_rate_per_position", "Acceptance rate of each draft position",
                                    lbl + ["position"], registry=r)
        # disaggregated serving (set from the workers' heartbeats when a router runs)
        self.pd_rooms = g("ouro:pd_decode_rooms", "Decode-side rooms waiting for their prefilled state")
        self.pd_held = g("ouro:pd_prefill_held_requests", "Prefilled requests whose state is still being sent")
        self.pd_queue = g("ouro:pd_transfer_queue_length", "Transfer jobs queued on the prefill workers")
        self.pd_bytes_sent = g("ouro:pd_kv_bytes_sent", "State bytes sent by the prefill workers (cumulative)")
        self.pd_bytes_received = g("ouro:pd_kv_bytes_received", "State bytes received by the decode workers (cumulative)")
        self.pd_completed = g("ouro:pd_transfers_completed", "Transfers that completed (cumulative)")
        self.pd_failed = g("ouro:pd_transfers_failed", "Rooms freed without a complete state (cumulative)")
        self.pd_prefill_pages = g("ouro:pd_prefill_pages_used", "Cache pages in use on the prefill workers")
        self.pd_prefill_slots = g("ouro:pd_prefill_slots_used", "KDA state slots in use on the prefill workers")
        # encode workers (--disagg XE...): the encoders' and the prefill workers' encoder caches
        self.epd = {k: g(f"ouro:epd_{k}", doc) for k, doc in EPD_GAUGES.items()}
        self.pd_latency = h("ouro:pd_transfer_latency_seconds",
                            "From the prefill worker's last computed layer to the decode worker's complete room")

    def update_engine(self, s: dict) -> None:
        self.running.set(s.get("running", 0))
        self.waiting.set(s.get("waiting", 0))
        total, free = s.get("pages_total", 0), s.get("pages_free", 0)
        self.pages_used.set(total - free)
        self.pages_total.set(total)
        self.kv_usage.set((total - free) / total if total else 0.0)
        self.slots_used.set(s.get("slots_total", 0) - s.get("slots_free", 0))
        self.slots_total.set(s.get("slots_total", 0))
        self.preemptions.set(s.get("preemptions", 0))
        if "rooms" in s:
            for gauge, key in [(self.pd_rooms, "rooms"), (self.pd_held, "held"), (self.pd_queue, "transfer_queue"),
                               (self.pd_bytes_sent, "kv_bytes_sent"), (self.pd_bytes_received, "kv_bytes_received"),
                               (self.pd_completed, "transfers_completed"), (self.pd_failed, "transfers_failed"),
                               (self.pd_prefill_pages, "prefill_pages_used"), (self.pd_prefill_slots, "prefill_slots_used")]:
                gauge.set(s.get(key, 0))
            for v in s.get("transfer_latencies", ()):
                self.pd_latency.observe(v)
        if "encoders_up" in s:
            for k, gauge in self.epd.items():
                gauge.set(s.get(k, 0))
        if "spec_verify_steps" in s:
            self.spec_accept_length.set(s["spec_accept_length"])
            self.spec_accept_rate.set(s["spec_accept_rate"])
            self.spec_verify_steps.set(s["spec_verify_steps"])
            for i, v in enumerate(s.get("spec_accept_rate_per_position", ())):
                self.spec_accept_at.labels(self.model_name, str(i + 1)).set(v)
        lookups = s.get("prefix_hits", 0) + s.get("prefix_misses", 0)
        self.prefix_hit_rate.set(s.get("prefix_hits", 0) / lookups if lookups else 0.0)

    def finish(self, reason: str) -> None:
        self.finished.labels(self.model_name, reason).inc()

    def reject(self, status: int) -> None:
        self.rejected.labels(self.model_name, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
