"""Train the tiny Llama target model from scratch on CPU and export it in Hugging Face layout.

    python -m models.tiny.recipe.corpus                               # held-out prompts (heldout_prompts.jsonl)
    python -m models.tiny.recipe.train_target --steps 3000            # tokenizer + training + export
    python -m models.tiny.recipe.train_target --steps 3000 --resume   # continue from the last checkpoint
    python -m models.tiny.recipe.train_target --benchmark 5           # time a few steps, then stop

Work files (tokenizer cache, token arrays, checkpoints, log) go to --work (default /tmp/tiny_target_work);
the exported model goes to --out (default models/tiny/target).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from dflash_local.layers import MLP, RMSNorm, apply_rope  # the same blocks the engine runs

from . import corpus as tiny_corpus

TINY = Path(__file__).resolve().parents[1]
SPECIALS = list(tiny_corpus.SPECIAL_TOKENS)  # ids 0..4
EOT, USER, ASSISTANT, END, MASK = range(5)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '<|user|>' + message['content'] + '<|end|>' }}"
    "{% elif message['role'] == 'assistant' %}{{ '<|assistant|>' + message['content'] + '<|end|>' }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported.') }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


# ----------------------------------------------------------------------------- tokenizer


def build_tokenizer(docs: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
    for i, name in enumerate(SPECIALS):
        assert tok.token_to_id(name) == i, (name, tok.token_to_id(name))
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    return tok


def load_or_build_tokenizer(work: Path, docs: list[str], vocab_size: int):
    from tokenizers import Tokenizer

    path = work / "tokenizer.json"
    if path.is_file():
        return Tokenizer.from_file(str(path))
    t0 = time.time()
    tok = build_tokenizer(docs, vocab_size)
    tok.save(str(path))
    print(f"trained tokenizer in {time.time() - t0:.0f}s", flush=True)
    return tok


def tokenizer_config() -> dict:
    added = {
        str(i): {
            "content": name,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, name in enumerate(SPECIALS)
    }
    return {
        "added_tokens_decoder": added,
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": None,
        "eos_token": "<|end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "mask_token": "<|mask|>",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "chat_template": CHAT_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


# ----------------------------------------------------------------------------- data


def encode_data(work: Path, tok, val_every: int):
    """Token arrays: plain train stream, plain val stream, chat stream + example starts (cached)."""
    cache = work / "data.npz"
    if cache.is_file():
        data = np.load(cache)
        return {k: data[k] for k in data.files}
    t0 = time.time()
    docs = tiny_corpus.training_documents()
    train_docs = [d for i, d in enumerate(docs) if i % val_every != val_every // 2]
    val_docs = [d for i, d in enumerate(docs) if i % val_every == val_every // 2]

    def stream(texts):
        out = []
        for enc in tok.encode_batch(texts, add_special_tokens=False):
            out.extend(enc.ids)
            out.append(EOT)
        return np.asarray(out, dtype=np.int16)

    chat_ids, chat_starts = [], []
    pairs = tiny_corpus.chat_pairs()
    encs = tok.encode_batch([t for pair in pairs for t in pair], add_special_tokens=False)
    for k in range(len(pairs)):
        chat_starts.append(len(chat_ids))
        chat_ids += [USER, *encs[2 * k].ids, END, ASSISTANT, *encs[2 * k + 1].ids, END, EOT]
    data = {
        "train": stream(train_docs),
        "val": stream(val_docs),
        "chat": np.asarray(chat_ids, dtype=np.int16),
        "chat_starts": np.asarray(chat_starts, dtype=np.int64),
    }
    for name in ("train", "val"):
        assert not np.isin(data[name], [USER, ASSISTANT, END, MASK]).any(), name
    assert not (data["chat"] == MASK).any()
    np.savez(cache, **data)
    print(
        f"encoded in {time.time() - t0:.0f}s: train {len(data['train'])} tokens ({len(train_docs)} docs), "
        f"val {len(data['val'])} tokens ({len(val_docs)} docs), chat {len(data['chat'])} tokens "
        f"({len(pairs)} pairs)",
        flush=True,
    )
    return data


def sample_batch(data, step: int, batch: int, seq: int, chat_frac: float, seed: int) -> torch.Tensor:
    """Deterministic per step (so --resume reproduces the same data): windows of seq+1 tokens."""
    rng = np.random.default_rng([seed, step])
    rows = []
    for _ in range(batch):
        if rng.random() < chat_frac:
            starts = data["chat_starts"]
            start = int(starts[rng.integers(0, len(starts))])
            start = min(start, len(data["chat"]) - seq - 1)
            rows.append(data["chat"][start : start + seq + 1])
        else:
            start = int(rng.integers(0, len(data["train"]) - seq - 1))
            rows.append(data["train"][start : start + seq + 1])
    return torch.from_numpy(np.stack(rows).astype(np.int64))


# ----------------------------------------------------------------------------- model


class Attention(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        h, hd = cfg["hidden_size"], cfg["head_dim"]
        self.nh, self.nkv, self.hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], hd
        self.q_proj = nn.Linear(h, self.nh * hd, bias=False)
        self.k_proj = nn.Linear(h, self.nkv * hd, bias=False)
        self.v_proj = nn.Linear(h, self.nkv * hd, bias=False)
        self.o_proj = nn.Linear(self.nh * hd, h, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        groups = self.nh // self.nkv
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.nh * self.hd))


class Layer(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg["hidden_size"], cfg["intermediate_size"])
        self.input_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])


class TinyLlama(nn.Module):
    """Causal LM with HF Llama parameter names; the LM head is tied to model.embed_tokens."""

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        hd = cfg["head_dim"]
        inv_freq = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        pos = torch.arange(cfg["max_position_embeddings"], dtype=torch.float32)
        emb = torch.cat([torch.outer(pos, inv_freq)] * 2, dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = 0.02
        out_std = std / math.sqrt(2 * self.cfg["num_hidden_layers"])
        for name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.ones_(p)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, 0.0, out_std)
            else:
                nn.init.normal_(p, 0.0, std)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        x = self.model.embed_tokens(ids)
        dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else x.dtype
        cos, sin = self.cos[:t].to(dtype), self.sin[:t].to(dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        x = self.model.norm(x)
        return F.linear(x, self.model.embed_tokens.weight)


AUTOCAST = False  # bf16 autocast; off by default: this CPU (AVX2 only) runs bf16 matmuls ~5x slower than fp32


def lm_loss(model, batch: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=AUTOCAST):
        logits = model(batch[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


@torch.no_grad()
def evaluate(model, stream: np.ndarray, seq: int, batch: int, max_seqs: int) -> float:
    model.eval()
    n = min((len(stream) - 1) // seq, max_seqs)
    rows = [stream[i * seq : i * seq + seq + 1] for i in range(n)]
    total, count = 0.0, 0
    for i in range(0, n, batch):
        chunk = torch.from_numpy(np.stack(rows[i : i + batch]).astype(np.int64))
        total += lm_loss(model, chunk).item() * len(chunk)
        count += len(chunk)
    model.train()
    return total / max(count, 1)


# ----------------------------------------------------------------------------- export


def hf_config(cfg: dict) -> dict:
    """config.json as LlamaConfig.save_pretrained writes it, plus a top-level rope_theta and torch_dtype."""
    import tempfile

    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"],
        head_dim=cfg["head_dim"],
        hidden_act="silu",
        max_position_embeddings=cfg["max_position_embeddings"],
        rms_norm_eps=cfg["rms_norm_eps"],
        rope_theta=cfg["rope_theta"],
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=None,
        eos_token_id=[END, EOT],
        pad_token_id=None,
        architectures=["LlamaForCausalLM"],
        dtype="bfloat16",
    )
    with tempfile.TemporaryDirectory() as tmp:
        config.save_pretrained(tmp)
        out = json.loads((Path(tmp) / "config.json").read_text())
    out["rope_theta"] = float(cfg["rope_theta"])
    out["rope_parameters"] = {"rope_type": "default", "rope_theta": float(cfg["rope_theta"])}
    out["torch_dtype"] = "bfloat16"
    out["bos_token_id"] = None
    out["eos_token_id"] = [END, EOT]
    return dict(sorted(out.items()))


def export(model: TinyLlama, tok, out_dir: Path) -> None:
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(hf_config(model.cfg), indent=2) + "\n")
    gen = {"_from_model_config": True, "bos_token_id": None, "eos_token_id": [END, EOT], "do_sample": False}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    (out_dir / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": "<|end|>", "pad_token": "<|endoftext|>", "mask_token": "<|mask|>"}, indent=2) + "\n"
    )


# ----------------------------------------------------------------------------- main


def lr_at(step: int, progress: float, peak: float, warmup: int, floor: float) -> float:
    """Linear warmup over `warmup` steps, then cosine to floor*peak as progress goes 0 -> 1."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, max(0.0, progress))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/tiny_target_work"))
    ap.add_argument("--out", type=Path, default=TINY / "target")
    ap.add_argument("--steps", type=int, default=100_000, help="step cap (the LR schedule follows --minutes)")
    ap.add_argument("--minutes", type=float, default=50.0, help="training time budget; 0 = schedule by --steps")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--lr-floor", type=float, default=0.1, help="final LR as a fraction of the peak")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--chat-frac", type=float, default=0.15)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--val-every", type=int, default=50, help="every Nth training document is validation")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--ckpt-every", type=int, default=50)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast (only worth it on CPUs with AVX512-BF16/AMX)")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--export-only", action="store_true", help="export the last checkpoint to --out and exit")
    ap.add_argument("--benchmark", type=int, default=0, help="time this many steps and exit")
    args = ap.parse_args()

    global AUTOCAST
    AUTOCAST = args.bf16
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    args.work.mkdir(parents=True, exist_ok=True)
    log_path = args.work / "train.log"

    def log(msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        with log_path.open("a") as fh:
            fh.write(line + "\n")

    docs = tiny_corpus.training_documents()
    tok = load_or_build_tokenizer(args.work, docs, args.vocab)
    data = encode_data(args.work, tok, args.val_every)
    del docs

    cfg = {
        "vocab_size": args.vocab,
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.hidden // args.heads,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
    }
    model = TinyLlama(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=False,
    )
    start_step, elapsed = 0, 0.0
    ckpt_path = args.work / "checkpoint.pt"
    if (args.resume or args.export_only) and ckpt_path.is_file():
        state = torch.load(ckpt_path, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start_step, elapsed = int(state["step"]), float(state["elapsed"])
        log(f"resumed from step {start_step} ({elapsed:.0f}s trained)")
    if args.export_only:
        export(model, tok, args.out)
        log(f"exported checkpoint step {start_step} to {args.out}")
        return
    fwd = torch.compile(model) if args.compile else model
    tokens_per_step = args.batch * args.seq
    log(
        f"params {n_params / 1e6:.2f}M, cfg {cfg}, batch {args.batch}x{args.seq}={tokens_per_step} tokens, "
        f"minutes {args.minutes}, step cap {args.steps}, threads {args.threads}, bf16 {args.bf16}, "
        f"lr {args.lr}, chat_frac {args.chat_frac}, compile {args.compile}"
    )

    def save_ckpt(step: int) -> None:
        tmp = ckpt_path.with_suffix(".tmp")
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step, "elapsed": elapsed}, tmp)
        os.replace(tmp, ckpt_path)

    model.train()
    last_steps = args.steps if not args.benchmark else start_step + args.benchmark
    t_log, loss_acc, n_acc = time.time(), 0.0, 0
    budget = args.minutes * 60.0
    step = start_step
    for step in range(start_step, last_steps):
        if budget > 0 and elapsed >= budget and not args.benchmark:
            save_ckpt(step)
            break
        t0 = time.time()
        progress = elapsed / budget if budget > 0 else step / args.steps
        lr = lr_at(step, progress, args.lr, args.warmup, args.lr_floor)
        for group in opt.param_groups:
            group["lr"] = lr
        batch = sample_batch(data, step, args.batch, args.seq, args.chat_frac, args.seed)
        loss = lm_loss(fwd, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        dt = time.time() - t0
        elapsed += dt
        loss_acc += loss.item()
        n_acc += 1
        if args.benchmark:
            log(f"bench step {step} loss {loss.item():.3f} {dt:.2f}s {tokens_per_step / dt:.0f} tok/s")
            continue
        if (step + 1) % args.log_every == 0:
            rate = tokens_per_step * n_acc / (time.time() - t_log)
            log(
                f"step {step + 1} loss {loss_acc / n_acc:.4f} lr {lr:.2e} gnorm {gnorm:.2f} "
                f"{rate:.0f} tok/s elapsed {elapsed / 60:.1f}min"
            )
            t_log, loss_acc, n_acc = time.time(), 0.0, 0
        if (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            log(f"step {step + 1} val loss {evaluate(model, data['val'], args.seq, args.batch, 64):.4f}")
        if (step + 1) % args.ckpt_every == 0 or step + 1 == args.steps:
            save_ckpt(step + 1)
    else:
        step += 1
    if args.benchmark:
        return
    steps_done = step
    log(f"training done: {steps_done} steps, {elapsed / 60:.1f} min")

    t0 = time.time()
    val = evaluate(model, data["val"], args.seq, args.batch, 10_000)
    train_eval = evaluate(model, data["train"][: 200 * args.seq + 1], args.seq, args.batch, 200)
    chat_eval = evaluate(model, data["chat"], args.seq, args.batch, 64)
    export(model, tok, args.out)
    metrics = {
        "steps": steps_done,
        "tokens_trained": steps_done * tokens_per_step,
        "train_seconds": round(elapsed, 1),
        "params": n_params,
        "val_loss": round(val, 4),
        "train_loss_eval_200_seqs": round(train_eval, 4),
        "chat_loss_eval_64_seqs": round(chat_eval, 4),
        "train_stream_tokens": int(len(data["train"])),
        "val_stream_tokens": int(len(data["val"])),
        "chat_stream_tokens": int(len(data["chat"])),
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    (args.work / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    log(f"final: {json.dumps(metrics)} (eval+export {time.time() - t0:.0f}s)")


if __name__ == "__main__":
    main()
