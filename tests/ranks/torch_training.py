"""DistributedOptimizer, broadcast helpers and SyncBatchNorm on N ranks.

The reference for training is one process that sees the whole global batch (every
rank's shard concatenated): N ranks averaging gradients of their shards' mean loss
must end with the same parameters.
"""
import dataclasses
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nbdist.common
import nbdist.torch as hvd

from _torch_setup import N, R, runtime  # noqa: F401 (the autouse fixture starts nbdist)

B = 3  # rows per rank per micro-batch


def make_model(seed=0, bias=True):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6, bias=bias), nn.Tanh(), nn.Linear(6, 2, bias=bias)).double()


def global_batch(step, micro):
    g = torch.Generator().manual_seed(100 * step + micro)
    return (torch.randn(N() * B, 4, generator=g, dtype=torch.float64),
            torch.randn(N() * B, 2, generator=g, dtype=torch.float64))


def shard(t):
    return t[R() * B:(R() + 1) * B]


def train(model, opt, steps, bpps, distributed, closure_style=False, clip=None):
    for step in range(steps):
        if closure_style:
            x, y = global_batch(step, 0)
            if distributed:
                x, y = shard(x), shard(y)

            def closure():
                opt.zero_grad()
                loss = F.mse_loss(model(x), y)  # noqa: B023  (called within this iteration)
                loss.backward()
                # every rank must see the same loss (LBFGS decides on it): average it
                return hvd.allreduce(loss.detach()) if distributed else loss

            opt.step(closure)
            continue
        for micro in range(bpps):
            x, y = global_batch(step, micro)
            if distributed:
                x, y = shard(x), shard(y)
            (F.mse_loss(model(x), y) / bpps).backward()
        if clip is not None:
            if distributed:
                opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            if distributed:
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()
        else:
            opt.step()
        opt.zero_grad()
    return model


def assert_same_params(a, b, atol=1e-9):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(p, q, atol=atol, rtol=0), (name, (p - q).abs().max().item())


def assert_equal_across_ranks(model):
    for name, p in model.named_parameters():
        root = hvd.broadcast(p.detach(), 0)
        assert torch.allclose(p.detach(), root, atol=1e-12, rtol=0), f"{name} differs from rank 0"


def reference_and_distributed(factory, steps=3, bpps=1, closure_style=False, clip=None,
                              bias=True, **dist_kwargs):
    ref = make_model(bias=bias)
    train(ref, factory(ref.parameters()), steps, bpps, False, closure_style, clip)
    model = make_model(bias=bias)
    opt = hvd.DistributedOptimizer(factory(model.parameters()),
                                   named_parameters=model.named_parameters(),
                                   backward_passes_per_step=bpps, **dist_kwargs)
    train(model, opt, steps, bpps, True, closure_style, clip)
    return ref, model, opt


OPTIMIZERS = {
    "SGD": lambda p: torch.optim.SGD(p, lr=0.1),
    "SGD-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01),
    "Adam": lambda p: torch.optim.Adam(p, lr=0.05),
    "AdamW": lambda p: torch.optim.AdamW(p, lr=0.05),
    "Adadelta": lambda p: torch.optim.Adadelta(p, lr=1.0),
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
    "Adamax": lambda p: torch.optim.Adamax(p, lr=0.05),
    "ASGD": lambda p: torch.optim.ASGD(p, lr=0.05),
    "NAdam": lambda p: torch.optim.NAdam(p, lr=0.05),
    "RAdam": lambda p: torch.optim.RAdam(p, lr=0.05),
    "RMSprop": lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5),
    "Rprop": lambda p: torch.optim.Rprop(p, lr=0.01),
}
if hasattr(torch.optim, "Adafactor"):
    OPTIMIZERS["Adafactor"] = lambda p: torch.optim.Adafactor(p, lr=0.05)


