"""Where a DistributedOptimizer step's time goes: forward+backward, synchronize, step.

    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/torch_step_parts.py [--model mlp] [--steps 100]

The model, batch and loss of benchmarks/torch_ddp.py, trained with nbdist.torch's
DistributedOptimizer (default buckets). Each step is split in three, timed on rank 0:
forward and backward (the gradient hooks submit the buckets' allreduces as they fill),
`optimizer.synchronize()` (waiting for the allreduces that are still running or not yet
run), and `optimizer.step()` under `skip_synchronize()`. Run it twice with an
environment variable changed (e.g. NBDIST_SHM_CMA_ALLREDUCE_BYTES=0: the slots, no
single copy) to see which part a transport setting moves. Reported per round: ms per
step, rank 0's wall clock.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch_ddp import make_batch, make_model

import nbdist.torch as hvd


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=["mlp", "cnn", "resnet"], default="mlp")
    p.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    p.add_argument("--steps", type=int, default=100, help="steps per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=10)
    args = p.parse_args(argv)

    hvd.init()
    torch.set_num_threads(1)
    model = make_model(args.model)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    x, y = make_batch(args.model, args.batch)

    def step(parts: list[float]) -> None:
        t0 = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        t1 = time.perf_counter()
        opt.synchronize()
        t2 = time.perf_counter()
        with opt.skip_synchronize():
            opt.step()
        t3 = time.perf_counter()
        parts[0] += t1 - t0
        parts[1] += t2 - t1
        parts[2] += t3 - t2

    for _ in range(args.warmup):
        step([0.0, 0.0, 0.0])
    if hvd.rank() == 0:
        print(f"torch_step_parts: {hvd.size()} ranks, {args.model}, batch {args.batch}/rank; "
              "ms per step (rank 0)")
        print(f"{'round':>5} {'total':>8} {'fwd+bwd':>8} {'synchronize':>12} {'step':>8}")
    for r in range(args.rounds):
        hvd.barrier()
        parts = [0.0, 0.0, 0.0]
        for _ in range(args.steps):
            step(parts)
        if hvd.rank() == 0:
            ms = [t / args.steps * 1e3 for t in parts]
            print(f"{r:>5} {sum(ms):8.2f} {ms[0]:8.2f} {ms[1]:12.2f} {ms[2]:8.2f}", flush=True)
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
