"""Training throughput on CPU: nbdist.torch's DistributedOptimizer beside PyTorch DDP (gloo).

Run on 2 ranks (one mpiexec run measures everything, in alternating rounds):

    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/torch_ddp.py [--json out.json]

Per round: (1) one rank alone, plain PyTorch, on one rank's batch (the 1-rank baseline),
(2) every rank with nbdist's DistributedOptimizer, (3) every rank with
torch.nn.parallel.DistributedDataParallel over gloo (MASTER_ADDR=127.0.0.1, a free port),
(4) every rank alone at once, plain PyTorch with no communication (the ceiling: what
any data-parallel library could reach on this machine, with communication free; two
ranks computing at once share the cores' caches and memory bandwidth),
(5) the same with an MPI barrier after each step's backward (mpi4py, MPICH): the ranks
wait for each other once a step, as synchronous data-parallel training must, and move
no bytes. What separates (4) from (5) is the cost of waiting each step for the slowest
rank (its compute varies from step to step), which no library can avoid; what separates
(5) from nbdist is nbdist's own cost,
(6) with --per-gradient, nbdist again with bucket_bytes=0 (one allreduce per gradient).
Same model, per-rank batch, synthetic data and SGD in every phase; each rank uses
torch.set_num_threads(1), so 2 ranks on 2 cores compare fairly with 1 rank on 1 core.
Reported: samples/s (global), rank 0's CPU milliseconds per step (all its threads),
scaling efficiency = samples/s / (ranks x 1-rank samples/s),
nbdist / DDP (the median of per-round ratios: the phases of a round run back to
back, which cancels most of the drift from other load on a shared machine), and the
ceiling of that ratio: no-communication / DDP.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import nbdist.torch as hvd
from peer_group import init_peer_group


class ResidualBlock(nn.Module):
    """conv-BN-ReLU-conv-BN plus the input (a 1x1 conv-BN when the shape changes), then ReLU."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip = (nn.Identity() if stride == 1 and cin == cout else
                     nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False),
                                   nn.BatchNorm2d(cout)))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.skip(x))


def make_model(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "resnet":  # a small ResNet for 32x32 images: many small gradients (~40 tensors)
        return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                             ResidualBlock(16, 16), ResidualBlock(16, 32, 2), ResidualBlock(32, 32),
                             ResidualBlock(32, 64, 2), ResidualBlock(64, 64),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))
    if kind == "mlp":
        return nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                             nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 10))
    if kind == "cnn":
        return nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Flatten(), nn.Linear(64 * 8 * 8, 256), nn.ReLU(), nn.Linear(256, 10))
    raise ValueError(f"unknown model {kind!r}")


def make_batch(kind: str, batch: int):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 512, generator=g) if kind == "mlp" else torch.randn(batch, 3, 32, 32, generator=g)
    return x, torch.randint(0, 10, (batch,), generator=g)


def run_steps(model, opt, x, y, steps: int, after_backward=None) -> float:
    """Seconds for `steps` training steps (forward, backward, [after_backward()], step)."""
    start = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if after_backward is not None:
            after_backward()
        opt.step()
    return time.perf_counter() - start


