#!/usr/bin/env python3
"""PyTorch's side of bench/gpu_step: the same model, optimizer, batch and
step as aidn's gpu_step (upload a batch from pageable host memory, zero the
gradients, forward, cross-entropy, backward, SGD lr 0.05 momentum 0.9, read
the loss back with .item()), eager mode, on the same device. Random inputs,
8 batches cycling; the first --warmup steps are left out. TF32 is off
unless --tf32 (aidn's default is fp32 math too). cudnn.benchmark is on
(aidn picks its convolution algorithms once per shape too); --deterministic
also sets cudnn.deterministic (aidn's default; gpu_step --fast-conv is the
other). Prints one RESULT line.

  gpu_step_torch.py --model mlp|cnn --batch 64 --steps 500 [--warmup 50] [--tf32]
                    [--deterministic] [--precision fp32|bf16|fp16] [--device cuda]
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def build_model(name):
    # The models of bench/torch_peer.py (torch's module indices, as aidn
    # names its parameters); the MLP takes images here, so it flattens first.
    import torch_peer
    model = torch_peer.build_model(name)
    return nn.Sequential(nn.Flatten(), *model) if name == "mlp" else model


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=["mlp", "cnn"], default="mlp")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--tf32", action="store_true")
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32",
                   help="bf16/fp16: autocast for forward and loss (fp16 with a GradScaler)")
    p.add_argument("--profile", action="store_true",
                   help="cudaProfilerStart/Stop around the timed steps (ncu --profile-from-start off)")
    p.add_argument("--device", default="cuda")
    a = p.parse_args()

    torch.backends.cuda.matmul.allow_tf32 = a.tf32
    torch.backends.cudnn.allow_tf32 = a.tf32
    torch.backends.cudnn.benchmark = True  # aidn picks its conv algorithms once per shape too
    torch.backends.cudnn.deterministic = a.deterministic
    device = torch.device(a.device)
    torch.manual_seed(1)
    model = build_model(a.model).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    half = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[a.precision]
    scaler = torch.amp.GradScaler(device.type) if a.precision == "fp16" else None

    g = torch.Generator().manual_seed(7)
    images = [torch.rand(a.batch, 1, 28, 28, generator=g) * 2 - 1 for _ in range(8)]
    labels = [torch.randint(0, 10, (a.batch,), generator=g) for _ in range(8)]

    times = []
    loss_value = 0.0
    window_start = time.perf_counter()
    for step in range(a.warmup + a.steps):
        if step == a.warmup:
            if a.profile:
                torch.cuda.profiler.start()
            window_start = time.perf_counter()
        start = time.perf_counter()
        b = step % 8
        x = images[b].to(device)
        y = labels[b].to(device)
        opt.zero_grad(set_to_none=False)  # aidn zeroes its gradients too
        with torch.autocast(device.type, dtype=half, enabled=half is not None):
            loss = F.cross_entropy(model(x), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        loss_value = loss.item()
        if step >= a.warmup:
            times.append(time.perf_counter() - start)
    window = time.perf_counter() - window_start
    if a.profile:
        torch.cuda.profiler.stop()
    times.sort()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print("RESULT " + json.dumps({
        "impl": "torch", "model": a.model, "batch": a.batch, "steps": a.steps,
        "samples_per_s": round(a.batch * a.steps / window, 1),
        "median_step_ms": round(times[len(times) // 2] * 1e3, 4),
        "final_loss": loss_value, "tf32": a.tf32,
        "conv": "deterministic" if a.deterministic else "fast", "precision": a.precision,
        "device": name,
        "torch": torch.__version__, "cudnn": torch.backends.cudnn.version()}))


if __name__ == "__main__":
    main()
