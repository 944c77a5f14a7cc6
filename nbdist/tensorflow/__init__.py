"""nbdist.tensorflow: Horovod's TensorFlow API (TF 2.x, Keras 3) on the nbdist runtime.

`import nbdist.tensorflow as hvd` in place of `import horovod.tensorflow as hvd`.
Everything of nbdist.common is here (init, rank, size, ..., the errors), and the
collectives take tf tensors and variables, eagerly or inside tf.function, with
gradients. See docs/tensorflow.md.
"""
from nbdist import common as _common

# Everything of the framework-neutral runtime first; the names below override the
# numpy collectives with their TensorFlow forms.
globals().update({_n: getattr(_common, _n) for _n in dir(_common) if not _n.startswith("_")})

from . import elastic  # noqa: E402
from .compression import Compression  # noqa: E402
from .functions import (allgather_object, broadcast_global_variables,  # noqa: E402
                        broadcast_object, broadcast_object_fn, broadcast_variables)
from .mpi_ops import (allgather, allreduce, alltoall, broadcast, broadcast_,  # noqa: E402
                      grouped_allgather, grouped_allreduce, grouped_reducescatter,
                      local_rank_op, local_size_op, process_set_included_op, rank_op,
                      reducescatter, size_op)
from .optimizer import DistributedOptimizer  # noqa: E402
from .tape import DistributedGradientTape, PartialDistributedGradientTape  # noqa: E402
from .sync_batch_norm import SyncBatchNormalization  # noqa: E402

from . import util  # noqa: E402
# Horovod's tests (and some user code) call this private helper of horovod.tensorflow.
from .util import _executing_eagerly  # noqa: E402,F401
