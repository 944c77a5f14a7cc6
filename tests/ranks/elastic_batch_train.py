"""The batch twin's training script (tests/test_elastic_batch.py): torch, hvd.elastic, one epoch;
NBDIST_TEST_KILL='step:rank,rank' SIGKILLs those ranks after that step (once)."""
import json
import os
import signal
import time

import torch
import torch.nn.functional as F

import nbdist.torch as hvd

torch.set_num_threads(1)
hvd.init()
step_s, _, victims_s = os.environ.get("NBDIST_TEST_KILL", "").partition(":")
KILL_STEP, VICTIMS = (int(step_s), [int(v) for v in victims_s.split(",")]) if step_s else (-1, [])
MARKER = os.environ["NBDIST_TEST_MARKER"]
torch.manual_seed(0)
X = torch.randn(240, 8)
Y = X @ torch.randn(8, 1)
model = torch.nn.Linear(8, 1)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.02),
                               named_parameters=model.named_parameters())
sampler = hvd.elastic.ElasticSampler(range(len(X)), shuffle=True, seed=1)
state = hvd.elastic.TorchState(model=model, optimizer=opt, sampler=sampler, epoch=0, batch=0,
                               seen=[], complete=[], sizes=[])
B = 4


@hvd.elastic.run
def train(state):
    pids = hvd.allgather_object(os.getpid())
    done = []
    while state.epoch < 1:
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
            state.sizes.append(hvd.size())
            killer = min(set(range(hvd.size())) - set(VICTIMS))
            if state.batch == KILL_STEP and hvd.rank() == killer and not os.path.exists(MARKER):
                open(MARKER, "w").close()
                for r in VICTIMS:
                    os.kill(pids[r], signal.SIGKILL)
            if state.batch % 3 == 0:
                state.seen += [s for part in hvd.allgather_object(done) for s in part]
                done.clear()
                state.commit()
            time.sleep(0.03)
        state.seen += [s for part in hvd.allgather_object(done) for s in part]
        done.clear()
        state.complete.append(sorted(state.seen) == list(range(len(X))))
        state.epoch += 1
        state.sampler.set_epoch(state.epoch)
        state.commit()


train(state)
w = hvd.allgather(torch.cat([p.detach().flatten() for p in model.parameters()]).unsqueeze(0))
if hvd.rank() == 0:
    print("SUMMARY " + json.dumps({"size": hvd.size(), "complete": state.complete, "sizes": state.sizes,
                                   "same_weights": all(torch.equal(w[0], w[r]) for r in range(hvd.size()))}))
