"""Adasum on CPU (run under mpiexec at 2 and 4 ranks) against a numpy reference."""
import numpy as np
import pytest

import nbdist.common as hvd
from _common_setup import runtime  # noqa: F401 (the autouse fixture starts nbdist)


def reference(vectors):
    """Adasum written out from the paper's formula: pairs by distance doubling, float64."""
    vs = [np.asarray(v, np.float64).ravel() for v in vectors]
    while len(vs) > 1:
        nxt = []
        for a, b in zip(vs[0::2], vs[1::2]):
            dot, aa, bb = a @ b, a @ a, b @ b
            nxt.append((1 - dot / (2 * aa)) * a + (1 - dot / (2 * bb)) * b)
        vs = nxt
    return vs[0]


def every_rank(make):
    return [make(r) for r in range(hvd.size())]


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_matches_the_numpy_reference(dtype):
    vectors = every_rank(lambda r: np.random.default_rng(10 + r).normal(size=(7, 5)).astype(dtype))
    got = hvd.allreduce(vectors[hvd.rank()], op=hvd.Adasum, name=f"adasum.ref.{np.dtype(dtype)}")
    assert got.dtype == dtype and got.shape == (7, 5)
    tol = 2e-3 if dtype == np.float16 else 1e-6
    np.testing.assert_allclose(got.astype(np.float64), reference(vectors).reshape(7, 5),
                               rtol=tol, atol=tol)
    # every rank holds the same bits
    assert len({g.tobytes() for g in hvd.allgather_object(got)}) == 1


def test_orthogonal_gradients_add_and_parallel_ones_average():
    n = hvd.size()
    basis = np.eye(n * 3)[: n]  # orthogonal rows
    ortho = hvd.allreduce(basis[hvd.rank()] * 2.0, op=hvd.Adasum, name="adasum.ortho")
    np.testing.assert_allclose(ortho, basis.sum(0) * 2.0, atol=1e-12)
    direction = np.linspace(1, 2, 6)
    parallel = hvd.allreduce(direction * 3.0, op=hvd.Adasum, name="adasum.par")
    np.testing.assert_allclose(parallel, direction * 3.0, rtol=1e-12)


def test_in_place_and_scale_factors():
    x = np.full(4, float(hvd.rank() + 1))
    want = reference(every_rank(lambda r: np.full(4, float(r + 1)) * 0.5)) * 3.0
    out = hvd.allreduce_(x, op=hvd.Adasum, name="adasum.inplace", prescale_factor=0.5,
                         postscale_factor=3.0)
    assert out is x
    np.testing.assert_allclose(x, want, rtol=1e-12)


def test_refusals_name_the_problem():
    with pytest.raises(TypeError, match="floating-point"):
        hvd.allreduce(np.ones(3, np.int32), op=hvd.Adasum)
    with pytest.raises(NotImplementedError, match="Adasum"):
        hvd.reducescatter(np.ones((hvd.size(), 2)), op=hvd.Adasum)
    if hvd.size() == 4:  # a set of 3 ranks is not a power of two
        three = hvd.add_process_set([0, 1, 2])
        try:
            if three.included():
                with pytest.raises(ValueError, match="power-of-2"):
                    hvd.allreduce(np.ones(2), op=hvd.Adasum, process_set=three)
        finally:
            hvd.remove_process_set(three)


def test_torch_optimizer_with_adasum():
    torch = pytest.importorskip("torch")
    import nbdist.torch as thvd

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1, bias=False)
    thvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = thvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                    named_parameters=model.named_parameters(), op=thvd.Adasum)
    before = model.weight.detach().clone()
    x = torch.zeros(1, 4)
    x[0, hvd.rank() % 4] = 1.0  # orthogonal gradients on up to 4 ranks
    model(x).sum().backward()
    grads = hvd.allgather_object(model.weight.grad.detach().numpy().copy())
    opt.step()
    want = reference(grads).reshape(1, 4)
    np.testing.assert_allclose((before - model.weight.detach()).numpy(), want, rtol=1e-6)


def test_torch_optimizer_with_adasum_combines_each_ranks_update():
    # Horovod's Adasum optimizer: every rank steps the wrapped optimizer on its own
    # gradient, and the ranks' *updates* are combined by Adasum. With Adam that is not
    # Adam on the Adasum of the gradients (Adam's first step is ~ -lr * sign(g)).
    torch = pytest.importorskip("torch")
    import nbdist.torch as thvd

    model = torch.nn.Linear(3, 2)
    torch.nn.init.constant_(model.weight, 0.5)
    torch.nn.init.constant_(model.bias, -0.25)
    opt = thvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.1),
                                    named_parameters=model.named_parameters(), op=thvd.Adasum)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.arange(3.0).reshape(1, 3) * (hvd.rank() + 1) - hvd.rank()
    (model(x) ** 2).sum().backward()
    grads = hvd.allgather_object([p.grad.detach().clone() for p in model.parameters()])
    opt.step()

    def local_update(rank_grads):  # one Adam step from `before` on one rank's gradients
        params = [b.clone().requires_grad_() for b in before]
        adam = torch.optim.Adam(params, lr=0.1)
        for q, g in zip(params, rank_grads):
            q.grad = g.clone()
        adam.step()
        return [(q.detach() - b).numpy() for q, b in zip(params, before)]

    updates = [local_update(g) for g in grads]
    for i, p in enumerate(model.parameters()):
        want = before[i].numpy() + reference([u[i] for u in updates]).reshape(p.shape)
        np.testing.assert_allclose(p.detach().numpy(), want, rtol=1e-5, atol=1e-6)
    # and it is not Adam applied to the Adasum of the gradients
    combined = [torch.from_numpy(reference([g[i].numpy() for g in grads]).reshape(b.shape))
                .float() for i, b in enumerate(before)]
    other = local_update(combined)
    assert not np.allclose(model.weight.detach().numpy(), before[0].numpy() + other[0])
    with pytest.raises(AssertionError, match="Adasum"):
        with opt.skip_synchronize():
            pass


def test_tiny_parallel_vectors_still_average():
    # Horovod's stability case: parallel vectors of magnitude near float32's smallest
    # normal. Their squared norms (~1e-76 in float64) are tiny but not zero, so Adasum
    # must still average them, not fall back to a sum.
    base = np.linspace(-1.0, 1.0, 64) * np.finfo(np.float32).tiny * 4
    scale = [1.0, 2.0, 3.0, 4.0][hvd.rank() % 4]
    got = hvd.allreduce(base.astype(np.float32) * np.float32(scale), op=hvd.Adasum,
                        name="adasum.tiny")
    want = reference(every_rank(lambda r: base * [1.0, 2.0, 3.0, 4.0][r % 4]))
    np.testing.assert_allclose(got, want, rtol=1e-5)
