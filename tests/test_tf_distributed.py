"""TensorFlow data-parallel training (`workloads.tf_distributed`): the
exchange really averages the gradients, and the launcher neither imports
TensorFlow nor waits forever on its ranks."""

from __future__ import annotations

import subprocess
import sys

import psutil
import pytest

from dlprof_agent.workloads.runner import RunConfig
from dlprof_agent.workloads.tf_distributed import run_distributed
from tests.conftest import agent_env

pytest.importorskip("tensorflow")
pytestmark = pytest.mark.slow  # it imports TensorFlow

# The smallest model, two steps: each rank trains on its own synthetic batch.
TWO_STEPS = RunConfig(framework="tensorflow", model="alexnet-r", scale="tiny", iterations=1,
                      warmup=1, intra_op_threads=1)


def checksums(result: dict[str, object]) -> list[object]:
    ranks = result["per_rank"]
    assert isinstance(ranks, list) and len(ranks) == 2
    return [rank["weights_checksum"] for rank in ranks]


def test_ranks_with_different_data_end_with_the_same_weights() -> None:
    averaged = checksums(run_distributed(TWO_STEPS, 2))
    assert averaged[0] == averaged[1]
    # The control: without the exchange the same ranks drift apart, so the
    # data differ and it is the all-reduce that keeps the weights equal.
    alone = checksums(run_distributed(TWO_STEPS, 2, exchange=False))
    assert alone[0] != alone[1]
    assert averaged[0] not in alone


def test_the_launcher_imports_no_tensorflow() -> None:
    code = ("import sys, dlprof_agent.workloads.tf_distributed; "
            "sys.exit('tensorflow' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], env=agent_env(), timeout=60,
                          check=False).returncode == 0


def test_ranks_that_take_too_long_are_killed() -> None:
    with pytest.raises(RuntimeError, match=r"no result within 0\.5 s; rank 0"):
        run_distributed(TWO_STEPS, 2, timeout=0.5)
    assert psutil.Process().children() == []