def cpu_seconds() -> float:
    """CPU time of this process (all its threads: the runtime's too)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def timed_distributed(fn, steps: int) -> tuple[float, float]:
    """The slowest rank's wall time for fn(steps), and rank 0's CPU time, between barriers."""
    hvd.barrier()
    cpu = cpu_seconds()
    elapsed = fn(steps)
    cpu = cpu_seconds() - cpu
    hvd.barrier()
    return max(hvd.allgather_object(elapsed)), cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["mlp", "cnn", "resnet"], default="mlp")
    parser.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per phase and round")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--per-gradient", action="store_true",
                        help="also run nbdist with bucket_bytes=0 (one allreduce per gradient)")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()

    torch.set_num_threads(1)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    x, y = make_batch(args.model, args.batch)
    params = sum(p.numel() for p in make_model(args.model).parameters())

    # nbdist: DistributedOptimizer, gradients averaged while backward runs
    nb_model = make_model(args.model)
    nb_opt = hvd.DistributedOptimizer(torch.optim.SGD(nb_model.parameters(), lr=0.01),
                                      named_parameters=nb_model.named_parameters())
    hvd.broadcast_parameters(nb_model.state_dict(), root_rank=0)
    pg_model = make_model(args.model)  # the same without buckets (--per-gradient)
    pg_opt = hvd.DistributedOptimizer(torch.optim.SGD(pg_model.parameters(), lr=0.01),
                                      named_parameters=pg_model.named_parameters(),
                                      bucket_bytes=0)

    # DDP over gloo, rendezvous on this machine
    init_peer_group("gloo", rank, size, lambda value: hvd.broadcast_object(value, 0))
    ddp_model = nn.parallel.DistributedDataParallel(make_model(args.model))
    ddp_opt = torch.optim.SGD(ddp_model.parameters(), lr=0.01)

    single_model = make_model(args.model)
    single_opt = torch.optim.SGD(single_model.parameters(), lr=0.01)

    def single(steps):  # rank 0 alone; the others wait at the barrier (idle, no CPU)
        return run_steps(single_model, single_opt, x, y, steps) if rank == 0 else 0.0

    apart_model = make_model(args.model)  # each rank's own, never averaged (the ceiling)
    apart_opt = torch.optim.SGD(apart_model.parameters(), lr=0.01)
    from mpi4py import MPI  # the barrier-per-step phase: MPICH's, a few µs on one node
    barrier = MPI.COMM_WORLD.Barrier

    phases = {
        "1 rank (plain torch)": (single, args.batch),
        f"nbdist DistributedOptimizer ({size} ranks)": (
            lambda s: run_steps(nb_model, nb_opt, x, y, s), args.batch * size),
        f"torch DDP gloo ({size} ranks)": (
            lambda s: run_steps(ddp_model, ddp_opt, x, y, s), args.batch * size),
        f"no communication ({size} ranks at once)": (
            lambda s: run_steps(apart_model, apart_opt, x, y, s), args.batch * size),
        f"a barrier per step, no bytes ({size} ranks)": (
            lambda s: run_steps(apart_model, apart_opt, x, y, s, barrier), args.batch * size),
    }
    if args.per_gradient:
        phases[f"nbdist, no buckets ({size} ranks)"] = (
            lambda s: run_steps(pg_model, pg_opt, x, y, s), args.batch * size)
    rates = {name: [] for name in phases}
    cpu_ms = {name: [] for name in phases}  # rank 0's CPU per step: compute + communication
    for fn, _ in phases.values():
        timed_distributed(fn, args.warmup)
    for _ in range(args.rounds):
        for name, (fn, samples) in phases.items():
            wall, cpu = timed_distributed(fn, args.steps)
            rates[name].append(samples * args.steps / wall)
            cpu_ms[name].append(1e3 * cpu / args.steps)
    torch.distributed.destroy_process_group()

    if rank == 0:
        names = list(phases)
        base = statistics.median(rates[names[0]])
        nb = statistics.median(rates[names[1]])
        ddp = statistics.median(rates[names[2]])
        print(f"model {args.model} ({params / 1e6:.2f} M parameters), batch {args.batch}/rank, "
              f"{args.steps} steps x {args.rounds} rounds, torch {torch.__version__}, "
              f"1 thread per rank")
        print(f"{'phase':42s} {'samples/s':>10s} {'efficiency':>10s} {'cpu ms/step':>12s}   rounds")
        for name in names:
            med = statistics.median(rates[name])
            eff = med / (base * (size if name != names[0] else 1))
            print(f"{name:42s} {med:10.1f} {eff:10.2f} {statistics.median(cpu_ms[name]):12.1f}   "
                  + " ".join(f"{r:.0f}" for r in rates[name]))
        # Each round runs the phases back to back, so the per-round ratio is the figure
        # least disturbed by other load on the machine.
        paired = statistics.median(a / b for a, b in zip(rates[names[1]], rates[names[2]]))
        print(f"nbdist / DDP throughput: {paired:.2f} (median of per-round ratios; "
              f"ratio of medians {nb / ddp:.2f})")
        ceiling = statistics.median(a / b for a, b in zip(rates[names[3]], rates[names[2]]))
        print(f"ceiling of that ratio, no communication / DDP: {ceiling:.2f} (nbdist reaches "
              f"{statistics.median(a / b for a, b in zip(rates[names[1]], rates[names[3]])):.2f} "
              "of the no-communication throughput)")
        synced = statistics.median(a / b for a, b in zip(rates[names[4]], rates[names[2]]))
        print(f"ceiling with the ranks in step, a barrier per step / DDP: {synced:.2f} (nbdist "
              f"reaches {statistics.median(a / b for a, b in zip(rates[names[1]], rates[names[4]])):.2f}"
              " of it)")
        if args.per_gradient:
            unbucketed = statistics.median(
                a / b for a, b in zip(rates[names[5]], rates[names[2]]))
            print(f"nbdist without buckets / DDP throughput: {unbucketed:.2f} "
                  "(median of per-round ratios)")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"model": args.model, "parameters": params, "batch_per_rank": args.batch,
                           "ranks": size, "steps": args.steps, "rounds": args.rounds,
                           "samples_per_s": {n: rates[n] for n in names},
                           "rank0_cpu_ms_per_step": {n: cpu_ms[n] for n in names},
                           "nbdist_over_ddp_paired": paired, "nbdist_over_ddp": nb / ddp,
                           "ceiling_over_ddp_paired": ceiling,
                           "barrier_ceiling_over_ddp_paired": synced,
                           "efficiency": {"nbdist": nb / (size * base), "ddp": ddp / (size * base)}},
                          f, indent=2)
    hvd.shutdown()


if __name__ == "__main__":
    main()
