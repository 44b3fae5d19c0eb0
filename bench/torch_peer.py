#!/usr/bin/python3
"""PyTorch peer for bench/train.sh: the same training step as aidn's.

Trains the MLP (784-256-256-10), the small CNN or ResNet-18 (torchvision's, with a
3x3 stem and no max pool, as aidn's) on Fashion-MNIST with SGD
(lr 0.05, momentum 0.9), batch 64 per rank, and times the steady-state steps.
One rank runs as a plain process; more ranks run DDP over gloo, each rank
launched as its own process with MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK
set (Debian's torchrun is broken on Python 3.11).

Timing: a timestamp after every optimizer step (each step gathers its batch,
zeroes the gradients, runs forward, loss, backward with DDP's allreduce, and
the SGD update). The first --warmup-frac of the steps are left out; the
throughput is global samples (batch x world) x steps in the window divided by
the wall time of the window, as seen by rank 0 (DDP steps are lock-stepped by
the allreduce). The whole epoch's shuffle is drawn before the clock starts.

Rank 0 prints one line "RESULT {json}" with samples_per_s (global),
median_step_ms, the window, and the BLAS library and conv backend in use; for
start-up, the Unix times the script started and its first step ended, and the
seconds init_process_group took.

Run it with /usr/bin/python3 and, for a fair comparison,
LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu/openblas-openmp (else torch runs on
Debian's reference BLAS).
"""

import time

STARTED_UNIX = time.time()  # the interpreter reached this script (start-up phases)

import argparse  # noqa: E402 (after the clock above)
import gzip
import json
import os
import statistics
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

MEAN = 0.2860
STD = 0.3530


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=["mlp", "cnn", "resnet18", "resnet50"], required=True)
    p.add_argument("--world", type=int, default=1, help="number of ranks (WORLD_SIZE)")
    p.add_argument("--steps", type=int, required=True, help="optimizer steps to run")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--warmup-frac", type=float, default=0.1,
                   help="fraction of the steps left out of the timing")
    p.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    return p.parse_args()


def read_idx(path, header_bytes):
    with gzip.open(path, "rb") as f:
        raw = f.read()
    return np.frombuffer(raw, dtype=np.uint8, offset=header_bytes)


def load_train(data_dir, model):
    images = read_idx(os.path.join(data_dir, "train-images-idx3-ubyte.gz"), 16)
    labels = read_idx(os.path.join(data_dir, "train-labels-idx1-ubyte.gz"), 8)
    n = labels.shape[0]
    x = torch.from_numpy(images.astype(np.float32).reshape(n, 784))
    x = (x / 255.0 - MEAN) / STD
    if model != "mlp":
        x = x.reshape(n, 1, 28, 28)
    return x.contiguous(), torch.from_numpy(labels.astype(np.int64))


def build_model(name):
    if name in ("resnet18", "resnet50"):
        # torchvision's, with aidn's small-image stem (3x3 conv1, no max pool).
        import torchvision
        model = getattr(torchvision.models, name)(num_classes=10)
        model.conv1 = nn.Conv2d(1, 64, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
        return model
    if name == "mlp":
        return nn.Sequential(
            nn.Linear(784, 256), nn.ReLU(),
            nn.Linear(256, 256), nn.ReLU(),
            nn.Linear(256, 10))
    return nn.Sequential(
        nn.Conv2d(1, 32, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(1600, 128), nn.ReLU(),
        nn.Linear(128, 10))


def step_indices(n, world, rank, batch, steps, seed):
    """Per-step index tensors for this rank: a fresh shuffle per epoch, each
    rank taking every world-th sample (DistributedSampler-like), whole batches
    only."""
    out = []
    epoch = 0
    while len(out) < steps:
        g = torch.Generator().manual_seed(seed + epoch)
        mine = torch.randperm(n, generator=g)[rank::world]
        for b in range(mine.numel() // batch):
            out.append(mine[b * batch:(b + 1) * batch].contiguous())
            if len(out) == steps:
                break
        epoch += 1
    return out


def blas_in_use():
    """The BLAS/LAPACK/OpenMP libraries mapped into this process, resolved."""
    libs = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            base = os.path.basename(path)
            if "blas" in base or "lapack" in base:
                libs.add(os.path.realpath(path))
    return sorted(libs)


def conv_backend():
    try:
        x = torch.zeros(64, 32, 13, 13)
        w = torch.zeros(64, 32, 3, 3)
        b = torch.zeros(64)
        return str(torch._C._select_conv_backend(
            x, w, b, [1, 1], [0, 0], [1, 1], False, [0, 0], 1)).split(".")[-1]
    except Exception:  # private API; only informative
        return "unknown"


def main():
    args = parse_args()
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", str(args.world)))
    if world != args.world:
        sys.exit(f"WORLD_SIZE={world} but --world={args.world}")

    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    torch.manual_seed(args.seed)

    x, y = load_train(args.data, args.model)
    batches = step_indices(x.shape[0], world, rank, args.batch, args.steps, args.seed)

    model = build_model(args.model)
    init_s = 0.0
    if world > 1:
        init_start = time.perf_counter()
        dist.init_process_group("gloo", init_method="env://", world_size=world, rank=rank)
        init_s = time.perf_counter() - init_start
        model = nn.parallel.DistributedDataParallel(model)  # bucket_cap_mb 25, as aidn
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    model.train()

    stamps = [0.0] * (args.steps + 1)
    first_step_unix = None
    last_loss = None
    stamps[0] = time.perf_counter()
    for step in range(args.steps):
        idx = batches[step]
        xb = x.index_select(0, idx)
        yb = y.index_select(0, idx)
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step()
        stamps[step + 1] = time.perf_counter()
        if step == 0:
            first_step_unix = time.time()  # for bench/startup.sh
        last_loss = loss
    final_loss = float(last_loss.detach())

    warm = min(args.steps - 1, max(1, round(args.warmup_frac * args.steps)))
    window = args.steps - warm
    wall = stamps[args.steps] - stamps[warm]
    intervals = [stamps[k] - stamps[k - 1] for k in range(warm + 1, args.steps + 1)]
    global_batch = args.batch * world
    if rank == 0:
        result = {
            "model": args.model,
            "world": world,
            "threads": args.threads,
            "steps": args.steps,
            "window_steps": window,
            "window_s": wall,
            "samples_per_s": global_batch * window / wall,
            "median_step_ms": statistics.median(intervals) * 1e3,
            "median_samples_per_s": global_batch / statistics.median(intervals),
            "final_loss": final_loss,
            "first_step_unix": first_step_unix,
            "started_unix": STARTED_UNIX,
            "init_process_group_s": init_s,
            "torch": torch.__version__,
            "blas": blas_in_use(),
            "conv_backend": conv_backend(),
        }
        print("RESULT " + json.dumps(result), flush=True)
    if world > 1:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # DDP/gloo processes can hang at interpreter exit (pytorch#56297)


if __name__ == "__main__":
    main()
