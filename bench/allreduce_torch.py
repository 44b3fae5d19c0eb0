#!/usr/bin/python3
"""torch.distributed allreduce (gloo backend) at the sizes bench/allreduce uses.

Run by bench/allreduce.sh: two processes launched directly with MASTER_ADDR,
MASTER_PORT, RANK and WORLD_SIZE (Debian's torchrun is broken on Python 3.11).
Rank 0 prints rows: size(B) count torch time(us) algbw busbw, time being the
median over rounds of each round's mean time per call.
"""
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist


def main():
    max_mb = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    min_seconds = float(sys.argv[3]) if len(sys.argv) > 3 else 0.2
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    buf = torch.ones((max_mb << 20) // 4, dtype=torch.float32)
    size = 4096
    while size <= (max_mb << 20):
        t = buf[: size // 4]

        def timed(iters):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                dist.all_reduce(t)
            return (time.perf_counter() - start) / iters

        probe = timed(2)
        iters = torch.tensor([min(100000, max(3, int(min_seconds / max(probe, 1e-7))))])
        dist.broadcast(iters, 0)
        times = [timed(int(iters.item())) for _ in range(rounds)]
        if rank == 0:
            med = statistics.median(times)
            algbw = size / med / 1e9
            busbw = algbw * 2 * (world - 1) / world
            print(f"{size:12d} {size // 4:12d} {'torch':<6s} {med * 1e6:12.1f} {algbw:12.3f} "
                  f"{busbw:12.3f}", flush=True)
        size *= 4
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
