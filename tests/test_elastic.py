"""Elastic training (hvd.elastic): the API on a healthy world at 2 and 4 ranks."""
import pytest

from conftest import run_rank_tests


@pytest.mark.timeout(240)
@pytest.mark.parametrize("n", [2, 4])
def test_elastic_api_on_a_healthy_world(n):
    run_rank_tests(n, "torch_elastic.py", timeout=200)
