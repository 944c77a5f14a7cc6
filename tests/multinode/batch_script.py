"""A script for `nbdist run --hosts` tests: prints its topology, then (argv[1]) kills rank 3,
raises on rank 2, or loops allreduce after touching $MARK (the ssh-cut test cuts then)."""
import os
import socket
import sys
import time

import numpy as np
import nbdist.common as hvd
hvd.init()
s = hvd.allreduce(np.array([hvd.rank()], np.int64), op=hvd.Sum, name="s")
print("RUN", hvd.rank(), socket.gethostname(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank(),
      hvd.cross_size(), int(s[0]), flush=True)
mode = sys.argv[1] if len(sys.argv) > 1 else ""
if mode == "kill" and hvd.rank() == 3:
    time.sleep(1.0)  # mid-run, as a real death is: its host's segment keepers are watching
    os.kill(os.getpid(), 9)
if mode == "raise" and hvd.rank() == 2:
    raise ValueError("bad batch on rank 2")
if mode in ("kill", "raise", "loop"):
    if mode == "loop" and hvd.rank() == 3:
        open(os.environ["MARK"], "w").close()
    t0 = time.time()
    while time.time() - t0 < 40:
        hvd.allreduce(np.ones(3), name="loop")
