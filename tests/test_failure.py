"""nbdist.failure: the one place that says which rank caused a failure and what the user reads."""
from __future__ import annotations

import subprocess
import sys

from nbdist.common import errors
from nbdist.failure import (FailureReport, RankError, blame, describe_exception, is_follow_on, primary_cause,
                            raised_headline, rank_ranges, unwrap)

# What TensorFlow 2.21 says when our numpy_function bridge raises inside a tf.function
# (captured from a real run, trimmed): the nbdist error sits mid-message.
TF_WRAPPED = """Graph execution error:

Detected at node PyFunc defined at (most recent call last):
  File "<string>", line 8, in g

MismatchError: allreduce 'g': rank 0 sent shape (3,), rank 1 sent (4,)
Traceback (most recent call last):

  File ".../tensorflow/python/ops/script_ops.py", line 269, in __call__
    ret = func(*args)

nbdist.common.errors.MismatchError: allreduce 'g': rank 0 sent shape (3,), rank 1 sent (4,)


\t [[{{node PyFunc}}]] [Op:__inference_g_8]"""


def test_tf_wrapper_is_unwrapped_to_the_nbdist_error():
    assert unwrap("UnknownError", TF_WRAPPED) == (
        "MismatchError", "allreduce 'g': rank 0 sent shape (3,), rank 1 sent (4,)")
    assert unwrap("InvalidArgumentError", TF_WRAPPED)[0] == "MismatchError"
    err = RankError.collect(0, "UnknownError", TF_WRAPPED)
    assert raised_headline(err) == ("rank 0 raised MismatchError: "
                                    "allreduce 'g': rank 0 sent shape (3,), rank 1 sent (4,)")
    assert err.wrapper == "UnknownError" and not err.follow_on
    # a wrapped AbortedError is a follow-on, like a bare one
    assert RankError.collect(1, "UnknownError", TF_WRAPPED.replace("MismatchError", "AbortedError")).follow_on


def test_plain_errors_are_left_alone():
    assert unwrap("ValueError", "corrupt batch on rank 1") == ("ValueError", "corrupt batch on rank 1")
    # a user's own message that merely mentions a name is not an nbdist error
    assert unwrap("RuntimeError", "MismatchError: not ours") == ("RuntimeError", "MismatchError: not ours")


def test_chained_exception_names_the_nbdist_cause():
    try:
        try:
            raise errors.MismatchError("broadcast 'w': root 0 vs 1")
        except errors.MismatchError as inner:
            raise RuntimeError("autograd hook failed") from inner
    except RuntimeError as outer:
        assert describe_exception(outer) == ("MismatchError", "broadcast 'w': root 0 vs 1")
    assert describe_exception(ValueError("x")) == ("ValueError", "x")


def test_follow_on_errors():
    assert is_follow_on("AbortedError") and is_follow_on("CollectiveTimeoutError")
    assert not is_follow_on("ValueError")
    assert not is_follow_on("KeyboardInterrupt")  # raised by the user's code: a cause
    assert is_follow_on("KeyboardInterrupt", interrupted_by_watcher=True)  # our SIGINT


def test_primary_cause_is_the_earliest_non_follow_on():
    errs = [RankError.collect(0, "AbortedError", "rank 2 raised ValueError: x", time=1.0),
            RankError.collect(3, "ValueError", "late", time=3.0),
            RankError.collect(2, "ValueError", "x", time=2.0)]
    assert primary_cause(errs).rank == 2
    assert primary_cause(errs[:1]) is None
    tie = [RankError.collect(3, "ValueError", "a"), RankError.collect(1, "ValueError", "b")]
    assert primary_cause(tie).rank == 1


def test_report_lists_the_cause_first_then_groups_the_rest():
    primary = RankError.collect(1, "ValueError", "bad", ["Traceback ...", "ValueError: bad"])
    others = [RankError.collect(r, "AbortedError", "rank 1 raised ValueError: bad") for r in (0, 2, 3)]
    text = FailureReport(raised_headline(primary), primary, others, ["a note"]).text()
    assert text.splitlines()[0] == "nbdist: rank 1 raised ValueError: bad"
    assert "ranks 0, 2-3: AbortedError: rank 1 raised ValueError: bad" in text
    assert text.index("traceback of rank 1") < text.index("the other ranks")
    assert rank_ranges([5, 0, 1, 2]) == "0-2, 5"


def test_failure_module_imports_no_ipython():
    code = "import sys, nbdist.failure, nbdist.rank.batch, nbdist.cli.run; " \
           "bad = [m for m in sys.modules if m.startswith(('IPython', 'ipyparallel', 'nbdist.notebook'))]; " \
           "assert not bad, bad"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_death_watch_names_the_first_dead_process_and_its_status():
    """The pidfd watch sees which process went first and reads its status before it is reaped."""
    import time

    from nbdist.mpi.deaths import DeathWatch

    first = subprocess.Popen([sys.executable, "-c", "import os, time; time.sleep(0.5); os._exit(7)"])
    second = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        watch = DeathWatch({0: first.pid, 1: second.pid})
        deadline = time.monotonic() + 20
        while not watch.first_dead() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert watch.first_dead() == {0}
        assert watch.first_dead_statuses() == {0: 7 << 8}
        assert blame({0: 9, 1: 9}, watch.first_dead()) == {0: 9}  # all SIGKILL: the first one
    finally:
        second.kill()
        for p in (first, second):
            p.wait()


def test_fatal_error_excerpt_survives_another_ranks_log_record_inside_it():
    """The ranks share mpiexec's output, and faulthandler writes its report in pieces: in
    one CI run another engine's log record landed between 'Fatal Python error: ' and
    'Segmentation fault'. The excerpt is faulthandler's report without it."""
    from nbdist.notebook.cell import _fatal_error_excerpt

    log = ("engine started\n"
           "Fatal Python error: 2026-12-06 22:53:02.240 [IPEngine.0.0] Handling execute_request: "
           "35cac5dd-69a2861e7a74bd93fd0f5615_16782_15\n"
           "Segmentation fault\n\n"
           "Current thread 0x00007f0000000001 (most recent call first):\n"
           "2026-12-06 22:53:02.241 [IPEngine.0.0] another record\n"
           '  File "<cell>", line 3 in read_null_pointer\n'
           "\nsomething else\n")
    excerpt = _fatal_error_excerpt(log)
    assert excerpt.startswith("Fatal Python error: Segmentation fault\n"), excerpt
    assert "read_null_pointer" in excerpt and "IPEngine" not in excerpt, excerpt
    assert "something else" not in excerpt
    assert _fatal_error_excerpt("no crash here\n") == ""
