#!/usr/bin/env python3
"""train.py with aidn's Python client: the same model, data and DDP loop,
with aidn doing the bookkeeping.

- aidn.report() sends each rank's loss, samples, learning rate and step time
  (and the test-set results after each epoch) to the coordinator, so the job's
  metrics show in `aidnctl watch`, and its progress beats drive hang detection;
- rank 0 writes checkpoints with aidn.checkpoint(): a step directory with a
  manifest under the job's checkpoint.dir, committed to the coordinator's
  registry, old ones deleted by the job's keep_last;
- aidn.resume() names the newest committed checkpoint, verified, when aidn
  restarts the job (every rank loads it);
- aidn.should_checkpoint() says when the coordinator asks for a checkpoint
  to pause the job (aidnctl pause, a Slurm allocation near its time limit);
- aidn.should_stop() turns a cancel or a stop order (SIGTERM) into a clean
  end: every rank leaves the loop at the same step.

Run by hand it trains just the same (the aidn calls do nothing then):
    RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \
        /usr/bin/python3 train_aidn.py --epochs 1
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

import aidn
from train import DEFAULT_DATA, SmallCnn, all_reduce_sum, evaluate, load_split, weights_digest

CHECKPOINT_FILE = "checkpoint.pt"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data-dir", default=os.environ.get("FASHION_MNIST_DIR", DEFAULT_DATA),
                   help="directory of the four IDX files (env FASHION_MNIST_DIR)")
    p.add_argument("--epochs", type=int, default=1, help="epochs to train")
    p.add_argument("--max-steps", type=int, default=0,
                   help="stop after this many optimizer steps in all (0: no limit)")
    p.add_argument("--batch-size", type=int, default=64, help="samples per rank per step")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the shuffle")
    p.add_argument("--checkpoint-every", type=int, default=0,
                   help="checkpoint every this many steps (0: at the end of each epoch only)")
    p.add_argument("--log-every", type=int, default=100, help="log every this many steps")
    p.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads per rank (0: OMP_NUM_THREADS, else 1)")
    return p.parse_args(argv)


def any_rank(flag, device):
    """True on every rank when `flag` is true on any: all ranks must leave the
    loop at the same step, or the next allreduce waits forever."""
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def main(argv=None):
    args = parse_args(argv)
    use_cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    threads = args.threads or int(os.environ.get("OMP_NUM_THREADS", "1") or 1)
    torch.set_num_threads(max(1, threads))

    dist.init_process_group("nccl" if use_cuda else "gloo", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(args.seed)
    train_set = load_split(args.data_dir, "train")
    test_set = load_split(args.data_dir, "t10k")
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True,
                                 seed=args.seed, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    model = DDP(SmallCnn().to(device), device_ids=[local_rank] if use_cuda else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)

    steps_per_epoch = len(loader)
    total_steps = steps_per_epoch * args.epochs
    if args.max_steps > 0:
        total_steps = min(total_steps, args.max_steps)

    # The newest committed checkpoint, verified against its manifest; None on
    # a fresh start (or when it failed verification: aidn reported it).
    step = 0
    resumed = aidn.resume()
    if resumed is not None:
        state = torch.load(os.path.join(resumed.path, CHECKPOINT_FILE), map_location=device)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = int(state["step"])
    low, high = all_reduce_sum([-step, step], device)
    if -low != high:
        raise RuntimeError(f"ranks resumed from different steps ({-low} to {high})")
    if rank == 0:
        if resumed is not None:
            print(f"resumed from {resumed.path} at step {step}", flush=True)
        print(f"training: {world_size} ranks on {device.type}, {steps_per_epoch} steps per epoch, "
              f"{total_steps} steps, batch {args.batch_size} per rank", flush=True)

    def checkpoint(epoch):
        if rank == 0:
            with aidn.checkpoint(step) as path:
                torch.save({"model": model.module.state_dict(),
                            "optimizer": optimizer.state_dict(), "step": step, "epoch": epoch},
                           os.path.join(path, CHECKPOINT_FILE))
        dist.barrier()

    stopped = False
    window_start, window_loss, window_steps = time.perf_counter(), 0.0, 0
    while step < total_steps and not stopped:
        epoch = step // steps_per_epoch
        sampler.set_epoch(epoch)
        skip = step % steps_per_epoch  # batches a resumed run did already
        for i, (x, y) in enumerate(loader):
            if i < skip:
                continue
            started = time.perf_counter()
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            step += 1
            loss_value = loss.item()
            aidn.report(step, loss=loss_value, samples=len(y), epoch=epoch + 1,
                        total_steps=total_steps, lr=optimizer.param_groups[0]["lr"],
                        step_seconds=time.perf_counter() - started)
            window_loss += loss_value
            window_steps += 1
            if step % args.log_every == 0 or step == total_steps:
                loss_sum, = all_reduce_sum([window_loss], device)
                seconds = time.perf_counter() - window_start
                if rank == 0:
                    print(f"epoch {epoch + 1} step {step}/{total_steps} | "
                          f"loss {loss_sum / window_steps / world_size:.4f} | "
                          f"{1e3 * seconds / window_steps:.1f} ms | "
                          f"{window_steps * args.batch_size * world_size / seconds:.0f} samples/s",
                          flush=True)
                window_start, window_loss, window_steps = time.perf_counter(), 0.0, 0
            # True on every rank at the same step when the coordinator asks
            # for a checkpoint (aidnctl pause; Slurm's warning before the
            # time limit): the job stops once it is committed.
            asked = aidn.should_checkpoint(step)
            if asked or (args.checkpoint_every > 0 and step % args.checkpoint_every == 0):
                checkpoint(epoch + 1)
            if any_rank(aidn.should_stop(), device):
                stopped = True
                break
            if step == total_steps:
                break
        if stopped:
            break
        test_loss, accuracy = evaluate(model, test_set, rank, world_size, device)
        aidn.report(step, test_loss=test_loss, test_accuracy=accuracy, epoch=epoch + 1)
        if rank == 0:
            print(f"epoch {epoch + 1} step {step} | test_loss {test_loss:.4f} | "
                  f"test_accuracy {accuracy:.4f}", flush=True)
        if args.checkpoint_every <= 0 or step % args.checkpoint_every != 0:
            checkpoint(epoch + 1)

    if stopped and rank == 0:
        print(f"stopped at step {step}", flush=True)
    print(f"rank {rank}: done at step {step}, weights {weights_digest(model)}", flush=True)
    # os._exit skips interpreter exit, where aidn would flush: flush first.
    aidn.flush(30)
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    # Gloo processes can hang in exit handlers (pytorch#56297).
    os._exit(0)


if __name__ == "__main__":
    main()