@pytest.mark.parametrize("bpps", [1, 2])
@pytest.mark.parametrize("name", ["SGD-momentum", "Adam"])
def test_same_parameters_as_one_process_on_the_whole_batch(name, bpps):
    ref, model, _ = reference_and_distributed(OPTIMIZERS[name], bpps=bpps)
    assert_same_params(model, ref)
    assert_equal_across_ranks(model)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_torch_optimizer(name):
    ref, model, opt = reference_and_distributed(OPTIMIZERS[name], steps=2)
    assert isinstance(opt, type(OPTIMIZERS[name]([torch.zeros(1, requires_grad=True)])))
    assert_same_params(model, ref, atol=1e-7)


def test_lbfgs_with_closure():
    factory = lambda p: torch.optim.LBFGS(p, lr=0.5, max_iter=4)  # noqa: E731
    ref, model, _ = reference_and_distributed(factory, steps=2, closure_style=True)
    assert_same_params(model, ref, atol=1e-7)


def test_muon_on_matrices():
    if not hasattr(torch.optim, "Muon"):
        pytest.skip("torch.optim.Muon needs torch >= 2.9")
    factory = lambda p: torch.optim.Muon(p, lr=0.02)  # noqa: E731
    ref, model, _ = reference_and_distributed(factory, steps=2, bias=False)
    assert_same_params(model, ref, atol=1e-7)


def test_sparse_gradients_sparse_adam():
    def run(distributed):
        torch.manual_seed(0)
        emb = nn.Embedding(10, 3, sparse=True).double()
        opt = torch.optim.SparseAdam(emb.parameters(), lr=0.1)
        if distributed:
            opt = hvd.DistributedOptimizer(opt, named_parameters=emb.named_parameters())
        for step in range(2):
            g = torch.Generator().manual_seed(step)
            idx = torch.randint(0, 10, (N() * B,), generator=g)
            target = torch.randn(N() * B, 3, generator=g, dtype=torch.float64)
            if distributed:
                idx, target = shard(idx), shard(target)
            F.mse_loss(emb(idx), target).backward()
            opt.step()
            opt.zero_grad()
        return emb
    assert torch.allclose(run(True).weight, run(False).weight, atol=1e-9)


def test_sparse_as_dense():
    torch.manual_seed(0)
    emb = nn.Embedding(6, 2, sparse=True).double()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1),
                                   named_parameters=emb.named_parameters(), sparse_as_dense=True)
    emb(torch.tensor([R() % 6])).sum().backward()
    opt.step()
    assert emb.weight.grad.is_sparse  # reduced dense, handed back sparse (Horovod)
    assert_equal_across_ranks(emb)


@pytest.mark.parametrize("variant", ["groups=2", "groups=list", "predivide", "unnamed", "Sum"])
def test_optimizer_options(variant):
    factory = OPTIMIZERS["SGD-momentum"]
    if variant == "groups=2":
        ref, model, _ = reference_and_distributed(factory, groups=2)
    elif variant == "groups=list":
        ref = make_model()
        train(ref, factory(ref.parameters()), 3, 1, False)
        model = make_model()
        params = list(model.parameters())
        opt = hvd.DistributedOptimizer(factory(model.parameters()),
                                       named_parameters=model.named_parameters(),
                                       groups=[[params[0], params[2]], [params[3]]])
        train(model, opt, 3, 1, True)
    elif variant == "predivide":
        ref, model, _ = reference_and_distributed(factory, gradient_predivide_factor=2.0)
    elif variant == "unnamed":
        ref = make_model()
        train(ref, factory(ref.parameters()), 3, 1, False)
        model = make_model()
        train(model, hvd.DistributedOptimizer(factory(model.parameters())), 3, 1, True)
    else:  # op=Sum: summed gradients of mean losses == the whole batch's mean loss times N
        ref = make_model()
        ref_opt = factory(ref.parameters())
        for step in range(3):
            x, y = global_batch(step, 0)
            (F.mse_loss(ref(x), y) * N()).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        model = make_model()
        train(model, hvd.DistributedOptimizer(factory(model.parameters()),
                                              named_parameters=model.named_parameters(),
                                              op=hvd.Sum), 3, 1, True)
    assert_same_params(model, ref)


