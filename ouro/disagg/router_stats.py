"""The router's one view of its workers' heartbeats: what `/metrics` shows for a deployment."""

from __future__ import annotations

from .image_routes import ENCODE_STATS, ENCODER_CACHE_STATS

DECODE_STATS = ("running", "pages_free", "pages_total", "slots_free", "slots_total", "preemptions", "rooms",
                "transfers_completed", "transfers_failed", "kv_bytes_received")


def merge_stats(links, latencies: list[float]) -> dict:
    """Engine metrics from the decode workers (where requests run); transfer counters from both
    sides; encode counters from the encode workers and the prefill workers' encoder caches.
    `latencies`: the transfer latencies this heartbeat brought (each observed once)."""
    by_role = {role: [lk.stats for lk in links if lk.role == role and lk.stats] for role in ("encode", "prefill", "decode")}
    dec, pre, enc = by_role["decode"], by_role["prefill"], by_role["encode"]
    total = lambda stats, keys: {k: sum(x.get(k, 0) for x in stats) for k in keys}
    s = total(dec, DECODE_STATS)
    s["waiting"] = sum(x.get("waiting", 0) for x in dec + pre)
    s.update(total(pre, ("held", "transfer_queue", "kv_bytes_sent") + ENCODER_CACHE_STATS))
    s["prefill_pages_used"] = sum(x.get("pages_total", 0) - x.get("pages_free", 0) for x in pre)
    s["prefill_slots_used"] = sum(x.get("slots_total", 0) - x.get("slots_free", 0) for x in pre)
    s.update(total(enc, ENCODE_STATS))
    s["encoders_up"] = sum(lk.dead is None for lk in links if lk.role == "encode")
    s["transfer_latencies"] = latencies
    return s
