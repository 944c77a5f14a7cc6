"""Elastic training in the notebook, through a real kernel, ipyparallel, mpiexec and torch.

One notebook on one elastic cluster (4 ranks, --min-np 2):
  1. SIGKILL rank 2 mid-epoch: the same cell finishes on 3 ranks - weights identical on all
     ranks, every sample of the epoch seen exactly once, the steps go on from the last commit;
  2. %dist_scale -n 4 grows the world back; the new rank gets the state from rank 0;
  3. SIGKILL rank 0: the run goes on on 3 ranks from the new rank 0's copy of the commit;
  4. --max-np 4: a cell that starts on 3 ranks starts a fourth, which joins the running
     elastic job at its next commit();
  5. SIGKILL two ranks at once: 2 >= --min-np, the run goes on;
  6. one more kill leaves 1 < --min-np: the cell fails naming the rank lost and the minimum;
and nothing (process, /dev/shm segment) is left after the kernel shuts down.
"""
import json

import pytest

import nbharness as h

LOG = "/tmp/nbdist-elastic-test-{pid}.log"

TRAIN = r'''%%distributed{flags}
EPOCHS, KILL_AT, TAG, LOG, UNTIL_SIZE = {epochs}, {kill_at}, {tag!r}, {log!r}, {until}
import os, time, json, signal
import torch
import torch.nn.functional as F
import nbdist
import nbdist.torch as hvd
torch.set_num_threads(1)
hvd.init()
if "state" not in globals():  # a new rank (grown) starts from scratch; sync gives it the state
    torch.manual_seed(0)
    X = torch.randn(240, 8)
    Y = X @ torch.randn(8, 1)
    model = torch.nn.Linear(8, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.02),
                                   named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(range(len(X)), shuffle=True, seed=1)
    state = hvd.elastic.TorchState(model=model, optimizer=opt, sampler=sampler, epoch=0, batch=0,
                                   seen=[], complete=[], losses=[], sizes=[], epochs_in={{}})
B = 4
cell_steps = 0  # steps run in this cell on this rank: the kills are keyed by it

def log(**record):
    with open(LOG, "a") as f:
        f.write(json.dumps(dict(record, t=time.time())) + "\n")

@hvd.elastic.run
def train(state):
    global cell_steps
    pids = hvd.allgather_object(os.getpid())  # collectives only inside the elastic function
    done = []  # this cell's samples since the last commit, on this rank
    # EPOCHS more epochs in this cell (counted in the state: a rank that joins learns it at the
    # sync), then on (up to 30 more) until an epoch ended with a step on UNTIL_SIZE ranks
    while (state.epochs_in.get(TAG, 0) < EPOCHS
           or (state.sizes[-1] < UNTIL_SIZE and state.epochs_in.get(TAG, 0) < EPOCHS + 30)):
        # the same number of steps on every rank (the last step's batches may be short or empty)
        per_rank = -(-len(state.sampler.remaining_indices) // hvd.size())
        for i in range(-(-per_rank // B)):
            b = state.sampler.indices[i * B:(i + 1) * B]
            opt.zero_grad()
            loss = F.mse_loss(model(X[b]), Y[b], reduction="sum") / B if b else model.weight.sum() * 0
            loss.backward()
            opt.step()
            done.extend(b)
            state.sampler.record_batch(i, B)
            state.batch += 1
            total = hvd.allreduce(loss.detach(), op=hvd.Sum).item()
            state.losses.append((state.batch, total))
            state.sizes.append(hvd.size())
            log(tag=TAG, rank=hvd.rank(), size=hvd.size(), batch=state.batch)
            nbdist.report(step=state.batch, loss=total)
            cell_steps += 1
            victims = KILL_AT.get(cell_steps, [])
            marker = f"{{LOG}}.{{TAG}}.killed"
            if victims and hvd.rank() == min(set(range(hvd.size())) - set(victims)) and not os.path.exists(marker):
                open(marker, "w").close()
                log(tag=TAG, kill=[pids[r] for r in victims])
                for r in victims:
                    os.kill(pids[r], signal.SIGKILL)
            if state.batch % 3 == 0:
                state.seen += [s for part in hvd.allgather_object(done) for s in part]
                done.clear()
                state.commit()
            time.sleep(0.03)
        state.seen += [s for part in hvd.allgather_object(done) for s in part]
        done.clear()
        state.complete.append(sorted(state.seen) == list(range(len(X))))
        state.seen = []
        state.epochs_in[TAG] = state.epochs_in.get(TAG, 0) + 1
        state.epoch += 1
        state.sampler.set_epoch(state.epoch)
        state.commit()

train(state)
w = hvd.allgather(torch.cat([p.detach().flatten() for p in model.parameters()]).unsqueeze(0))
print("SUMMARY " + json.dumps({{
    "tag": TAG, "size": hvd.size(), "same_weights": all(torch.equal(w[0], w[r]) for r in range(hvd.size())),
    "complete": state.complete, "batches": [b for b, _ in state.losses], "sizes": state.sizes}}))
'''