def test_fp16_compression_training():
    ref, model, _ = reference_and_distributed(OPTIMIZERS["SGD"], compression=hvd.Compression.fp16)
    assert_same_params(model, ref, atol=2e-3)
    assert_equal_across_ranks(model)


def test_clipping_with_skip_synchronize():
    ref, model, _ = reference_and_distributed(OPTIMIZERS["SGD"], clip=0.05)
    assert_same_params(model, ref)


def test_step_after_synchronize_without_skip_warns():
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    x, y = global_batch(0, 0)
    F.mse_loss(model(shard(x)), shard(y)).backward()
    opt.synchronize()
    with pytest.warns(UserWarning, match="skip_synchronize"):
        opt.step()
    opt.zero_grad()
    F.mse_loss(model(shard(x)), shard(y)).backward()
    opt.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with opt.skip_synchronize():
            opt.step()


def test_grad_scaler_unscale():
    try:
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"GradScaler on CPU is not available: {exc}")
    model = make_model().float()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    ref = make_model().float()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x, y = global_batch(0, 0)
    scaler.scale(F.mse_loss(model(shard(x).float()), shard(y).float())).backward()
    opt.synchronize()
    scaler.unscale_(opt)  # the averaged gradients, unscaled
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    with opt.skip_synchronize():
        scaler.step(opt)
    scaler.update()
    F.mse_loss(ref(x.float()), y.float()).backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    ref_opt.step()
    assert_same_params(model, ref, atol=1e-6)


def test_zero_grad_while_reductions_in_flight_is_an_error():
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    x, y = global_batch(0, 0)
    F.mse_loss(model(shard(x)), shard(y)).backward()
    with pytest.raises(AssertionError, match="zero_grad"):
        opt.zero_grad()
    opt.step()
    opt.zero_grad()
    assert_equal_across_ranks(model)


def test_too_many_backward_passes_is_an_error():
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    x, y = global_batch(0, 0)
    F.mse_loss(model(shard(x)), shard(y)).backward()
    with pytest.raises(AssertionError, match="backward_passes_per_step"):
        F.mse_loss(model(shard(x)), shard(y)).backward()
    opt.step()  # the first pass's reductions still complete
    opt.zero_grad()


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 2).double()
        self.b = nn.Linear(4, 2).double()
        self.frozen = nn.Linear(4, 2).double().requires_grad_(False)

    def forward(self, x, use_b):
        out = self.a(x) + self.frozen(x)
        return out + self.b(x) if use_b else out


@pytest.mark.parametrize("who_uses_b", ["rank0", "nobody"])
def test_unused_parameters_do_not_hang(who_uses_b):
    model = Branchy()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    x, y = global_batch(0, 0)
    use_b = who_uses_b == "rank0" and R() == 0
    for _ in range(2):
        F.mse_loss(model(shard(x), use_b), shard(y)).backward()
        opt.step()
        if who_uses_b == "nobody":
            assert torch.all(model.b.weight.grad == 0)
        opt.zero_grad()
    assert_equal_across_ranks(model)


def test_named_parameters_validation():
    model = make_model()
    params = list(model.named_parameters())
    with pytest.raises(ValueError, match="unique"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=[("same", p) for _, p in params])
    with pytest.raises(ValueError, match="not named"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=params[:1])
    with pytest.raises(ValueError, match="tuples"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=[p for _, p in params])


# ------------------------------------------------------------------ broadcast helpers

def test_broadcast_parameters_state_dict_and_named_parameters():
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)).double()
    torch.manual_seed(R())
    for p in model.parameters():
        nn.init.normal_(p)
    model[1].running_mean.fill_(R())
    model[1].num_batches_tracked.fill_(R() + 5)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    root = hvd.broadcast_object(model.state_dict() if R() == 0 else None, root_rank=0)
    for k, v in model.state_dict().items():
        assert torch.equal(v, root[k]), k
    assert model[1].num_batches_tracked.item() == 5
    other = make_model(seed=R())
    hvd.broadcast_parameters(other.named_parameters(), root_rank=N() - 1)
    assert_same_params(other, make_model(seed=N() - 1), atol=0)


