"""GPU benchmark: nbdist's NCCL path beside torch.distributed (NCCL) on the same buffers, and
ResNet-18 training with nbdist's DistributedOptimizer beside DDP. One rank per GPU:

    mpiexec -n <GPUs> python benchmarks/gpu_nccl.py [--sizes 1M,64M,1G] [--json out.json]
    mpiexec -n 2 python benchmarks/gpu_nccl.py --cpu --sizes 1M --batch 2 --image 64   # smoke run, no GPU

allreduce (float32, sum, in place) on one buffer per size, measured in interleaved rounds:
  nbdist-raw  nbdist's NCCL transport called directly (TransportSet(...).nccl.allreduce)
  nbdist      through the runtime: nbdist.torch.allreduce_ (negotiation by the engine thread)
  torch       torch.distributed.all_reduce on a NCCL process group
Each nbdist op returns when the GPU has finished it (Horovod's semantics); torch's ops are
enqueued back to back and synchronized once per measurement (nccl-tests do the same).
Time per op is the slowest rank's mean; the figure is the median over rounds.
algbw = bytes / time; busbw = algbw × 2(n-1)/n (nccl-tests' allreduce formula). With one
rank busbw is 0 by that formula (nothing crosses a bus), so the ratios are of time per op.

ResNet-18 (torchvision's when installed, else the same architecture defined here) on
synthetic 224×224 images and labels, SGD, per-rank batch --batch: images/s of
nbdist.torch.DistributedOptimizer (+ broadcast_parameters) and of
torch.nn.parallel.DistributedDataParallel, phases alternating within each round; the ratio
is the median of per-round ratios. --cpu runs the same on CPU tensors (gloo, nbdist's
shared memory) to check the script where no GPU exists; its figures mean nothing for GPUs.
"""
from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

import nbdist.torch as hvd
from nbdist.common.config import Config
from nbdist.common.ops_base import ReduceOp
from nbdist.common.sizes import format_bytes, parse_bytes
from nbdist.common.topology import Topology
from peer_group import init_peer_group
from nbdist.common.transports.select import TransportSet

COMM = MPI.COMM_WORLD
IMPLS = ("nbdist-raw", "nbdist", "torch")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1M,64M,1G", help="allreduce sizes in bytes (K, M, G suffixes)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per size and phase")
    p.add_argument("--seconds", type=float, default=0.25, help="target time of one measurement")
    p.add_argument("--batch", type=int, default=64, help="ResNet-18 images per rank per step")
    p.add_argument("--image", type=int, default=224, help="image side in pixels")
    p.add_argument("--steps", type=int, default=10, help="timed training steps per phase and round")
    p.add_argument("--warmup", type=int, default=3, help="untimed training steps per phase first")
    p.add_argument("--no-resnet", action="store_true", help="collectives only")
    p.add_argument("--cpu", action="store_true", help="CPU tensors, gloo: a smoke run without a GPU")
    p.add_argument("--json", help="write every figure to this file")
    p.add_argument("--markdown", help="write the tables to this file")
    return p.parse_args(argv)


# -- ResNet-18 ------------------------------------------------------------------------------
class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.downsample is None else self.downsample(x)))


class ResNet18(nn.Module):
    """torchvision's resnet18 architecture (11.7 M parameters), for images without torchvision."""

    def __init__(self, num_classes: int = 1000):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        layers, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def resnet18(device) -> tuple[nn.Module, str]:
    torch.manual_seed(0)
    try:
        import torchvision

        return torchvision.models.resnet18(num_classes=1000).to(device), "torchvision"
    except ImportError:
        return ResNet18().to(device), "defined here (torchvision missing)"


# -- helpers --------------------------------------------------------------------------------
def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def slowest(seconds: float) -> float:
    return COMM.allreduce(seconds, op=MPI.MAX)


