#!/usr/bin/python3
"""PyTorch peer for bench/gpt.sh: the GPT step of bench/gpt_step.cc in torch.

The same decoder as aidn's (worker/engine/gpt.h): learned position
embeddings, pre-LayerNorm blocks with explicit causal attention (torch 1.13
has no scaled_dot_product_attention) and a tanh-GELU MLP, tied LM head,
GPT-2's initialisation; AdamW (lr 1e-3, betas 0.9/0.95, decay 0.1 on
matrices and embeddings only) after clipping at 1.0. Random bytes as
tokens. Prints one line "RESULT {json}" with the fields gpt_step prints.

With --world N (N > 1) each of N processes is one rank of DistributedDataParallel
over gloo (MASTER_ADDR, MASTER_PORT and RANK from the environment; torch's
default 25 MB buckets), each with --batch sequences per step; rank 0 prints
the RESULT, its tokens/s counting every rank's tokens.

Run it with /usr/bin/python3 and
LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu/openblas-openmp (else torch runs
on Debian's reference BLAS).

With --device cuda (bench/gpu_gpt.sh) the step runs on the GPU, attention
through F.scaled_dot_product_attention (flash attention, causal) where the
torch has it, as nanoGPT does; --precision bf16 under torch.autocast, and
--compile through torch.compile. Each step ends with the loss read back.
"""

import argparse
import contextlib
import json
import math
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

CONFIGS = {
    "gpt2": (12, 12, 768, 1024, 50257),
    "gpt-char": (6, 6, 384, 256, 256),
    "gpt-mini": (4, 4, 128, 128, 256),
    "gpt-nano": (2, 2, 32, 32, 256),
}


class Block(nn.Module):
    def __init__(self, n_head, n_embd):
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(n_embd)
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.mlp_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x, mask):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        hd = c // self.n_head
        q, k, v = (z.view(b, t, self.n_head, hd).transpose(1, 2) for z in (q, k, v))
        if x.is_cuda and hasattr(F, "scaled_dot_product_attention"):
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
            att = F.softmax(att.masked_fill(~mask[:t, :t], float("-inf")), dim=-1)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        x = x + self.c_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class Gpt(nn.Module):
    def __init__(self, n_layer, n_head, n_embd, block, vocab):
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(block, n_embd)
        self.blocks = nn.ModuleList(Block(n_head, n_embd) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        # A plain attribute, not a buffer: DDP cannot broadcast bool tensors over gloo.
        self.mask = torch.tril(torch.ones(block, block, dtype=torch.bool))
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)
            elif "ln" not in name:
                nn.init.zeros_(p)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x, self.mask)
        return self.ln_f(x) @ self.wte.weight.t()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="gpt-char", choices=sorted(CONFIGS))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--compile", action="store_true")
    p.add_argument("--profile", action="store_true",
                   help="cudaProfilerStart/Stop around the timed steps (ncu --profile-from-start off)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(1)
    n_layer, n_head, n_embd, block, vocab = CONFIGS[args.config]
    device = torch.device(args.device)
    model = Gpt(n_layer, n_head, n_embd, block, vocab).to(device)
    model.mask = model.mask.to(device)
    params = list(model.parameters())
    autocast = (torch.autocast(device_type="cuda", dtype=torch.bfloat16)
                if args.precision == "bf16" else contextlib.nullcontext())
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rank = 0
    if args.world > 1:
        import os
        import torch.distributed as dist
        rank = int(os.environ["RANK"])
        dist.init_process_group("gloo", rank=rank, world_size=args.world)
        model = torch.nn.parallel.DistributedDataParallel(model)
        torch.manual_seed(100 + rank)  # each rank its own batches
    forward = torch.compile(model) if args.compile else model
    decay = [q for q in params if q.dim() >= 2]
    rest = [q for q in params if q.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": rest, "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.9, 0.95))
    n_params = sum(q.numel() for q in params)
    times = []
    window_start = time.perf_counter()
    cpu_start = time.process_time()
    for step in range(args.steps):
        if step == args.warmup:
            window_start = time.perf_counter()
            cpu_start = time.process_time()
            if args.profile:
                torch.cuda.profiler.start()
        x = torch.randint(0, vocab, (args.batch, args.seq), device=device)
        y = torch.randint(0, vocab, (args.batch, args.seq), device=device)
        sync()
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with autocast:
            logits = forward(x)
        loss = F.cross_entropy(logits.float().reshape(-1, vocab), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        final_loss = loss.item()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    wall = time.perf_counter() - window_start
    cpu = time.process_time() - cpu_start
    if args.profile:
        torch.cuda.profiler.stop()
    window = args.steps - args.warmup
    tokens_per_s = args.world * args.batch * args.seq * window / wall
    flops_per_token = 6 * n_params + 6 * n_layer * args.seq * n_embd
    print("RESULT " + json.dumps({
        "config": args.config, "threads": args.threads, "world": args.world,
        "device": args.device, "precision": args.precision, "compile": args.compile,
        "peak_gib": (torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0),
        "batch": args.batch, "seq": args.seq,
        "tokens_per_s": tokens_per_s, "median_step_ms": 1e3 * statistics.median(times),
        "model_gflops_per_s": flops_per_token * tokens_per_s / 1e9,
        "flops_per_token": flops_per_token,
        "cpu_s_per_step": cpu / window, "final_loss": final_loss, "parameters": n_params,
        "torch": torch.__version__}), flush=True)
    if args.world > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