STATE_OPTIMIZERS = {
    "SGD-momentum": lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.9),
    "Adam": lambda p, lr: torch.optim.Adam(p, lr=lr),
    "AdamW": lambda p, lr: torch.optim.AdamW(p, lr=lr, weight_decay=0.1),
    "RMSprop": lambda p, lr: torch.optim.RMSprop(p, lr=lr, momentum=0.5, centered=True),
    "Adagrad": lambda p, lr: torch.optim.Adagrad(p, lr=lr),
    "Adadelta": lambda p, lr: torch.optim.Adadelta(p, lr=lr),
    "NAdam": lambda p, lr: torch.optim.NAdam(p, lr=lr),
}


def _local_steps(model, opt, count):
    for step in range(count):
        x, y = global_batch(step + 10 * R(), 0)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("root", [0, 1])
@pytest.mark.parametrize("wrapped", [False, True])
@pytest.mark.parametrize("name", sorted(STATE_OPTIMIZERS))
def test_broadcast_optimizer_state(name, wrapped, root):
    model = make_model()
    opt = STATE_OPTIMIZERS[name](model.parameters(), 0.01 * (R() + 1))
    # root has state; odd ranks have different state; the other ranks have none yet
    steps = 2 if R() == root else (1 if R() % 2 else 0)
    _local_steps(model, opt, steps)
    if wrapped:
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    params_before = [p.detach().clone() for p in model.parameters()]
    hvd.broadcast_optimizer_state(opt, root_rank=root)
    for p, q in zip(model.parameters(), params_before):
        assert torch.equal(p, q), "broadcast_optimizer_state must not move the parameters"
    mine = opt.state_dict()
    theirs = hvd.broadcast_object(mine if R() == root else None, root_rank=root)
    assert [g["lr"] for g in mine["param_groups"]] == [0.01 * (root + 1)]
    assert mine["param_groups"] == theirs["param_groups"]
    assert mine["state"].keys() == theirs["state"].keys() and len(mine["state"]) > 0
    for index, state in theirs["state"].items():
        for key, value in state.items():
            local = mine["state"][index][key]
            if isinstance(value, torch.Tensor):
                assert torch.equal(local, value), (index, key)
            else:
                assert local == value, (index, key)
    # and training on from here keeps every rank identical
    hvd.broadcast_parameters(model.state_dict(), root_rank=root)
    x, y = global_batch(99, 0)
    F.mse_loss(model(x), y).backward()
    opt.step()
    assert_equal_across_ranks(model)


def test_broadcast_optimizer_state_lbfgs():
    model = make_model()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1 * (R() + 1), history_size=3)
    if R() == 0:
        x, y = global_batch(0, 0)

        def closure():
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            return loss
        opt.step(closure)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert opt.param_groups[0]["lr"] == 0.1
    state = opt.state_dict()["state"]
    root_state = hvd.broadcast_object(state if R() == 0 else None, root_rank=0)
    assert state.keys() == root_state.keys()


def test_broadcast_and_allgather_object():
    obj = {"rank": R(), "data": list(range(R() + 1))}
    assert hvd.broadcast_object(obj, root_rank=0) == {"rank": 0, "data": [0]}
    gathered = hvd.allgather_object(obj)
    assert [g["rank"] for g in gathered] == list(range(N()))


# ------------------------------------------------------------------ SyncBatchNorm

