"""An abort leaves every rank's runtime clean for the next collectives (2 and 4 ranks)."""
import pytest

from conftest import run_rank_tests


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [2, 4])
def test_next_collectives_work_after_an_abort(n):
    run_rank_tests(n, "common_recovery.py", timeout=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [2, 4])
def test_next_collectives_work_after_an_abort_with_the_coordinator(n):
    """The same with rank 0 as coordinator (multi-node's agreement path), forced on one node."""
    run_rank_tests(n, "common_recovery.py", timeout=240, extra_env={"NBDIST_AGREEMENT": "coordinator"})