class Allreduces:
    """One allreduce of `buf` by each implementation."""

    def __init__(self, device):
        self.device = device
        self.topology = Topology.from_mpi(COMM)
        self.raw = TransportSet(Config.from_environment(), self.topology, lambda: None)
        self.kind = f"cuda:{device.index}" if device.type == "cuda" else "cpu"

    def transport(self) -> str:
        return self.raw.for_op(self.kind, "allreduce").name

    def run(self, impl: str, buf, iters: int) -> float:
        """Seconds per op (this rank), for iters ops back to back."""
        sync(self.device)
        COMM.Barrier()
        start = time.perf_counter()
        if impl == "nbdist-raw":
            t = self.raw.for_op(self.kind, "allreduce")
            flat = buf if self.device.type == "cuda" else buf.numpy()
            for _ in range(iters):
                t.allreduce(flat, ReduceOp.Sum)
        elif impl == "nbdist":
            for _ in range(iters):  # one name: after the first op the engine's cache answers
                hvd.allreduce_(buf, op=hvd.Sum, name="bench.allreduce")
        else:
            for _ in range(iters):
                dist.all_reduce(buf)
        sync(self.device)
        return (time.perf_counter() - start) / iters

    def close(self):
        self.raw.close()
        self.topology.free()


def bench_allreduce(args, device, size: int) -> list[dict]:
    ar = Allreduces(device)
    rows = []
    try:
        for nbytes in [parse_bytes(s) for s in args.sizes.split(",")]:
            buf = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
            iters = {}
            for impl in IMPLS:  # warm up (communicators, caches), then size the measurement
                ar.run(impl, buf, 2)
                once = slowest(ar.run(impl, buf, 1))
                iters[impl] = max(3, min(2000, int(args.seconds / max(once, 1e-7))))
            times = {impl: [] for impl in IMPLS}
            for _ in range(args.rounds):
                for impl in IMPLS:
                    times[impl].append(slowest(ar.run(impl, buf, iters[impl])))
            del buf
            if device.type == "cuda":
                torch.cuda.empty_cache()
            row = {"bytes": nbytes, "size": format_bytes(nbytes)}
            for impl in IMPLS:
                t = statistics.median(times[impl])
                algbw = nbytes / t / 1e9
                row[impl] = {"time_us": t * 1e6, "algbw_GBps": algbw,
                             "busbw_GBps": algbw * 2 * (size - 1) / size, "iters": iters[impl],
                             "rounds_us": [x * 1e6 for x in times[impl]]}
            for impl in ("nbdist-raw", "nbdist"):
                row[f"{impl}_time_vs_torch"] = row[impl]["time_us"] / row["torch"]["time_us"]
                if size > 1:
                    row[f"{impl}_busbw_vs_torch"] = row[impl]["busbw_GBps"] / row["torch"]["busbw_GBps"]
            rows.append(row)
        rows.append({"transport": ar.transport()})
    finally:
        ar.close()
    return rows


def train_steps(model, opt, x, y, steps: int, device) -> float:
    sync(device)
    COMM.Barrier()
    start = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    sync(device)
    return time.perf_counter() - start


def bench_resnet(args, device, size: int) -> dict:
    gen = torch.Generator().manual_seed(1 + COMM.rank)
    x = torch.randn(args.batch, 3, args.image, args.image, generator=gen).to(device)
    y = torch.randint(0, 1000, (args.batch,), generator=gen).to(device)

    nb_model, source = resnet18(device)
    nb_opt = hvd.DistributedOptimizer(torch.optim.SGD(nb_model.parameters(), lr=0.01, momentum=0.9),
                                      named_parameters=nb_model.named_parameters())
    hvd.broadcast_parameters(nb_model.state_dict(), root_rank=0)
    ddp_model = nn.parallel.DistributedDataParallel(
        resnet18(device)[0], device_ids=[device.index] if device.type == "cuda" else None)
    ddp_opt = torch.optim.SGD(ddp_model.parameters(), lr=0.01, momentum=0.9)
    phases = {"nbdist": (nb_model, nb_opt), "ddp": (ddp_model, ddp_opt)}
    for model, opt in phases.values():
        train_steps(model, opt, x, y, args.warmup, device)
    rates = {name: [] for name in phases}
    for _ in range(args.rounds):
        for name, (model, opt) in phases.items():
            wall = slowest(train_steps(model, opt, x, y, args.steps, device))
            rates[name].append(args.batch * size * args.steps / wall)
    paired = statistics.median(a / b for a, b in zip(rates["nbdist"], rates["ddp"]))
    return {"model": f"ResNet-18 ({source}), {sum(p.numel() for p in nb_model.parameters()) / 1e6:.1f} M "
                     f"parameters", "batch_per_rank": args.batch, "image": args.image, "steps": args.steps,
            "images_per_s": rates, "nbdist_images_per_s": statistics.median(rates["nbdist"]),
            "ddp_images_per_s": statistics.median(rates["ddp"]), "nbdist_over_ddp": paired}