def _bn_reference(dims, channels, momentum):
    cls = nn.BatchNorm2d if dims == 4 else (nn.BatchNorm3d if dims == 5 else nn.BatchNorm1d)
    return cls(channels, momentum=momentum).double()


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("dims", [2, 3, 4])
def test_sync_batch_norm_matches_batchnorm_on_the_whole_batch(dims, momentum):
    channels = 3
    rows = [r + 2 for r in range(N())]  # different batch sizes per rank
    total, offset = sum(rows), sum(rows[:R()])
    tail = (4,) * (dims - 2)
    ref = _bn_reference(dims, channels, momentum)
    sync = hvd.SyncBatchNorm(channels, momentum=momentum).double()
    with torch.no_grad():
        g = torch.Generator().manual_seed(5)
        w, b = torch.randn(channels, generator=g), torch.randn(channels, generator=g)
        for m in (ref, sync):
            m.weight.copy_(w)
            m.bias.copy_(b)
    for it in range(2):
        g = torch.Generator().manual_seed(10 + it)
        x_all = torch.randn(total, channels, *tail, generator=g, dtype=torch.float64) * 2 + 1
        up = torch.randn(total, channels, *tail, generator=g, dtype=torch.float64)
        x_ref = x_all.clone().requires_grad_()
        y_ref = ref(x_ref)
        (y_ref * up).sum().backward()
        x = x_all[offset:offset + rows[R()]].clone().requires_grad_()
        y = sync(x)
        (y * up[offset:offset + rows[R()]]).sum().backward()
        assert torch.allclose(y, y_ref[offset:offset + rows[R()]], atol=1e-10)
        assert torch.allclose(x.grad, x_ref.grad[offset:offset + rows[R()]], atol=1e-10)
        # weight/bias gradients are local; summed over ranks they are the whole batch's
        assert torch.allclose(hvd.allreduce(sync.weight.grad, op=hvd.Sum), ref.weight.grad, atol=1e-10)
        assert torch.allclose(hvd.allreduce(sync.bias.grad, op=hvd.Sum), ref.bias.grad, atol=1e-10)
        assert torch.allclose(sync.running_mean, ref.running_mean, atol=1e-12)
        assert torch.allclose(sync.running_var, ref.running_var, atol=1e-12)
        assert sync.num_batches_tracked.item() == ref.num_batches_tracked.item()
        for m in (ref, sync):
            m.weight.grad = m.bias.grad = None
    sync.eval()
    ref.eval()
    x = torch.randn(2, channels, *tail, dtype=torch.float64)
    assert torch.allclose(sync(x), ref(x), atol=1e-12)


def test_sync_batch_norm_float32_and_convert():
    model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    model = hvd.SyncBatchNorm.convert_sync_batchnorm(model)
    assert isinstance(model[1], hvd.SyncBatchNorm)
    x = torch.randn(2, 2, 6, 6)
    out = model(x)
    out.mean().backward()
    assert out.dtype == torch.float32 and model[0].weight.grad is not None
    with pytest.raises(ValueError, match="2D"):
        hvd.SyncBatchNorm(3)(torch.ones(3))


def test_gradients_are_submitted_during_backward():
    """The overlap: by the time backward() returns, every gradient's allreduce is in flight
    (or done), submitted by the hooks, before step() is called."""
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    x, y = global_batch(0, 0)
    F.mse_loss(model(shard(x)), shard(y)).backward()
    assert set(opt._handles) == set(model.parameters())
    opt.step()
    assert not opt._handles


def in_flight_params(opt) -> list:
    """The parameters whose reductions are in flight, one list per op (bucket or gradient)."""
    return [list(getattr(key, "params", (key,))) for key in opt._handles]


def test_gradients_go_in_buckets_after_the_first_step():
    """The first step reduces gradient by gradient and records the hooks' order; from the
    second step all of a small model's gradients go as one bucket, still during backward.
    That bucket (at most 64 KiB) is packed into its flat buffer and reduced as one small
    async allreduce, which runs as it is submitted when every rank is there."""
    agreement = nbdist.common.basics.engine().agreement
    before = agreement.stats["express"] if agreement is not None else 0
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    for step in range(6):
        x, y = global_batch(step, 0)
        F.mse_loss(model(shard(x)), shard(y)).backward()
        ops = in_flight_params(opt)
        if step == 0:
            assert sorted(len(o) for o in ops) == [1, 1, 1, 1]
        else:
            assert len(ops) == 1 and set(ops[0]) == set(model.parameters())
        opt.step()
        opt.zero_grad()
    ref = make_model()
    train(ref, torch.optim.SGD(ref.parameters(), lr=0.1), 6, 1, False)
    assert_same_params(model, ref)
    if agreement is not None and N() > 1:  # (summed: a rank that always comes first may not)
        ran = hvd.allreduce(torch.tensor([agreement.stats["express"] - before]), op=hvd.Sum)
        assert int(ran.item()) > 0