FOOTPRINT = r'''
import json as _json, psutil as _ps
_c = get_ipython().magics_manager.registry["DistributedMagics"].cluster
_pids = []
_roots = [_c.cluster.controller.process.pid] + [p.pid for p in _c._mpiexec_procs()]
for _r in _roots:
    try:  # an engine set whose ranks were all killed has ended with them
        _p = _ps.Process(_r)
        _pids += [(_q.pid, _q.create_time()) for _q in [_p] + _p.children(recursive=True)]
    except _ps.NoSuchProcess:
        pass
_shm = _c.client[_c.engine_ids].apply_sync(lambda: sorted({l[l.index("/dev/shm/"):].split()[0]
                                           for l in open("/proc/self/maps") if "/dev/shm/" in l}))
_shm = sorted({s for per_rank in _shm for s in per_rank})
print("FOOTPRINT " + _json.dumps({"pids": _pids, "shm": _shm, "n": _c.n}))
'''


def _train(log, tag, epochs, kill_at, flags="", until=0):
    return TRAIN.format(flags=flags, epochs=epochs, kill_at=kill_at, tag=tag, log=log, until=until)


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    log = str(tmp_path_factory.mktemp("elastic") / "events.log")
    nb = h.notebook(
        "%load_ext nbdist",
        _train(log, "kill2", 1, {7: [2]}, " -n 4 --elastic --min-np 2 --no-widgets"),
        "%dist_scale -n 4",
        _train(log, "grown", 1, {}),
        _train(log, "kill0", 1, {10: [0]}),
        _train(log, "growrun", 1, {}, " --max-np 4", until=4),
        _train(log, "kill12", 1, {5: [1, 2]}),
        FOOTPRINT,
        _train(log, "below", 1, {4: [1]}),
        "%dist_status",
    )
    h.execute(nb, timeout=240)
    with open(log) as f:
        events = [json.loads(line) for line in f]
    return nb, events


def _summary(cell) -> dict:
    text = h.text_of(cell)
    # after a resize the new rank 0's output is still labelled with its rank at the cell's start
    lines = [line[line.index("SUMMARY ") + 8:] for line in text.splitlines() if "SUMMARY " in line]
    assert lines, text[-3000:]
    return json.loads(lines[0])


def _check_run(cell, size):
    text = h.text_of(cell)
    assert h.error_of(cell) is None, text[-4000:]
    s = _summary(cell)
    assert s["size"] == size, s
    assert s["same_weights"], "the weights differ between ranks"
    assert all(s["complete"]), f"an epoch did not see every sample exactly once: {s['complete']}"
    # resumed from the last commit: every step once, in order, none replayed before it
    assert s["batches"] == list(range(1, len(s["batches"]) + 1)), s["batches"]
    return s, text


def recovery_s(events, tag):
    """Seconds from the kill to the first step on the resized world."""
    kill = next(e for e in events if e.get("tag") == tag and "kill" in e)
    before = next(e["size"] for e in events if e.get("tag") == tag and "size" in e)
    after = next(e for e in events if e.get("tag") == tag and e.get("size", before) != before
                 and e["t"] > kill["t"])
    return after["t"] - kill["t"]


@pytest.mark.timeout(420)
def test_a_killed_rank_costs_seconds_not_the_run(executed):
    nb, events = executed
    s, text = _check_run(nb.cells[1], 3)
    assert s["sizes"][0] == 4 and s["sizes"][-1] == 3
    assert "elastic: lost rank 2" in text and "resized 4 -> 3 ranks" in text
    assert "resumed at step" in text
    print(f"recovery (kill -> first step on 3 ranks): {recovery_s(events, 'kill2'):.2f} s")


def test_grown_world_takes_the_state_from_rank_0(executed):
    nb, _ = executed
    assert "grew the elastic world to 4 ranks" in h.text_of(nb.cells[2]), h.text_of(nb.cells[2])
    s, _ = _check_run(nb.cells[3], 4)
    assert len(s["complete"]) == 2  # the new rank got epoch 1's state, not a fresh start


def test_killing_rank_0_loses_nothing(executed):
    nb, events = executed
    s, text = _check_run(nb.cells[4], 3)
    assert "elastic: lost rank 0" in text
    print(f"recovery after killing rank 0: {recovery_s(events, 'kill0'):.2f} s")


def test_a_running_job_takes_in_new_ranks_at_its_next_commit(executed):
    nb, _ = executed
    s, text = _check_run(nb.cells[5], 4)
    assert "starting 1 new rank to grow back to --max-np 4" in text, text[-3000:]
    assert "resized 3 -> 4 ranks" in text
    assert 3 in s["sizes"] and s["sizes"][-1] == 4


def test_two_kills_at_once_go_on_at_min_np(executed):
    nb, events = executed
    s, text = _check_run(nb.cells[6], 2)
    assert "resized 4 -> 2 ranks" in text, text[-3000:]


def test_a_kill_below_min_np_fails_clearly(executed):
    nb, _ = executed
    err = h.error_of(nb.cells[8])
    assert err is not None, h.text_of(nb.cells[8])[-3000:]
    assert "lost rank 1" in err[1] + err[2] and "below --min-np 2" in err[1] + err[2], err
    status = h.text_of(nb.cells[9])
    assert "ranks" in status


def test_nothing_left_after_kernel_shutdown(executed):
    nb, _ = executed
    fp = h.footprints(nb)
    assert fp and fp[0]["n"] == 2, h.text_of(nb.cells[7])[-3000:]
    assert h.alive(fp[0]["pids"]) == []
    assert h.shm_left(fp[0]["shm"]) == []