def tables(meta: dict, rows: list[dict], resnet: dict | None) -> str:
    n = meta["ranks"]
    out = [(f"{n} rank(s) on {meta['device']}; NCCL {meta['nccl']}; torch {meta['torch']}; "
           f"nbdist transport for this buffer: {meta['transport']}"), ""]
    out.append("| allreduce | " + " | ".join(f"{i} time | {i} algbw | {i} busbw" for i in IMPLS)
               + " | raw time vs torch | engine time vs torch |"
               + (" raw busbw vs torch | engine busbw vs torch |" if n > 1 else ""))
    out.append("|---" * (1 + 3 * len(IMPLS) + (4 if n > 1 else 2)) + "|")
    for r in rows:
        cells = " | ".join(f"{r[i]['time_us']:.1f} µs | {r[i]['algbw_GBps']:.2f} | {r[i]['busbw_GBps']:.2f}"
                           for i in IMPLS)
        ratios = f"{r['nbdist-raw_time_vs_torch']:.2f}× | {r['nbdist_time_vs_torch']:.2f}×"
        if n > 1:
            ratios += f" | {r['nbdist-raw_busbw_vs_torch']:.2f}× | {r['nbdist_busbw_vs_torch']:.2f}×"
        out.append(f"| {r['size']} | {cells} | {ratios} |")
    out.append("")
    out.append("GB/s; busbw = algbw × 2(n-1)/n (nccl-tests)" + (" — 0 with one rank, so compare times"
                                                             if n == 1 else ""))
    if resnet:
        out += ["", (f"{resnet['model']}, {resnet['batch_per_rank']} images/rank/step at "
                    f"{resnet['image']}×{resnet['image']}, {resnet['steps']} steps × {meta['rounds']} rounds"), "",
                "| training | images/s (all ranks) | per round |", "|---|---|---|"]
        for name, label in (("nbdist", "nbdist DistributedOptimizer"), ("ddp", "torch DDP")):
            out.append(f"| {label} | {resnet[f'{name}_images_per_s']:.1f} | "
                       + ", ".join(f"{v:.0f}" for v in resnet["images_per_s"][name]) + " |")
        out.append(f"\nnbdist / DDP images/s: {resnet['nbdist_over_ddp']:.2f} (median of per-round ratios)")
    return "\n".join(out)


def main(argv=None) -> int:
    args = parse_args(argv)
    rank, size = COMM.rank, COMM.size
    if args.cpu:
        device = torch.device("cpu")
        torch.set_num_threads(1)
        backend = "gloo"
    else:
        if not torch.cuda.is_available():
            if rank == 0:
                print("no CUDA GPU visible to torch: nothing to measure (use --cpu for a smoke run)")
            return 2
        topology = Topology.from_mpi(COMM)
        device = torch.device("cuda", topology.local_rank % torch.cuda.device_count())
        topology.free()
        torch.cuda.set_device(device)
        backend = "nccl"
    hvd.init()
    init_peer_group(backend, rank, size, lambda value: COMM.bcast(value, root=0),
                    device_id=device if device.type == "cuda" else None)
    try:
        rows = bench_allreduce(args, device, size)
        transport = rows.pop()["transport"]
        resnet = None if args.no_resnet else bench_resnet(args, device, size)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        from nbdist import _native

        meta = {"ranks": size, "rounds": args.rounds, "transport": transport, "torch": torch.__version__,
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (smoke run)",
                "nccl": (".".join(map(str, torch.cuda.nccl.version())) + " (torch's); nbdist's "
                         + str(_native.nccl_version())) if device.type == "cuda" else "-",
                "host": socket.gethostname()}
        text = tables(meta, rows, resnet)
        print(text, flush=True)
        if args.markdown:
            with open(args.markdown, "w") as f:
                f.write(text + "\n")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"meta": meta, "allreduce": rows, "resnet18": resnet}, f, indent=2)
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