def test_a_bucket_is_reduced_in_the_gradients_themselves(monkeypatch):
    """On CPU the bucket's gradients are reduced where they are: each p.grad keeps its
    storage, and nothing passes through the bucket's flat buffer (the shm transport).
    (This model's bucket is small enough to be packed and run as it is submitted, a small
    async op: that is turned off here, as NBDIST_ASYNC_EXPRESS_BYTES=0 does.)"""
    monkeypatch.setattr(nbdist.common.ops, "ASYNC_EXPRESS_BYTES", 0)
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    transport = nbdist.common.basics.engine().executor.choose("cpu", "allreduce")
    in_pieces = hasattr(transport, "allreduce_pieces")  # else packed into the flat buffer
    for step in range(3):
        x, y = global_batch(step, 0)
        F.mse_loss(model(shard(x)), shard(y)).backward()
        storage = {p: p.grad.data_ptr() for p in model.parameters()}
        if step > 0 and in_pieces:  # (the op may be done already: only a buffer it never uses)
            (bucket,) = opt._buckets
            bucket.buffer().fill_(float("nan"))
        opt.synchronize()
        assert all(p.grad.data_ptr() == storage[p] for p in model.parameters())
        if step > 0 and in_pieces:
            assert torch.isnan(bucket.flat).all()
        with opt.skip_synchronize():
            opt.step()
        opt.zero_grad()
    ref = make_model()
    train(ref, torch.optim.SGD(ref.parameters(), lr=0.1), 3, 1, False)
    assert_same_params(model, ref)


def test_autotune_picks_the_bucket_size_by_measurement(monkeypatch, tmp_path):
    """NBDIST_AUTOTUNE: after the layout step, each candidate bucket size trains a warm-up
    step and two measured ones, in two rounds; every rank then keeps the same size, the
    fastest, and rank 0 writes the scores to NBDIST_AUTOTUNE_LOG. The training itself is
    unchanged."""
    config = nbdist.common.basics.config()
    log = tmp_path / "autotune.csv"
    monkeypatch.setattr(nbdist.common.basics, "config", lambda: dataclasses.replace(
        config, autotune=True, autotune_steps=2, autotune_warmup=1, autotune_log=str(log)))
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), bucket_bytes=100)
    # layout, first timed step, 2 rounds x 5 candidates x 3 steps (the middle of the
    # schedule runs one size twice in a row: no new layout, still its warm-up), then more
    steps = 2 + 2 * 5 * 3 + 2
    train(model, opt, steps, 1, True)
    MiB = 1024 * 1024
    scores = opt.autotune_scores
    assert sorted(scores) == [0, 100, MiB, 4 * MiB, 25 * MiB]
    chosen = opt._tuner.chosen
    assert scores[chosen] == min(scores.values())
    assert hvd.allgather_object((chosen, scores)) == [(chosen, scores)] * N()
    # this model's gradients: 192, 48, 96 and 16 bytes; 100-byte buckets hold one each
    assert len(opt._buckets) == (0 if chosen in (0, 100) else 1)
    if R() == 0:
        rows = log.read_text().splitlines()
        assert rows[0] == "bucket_bytes,round,median_step_ms,chosen"
        assert sorted(int(r.split(",")[0]) for r in rows[1:]) == sorted(list(scores) * 2)
        assert {r.split(",")[0] for r in rows[1:] if r.endswith(",1")} == {str(chosen)}
    ref = make_model()
    train(ref, torch.optim.SGD(ref.parameters(), lr=0.1), steps, 1, False)
    assert_same_params(model, ref)
    # No buckets (one op per gradient): nothing to tune, and the user is told so.
    with pytest.warns(UserWarning, match=r"without buckets \(bucket_bytes=0\), so it has no bucket size to tune"):
        hvd.DistributedOptimizer(torch.optim.SGD(ref.parameters(), lr=0.1),
                                 named_parameters=ref.named_parameters(), bucket_bytes=0)


