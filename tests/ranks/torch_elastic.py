"""hvd.elastic on a healthy world (no driver): commit/restore/sync, on_reset, the retry loop,
HostsUpdatedInterrupt, and ElasticSampler's exactly-once split. Runs on 2 and 4 ranks."""
import pytest
import torch

import nbdist.torch as hvd

from _torch_setup import N, R, runtime  # noqa: F401 (the autouse fixture starts nbdist)


def model_and_opt(seed):
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, opt


def params(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_commit_and_restore_return_to_the_last_commit():
    model, opt = model_and_opt(0)
    state = hvd.elastic.TorchState(model, opt, epoch=1, batch=2)
    committed = params(model).clone()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    state.epoch, state.batch = 5, 7
    state.restore()
    assert torch.equal(params(model), committed)
    assert (state.epoch, state.batch) == (1, 2)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2.0)
    state.batch = 9
    state.commit()
    state.batch = 10
    state.restore()
    assert torch.equal(params(model), committed * 2.0)
    assert state.batch == 9


def test_sync_copies_rank_0_state_everywhere():
    model, opt = model_and_opt(R())  # different weights on every rank
    state = hvd.elastic.TorchState(model, opt, step=100 + R())
    state.sync()
    gathered = hvd.allgather(params(model).unsqueeze(0))
    for r in range(N()):
        assert torch.equal(gathered[r], gathered[0])
    assert state.step == 100
    reference, _ = model_and_opt(0)
    assert torch.equal(params(model), params(reference))


def test_run_retries_after_an_internal_error_from_the_last_commit():
    model, opt = model_and_opt(0)
    state = hvd.elastic.TorchState(model, opt, step=0)
    resets = []
    state.register_reset_callbacks([lambda: resets.append(hvd.size())])
    calls = []

    @hvd.elastic.run
    def train(state):
        calls.append(state.step)
        while state.step < 6:
            x = torch.full((4, 3), float(state.step))
            opt.zero_grad()
            model(x).sum().backward()
            hvd.allreduce_(model.weight.grad, name=f"g.{len(calls)}.{state.step}")
            opt.step()
            state.step += 1
            if state.step % 2 == 0:
                state.commit()
            if len(calls) == 1 and state.step == 3:
                raise hvd.HorovodInternalError("a collective failed")  # on every rank
        return state.step

    assert train(state) == 6
    assert calls == [0, 2]  # the second call started from the commit at step 2
    assert resets == [N()]  # on_reset fired once; the world is unchanged
    assert hvd.is_initialized() and hvd.size() == N()


def test_a_mismatch_is_not_retried():
    state = hvd.elastic.ObjectState(x=1)
    calls = []

    @hvd.elastic.run
    def train(state):
        calls.append(1)
        hvd.allreduce(torch.zeros(2 + R() % 2 if N() > 1 else 3), name="elastic.mismatch")

    if N() == 1:
        pytest.skip("needs 2 ranks")
    with pytest.raises(hvd.MismatchError):
        train(state)
    assert calls == [1]


def test_hosts_updated_interrupt_resets_and_skips_the_sync_when_asked():
    state = hvd.elastic.ObjectState(value=R())
    seen = []

    @hvd.elastic.run
    def train(state):
        seen.append(state.value)
        if len(seen) == 1:
            raise hvd.elastic.HostsUpdatedInterrupt(skip_sync=True)
        return state.value

    # The first call syncs (rank 0's value); the retry after the interrupt skips the sync.
    assert train(state) == 0
    assert seen == [0, 0]


def test_elastic_sampler_sees_every_sample_once_across_a_reset():
    dataset = list(range(103))
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=3)
    state = hvd.elastic.TorchState(sampler=sampler, epoch=0)
    batch = 4
    mine = list(sampler)
    seen = []
    for i in range(0, 5):  # five batches, then a commit
        seen += mine[i * batch:(i + 1) * batch]
        sampler.record_batch(i, batch)
    state.commit()
    sampler.record_batch(5, batch)  # a batch after the commit, undone by a failure
    state.restore()
    state.sync()
    state.on_reset()  # the sampler deals the rest again
    seen += list(sampler)
    everyone = [s for part in hvd.allgather_object(seen) for s in part]
    assert sorted(everyone) == dataset  # every sample exactly once
    sampler.set_epoch(1)
    assert sorted(s for part in hvd.allgather_object(list(sampler)) for s in part) == dataset
