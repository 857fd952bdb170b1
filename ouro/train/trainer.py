"""The training loop of `ouro train`: AdamW with warm-up and cosine decay, gradient clipping,
language-model + MTP + indexer-distillation + MoE-balance losses, held-out evaluation, periodic
checkpoints it resumes from, and an export in the `save_pretrained` layout after each one."""

from __future__ import annotations

import ctypes
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from ..eval.corpus import load_split
from . import data
from .balance import RouterBalance
from .hf_model import build_model, dsa_attentions, forward_with_mtp, use_ouro_kda
from .indexer_distill import LayerInputs, distill
from .trainer_config import TrainConfig

LN2 = math.log(2.0)


def tune_malloc() -> None:
    """glibc returns and re-maps every large freed block by default; a training step frees and
    re-allocates the same tensors each time, so the system time of those page faults was about
    half the run. Raise the thresholds (only on glibc; elsewhere nothing happens)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 32 << 20)     # glibc's maximum
    libc.mallopt(m_trim_threshold, 1 << 30)


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    t = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def set_dense(model, dense: bool, seq_len: int, config: ModelConfig) -> None:
    """Dense warm-up: every pool selected (index_topk covers the window), then the real top-k."""
    for _, attn in dsa_attentions(model):
        attn.indexer.index_topk = (seq_len + config.index_kpool) if dense else config.index_topk


class Trainer:
    def __init__(self, cfg: TrainConfig, out_dir: str | Path, model_config: ModelConfig, progress: bool = True):
        self.cfg, self.mc, self.progress = cfg, model_config, progress
        self.out = Path(out_dir)
        self.state_dir = self.out / "train"
        self.state_dir.mkdir(parents=True, exist_ok=True)
        tune_malloc()
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        use_ouro_kda(cfg.kda_chunk_size)
        train_docs = load_split("train", cfg.corpus, max_bytes=cfg.max_train_bytes)
        self.tokenizer = self._tokenizer(train_docs)
        self.held_out = load_split("held_out", cfg.corpus, max_bytes=cfg.eval_max_bytes)
        self.stream = data.token_stream(self.tokenizer, train_docs)
        self.train_bytes = sum(d.n_bytes for d in train_docs)
        self.model = build_model(model_config, mtp=True, seed=cfg.seed)
        self.inputs = LayerInputs(self.model)
        self.balance = RouterBalance(self.model, cfg.bias_rate)
        decay = [p for n, p in self.model.named_parameters() if p.ndim >= 2 and "embed" not in n]
        other = [p for n, p in self.model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                      {"params": other, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)
        self.step, self.elapsed, self.tokens_seen = 0, 0.0, 0
        self._resume()

    # ---- set-up ----
    def _tokenizer(self, docs):
        from tokenizers import Tokenizer
        from ..models.tokenizer_factory import build_tokenizer
        path = self.state_dir / "tokenizer.json"
        if path.is_file():
            return Tokenizer.from_file(str(path))
        tok = build_tokenizer(self.mc.vocab_size, (d.text for d in docs), max_vocab=self.mc.vocab_size)
        path.write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
        return tok

    def _resume(self) -> None:
        path = self.state_dir / "state.pt"
        if not path.is_file():
            (self.state_dir / "config.json").write_text(json.dumps(dataclasses.asdict(self.cfg), indent=2))
            return
        state = torch.load(path, map_location="cpu", weights_only=False)
        saved = state["train_config"]
        changed = {k for k, v in dataclasses.asdict(self.cfg).items()
                   if saved.get(k) != v and k not in ("time_limit_s", "threads", "eval_every", "checkpoint_every", "steps")}
        if changed:
            raise ValueError(f"{path} was written with other settings ({', '.join(sorted(changed))}); "
                             "resume with the same ones or use another --output directory")
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        self.step, self.elapsed, self.tokens_seen = state["step"], state["elapsed"], state["tokens_seen"]
        print(f"ouro train: resumed at step {self.step} from {path}", file=sys.stderr)

    def save_state(self) -> None:
        path = self.state_dir / "state.pt"
        tmp = path.with_suffix(".tmp")
        torch.save({"model": self.model.state_dict(), "optimizer": self.opt.state_dict(), "step": self.step,
                    "elapsed": self.elapsed, "tokens_seen": self.tokens_seen,
                    "train_config": dataclasses.asdict(self.cfg)}, tmp)
        os.replace(tmp, path)

    def log(self, record: dict) -> None:
        with open(self.state_dir / "log.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

    # ---- one step ----
    def train_step(self) -> dict:
        cfg, model = self.cfg, self.model
        model.train()
        set_dense(model, self.step < cfg.dense_warmup * cfg.steps, cfg.seq_len, self.mc)
        lr = lr_at(self.step, cfg)
        for g in self.opt.param_groups:
            g["lr"] = lr
        w = data.batch_at(self.stream, self.step, cfg.seed, cfg.batch_size, cfg.seq_len + 1)
        x = w[:, :-1]
        self.inputs.clear()
        self.balance.clear()
        logits, mtp_logits = forward_with_mtp(model, x)
        lm = F.cross_entropy(logits.flatten(0, 1).float(), w[:, 1:].flatten())
        mtp = F.cross_entropy(mtp_logits.flatten(0, 1).float(), w[:, 2:].flatten())
        stats = [distill(a, self.inputs.inputs[n], self.mc.index_kpool, self.mc.index_topk // self.mc.index_kpool)
                 for n, a in self.inputs.attns]
        idx = sum(s.loss for s in stats) / len(stats)
        bal = self.balance.loss()
        loss = lm + cfg.mtp_weight * mtp + cfg.indexer_weight * idx + cfg.balance_weight * bal
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip).item()
        if not math.isfinite(loss.item()) or not math.isfinite(grad_norm):
            raise FloatingPointError(f"step {self.step}: loss {loss.item()} grad norm {grad_norm}; lower --lr")
        self.opt.step()
        worst_load = self.balance.update_bias()
        self.inputs.clear()
        self.step += 1
        self.tokens_seen += x.numel()
        return {"step": self.step, "loss": loss.item(), "lm_bits_per_token": lm.item() / LN2,
                "mtp_loss": mtp.item(), "indexer_kl": idx.item(), "balance": bal.item(),
                "max_load_ratio": worst_load, "grad_norm": grad_norm, "lr": lr}

    # ---- evaluation ----
    @torch.no_grad()
    def evaluate(self, documents=None, length: int | None = None) -> dict:
        """Held-out bits/byte (transformers' forward), trunk and MTP top-1 accuracy, indexer recall."""
        model, mc = self.model, self.mc
        model.eval()
        set_dense(model, False, 0, mc)
        documents = documents or self.held_out
        length = length or self.cfg.seq_len
        windows = data.eval_windows(data.document_ids(self.tokenizer, documents), length)
        bits = correct = mtp_correct = mtp_accept = mtp_n = n = 0.0
        rec = {"hit": 0.0, "chance": 0.0, "rows": 0}
        k = mc.index_topk // mc.index_kpool
        for w in windows:
            self.inputs.clear()
            logits, mtp_logits = forward_with_mtp(model, w[None, :-1])
            logp = logits[0].float().log_softmax(-1)
            tgt = w[1:]
            bits -= logp.gather(-1, tgt[:, None]).sum().item() / LN2
            correct += (logp.argmax(-1) == tgt).sum().item()
            n += len(tgt)
            if mtp_logits is not None and len(w) > 2:
                draft = mtp_logits[0].argmax(-1)
                mtp_correct += (draft == w[2:]).sum().item()
                # greedy speculative acceptance: the draft for t+2 equals the trunk's own greedy pick
                mtp_accept += (draft == logp[1:].argmax(-1)).sum().item()
                mtp_n += len(w) - 2
            for name, attn in self.inputs.attns:
                if name in self.inputs.inputs:
                    s = distill(attn, self.inputs.inputs[name], mc.index_kpool, k)
                    if s.rows:
                        rec["hit"] += s.recall * s.rows
                        rec["chance"] += s.chance * s.rows
                        rec["rows"] += s.rows
        self.inputs.clear()
        n_bytes = sum(d.n_bytes for d in documents)
        return {"bits_per_byte": bits / n_bytes, "top1": correct / n, "mtp_top1": mtp_correct / max(1, mtp_n),
                "mtp_greedy_acceptance": mtp_accept / max(1, mtp_n),
                "indexer_recall": rec["hit"] / max(1, rec["rows"]), "recall_chance": rec["chance"] / max(1, rec["rows"]),
                "tokens": int(n), "bytes": n_bytes, "documents": len(documents)}

    # ---- the loop ----
    def run(self) -> dict:
        cfg = self.cfg
        from tqdm import tqdm
        bar = tqdm(total=cfg.steps, initial=self.step, disable=not self.progress, desc="ouro train", unit="step",
                   dynamic_ncols=True)
        last_eval = None
        if self.step == 0:
            last_eval = self.evaluate()
            self.log({"step": 0, "elapsed": 0.0, "eval": last_eval})
        started = time.monotonic() - self.elapsed
        window_t, window_tokens = time.monotonic(), 0
        stopped_early = False
        while self.step < cfg.steps:
            rec = self.train_step()
            self.elapsed = time.monotonic() - started
            window_tokens += cfg.batch_size * cfg.seq_len
            rate = window_tokens / max(1e-9, time.monotonic() - window_t)
            rec.update(elapsed=round(self.elapsed, 2), tokens_per_s=round(rate, 1))
            self.log(rec)
            post = {"loss": f"{rec['loss']:.3f}", "tok/s": f"{rate:,.0f}"}
            if last_eval:
                post["bpb"] = f"{last_eval['bits_per_byte']:.3f}"
            bar.set_postfix(post)
            bar.update(1)
            out_of_time = cfg.time_limit_s is not None and self.elapsed >= cfg.time_limit_s
            if self.step % cfg.eval_every == 0 or self.step == cfg.steps or out_of_time:
                last_eval = self.evaluate()
                self.log({"step": self.step, "elapsed": round(self.elapsed, 2), "eval": last_eval})
                window_t, window_tokens = time.monotonic(), 0     # evaluation time is not training speed
                started = time.monotonic() - self.elapsed
            if self.step % cfg.checkpoint_every == 0 or self.step == cfg.steps or out_of_time:
                self.save_state()
                self.export()
            if out_of_time:
                stopped_early = True
                break
        bar.close()
        return {"step": self.step, "elapsed": self.elapsed, "eval": last_eval, "stopped_early": stopped_early,
                "tokens_seen": self.tokens_seen, "train_bytes": self.train_bytes}

    def export(self, directory: str | Path | None = None) -> Path:
        from .export import export_checkpoint
        return export_checkpoint(self.model, self.mc, self.tokenizer, directory or self.out,
                                 dtype=getattr(torch, self.cfg.export_dtype),
                                 info={"steps": self.step, "train_seconds": round(self.elapsed, 1),
                                       "tokens_seen": self.tokens_seen, "seed": self.cfg.seed})