@pytest.mark.parametrize("bucket_bytes", [0, 100, 200, None])
@pytest.mark.parametrize("bpps", [1, 2])
def test_bucket_sizes_give_the_same_training(bucket_bytes, bpps):
    """Buckets of any size (0: none; 100 and 200 bytes split this float64 model's four
    gradients into several, single ones included) train as one process on the whole batch."""
    ref, model, opt = reference_and_distributed(OPTIMIZERS["Adam"], steps=3, bpps=bpps,
                                                bucket_bytes=bucket_bytes)
    assert_same_params(model, ref)
    assert_equal_across_ranks(model)
    sizes = sorted(len(b.params) for b in opt._buckets)
    assert sizes == {0: [], 100: [], 200: [3], None: [4]}[bucket_bytes]


def test_bucket_bytes_must_not_be_negative():
    model = make_model()
    with pytest.raises(ValueError, match="bucket_bytes"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), bucket_bytes=-1)


class EmbeddingBag(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(10, 3, sparse=True).double()
        self.fc1 = nn.Linear(3, 4).double()
        self.fc2 = nn.Linear(4, 2).double()

    def forward(self, idx):
        return self.fc2(torch.tanh(self.fc1(self.emb(idx))))


def test_sparse_gradients_stay_out_of_buckets():
    """A sparse gradient is still allgathered; the dense ones around it go in a bucket."""
    def run(distributed):
        model = EmbeddingBag()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if distributed:
            opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            idx = torch.randint(0, 10, (N() * B,), generator=g)
            target = torch.randn(N() * B, 2, generator=g, dtype=torch.float64)
            if distributed:
                idx, target = shard(idx), shard(target)
            F.mse_loss(model(idx), target).backward()
            opt.step()
            assert model.emb.weight.grad.is_sparse
            opt.zero_grad()
        return model, opt
    model, opt = run(True)
    assert [set(b.params) for b in opt._buckets] == [
        {model.fc1.weight, model.fc1.bias, model.fc2.weight, model.fc2.bias}]
    assert_same_params(model, run(False)[0])


def test_buckets_on_a_process_set():
    """Members average over their set in buckets; a rank outside it trains alone."""
    even = hvd.add_process_set([r for r in range(N()) if r % 2 == 0])
    try:
        model = make_model()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(),
                                       process_set=even)
        members = even.ranks if even.included() else [R()]
        for step in range(3):
            x, y = global_batch(step, 0)
            F.mse_loss(model(shard(x)), shard(y)).backward()
            opt.step()
            opt.zero_grad()
        # the reference: one process on the members' shards together
        ref = make_model()
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        for step in range(3):
            x, y = global_batch(step, 0)
            rows = torch.cat([torch.arange(r * B, (r + 1) * B) for r in members])
            F.mse_loss(ref(x[rows]), y[rows]).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        assert_same_params(model, ref)
        assert len(opt._buckets) == (1 if even.included() and len(members) > 1 else 0)
    finally:
        hvd.remove_process_set(even)


def test_wrapping_the_same_model_again_takes_over():
    """A notebook cell that wraps the optimizer runs twice: the new optimizer takes over."""
    model = make_model()
    first = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters())
    with pytest.warns(UserWarning, match="takes over"):
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters())
    assert not first._hook_handles
    train(model, opt, 3, 1, True)
    ref = make_model()
    train(ref, torch.optim.SGD(ref.parameters(), lr=0.1), 3, 1, False)
    assert_same_params(model, ref)
