"""bench/common.py: how a training run's throughput is judged shared or measured alone."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
common = pytest.importorskip("common")

SPIN = "import time\nt = time.perf_counter()\nwhile time.perf_counter() - t < {}: pass"


@pytest.mark.skipif(common.machine_busy_seconds() is None, reason="needs Linux /proc/stat")
def test_other_load_leaves_out_the_run_itself_and_counts_other_work():
    # the measured child keeps one core busy: a load average would count it, OtherLoad must not
    with common.OtherLoad() as alone:
        subprocess.run([sys.executable, "-c", SPIN.format(1.0)], check=True)
    assert alone.cores is not None and alone.cores < 0.6, alone.cores
    # a process that is not the measured run spins meanwhile: that is other work
    other = subprocess.Popen([sys.executable, "-c", SPIN.format(2.5)])
    try:
        with common.OtherLoad() as shared:
            subprocess.run([sys.executable, "-c", "import time; time.sleep(1.5)"], check=True)
    finally:
        other.wait()
    assert shared.cores is not None and shared.cores > 0.6, shared.cores


def test_load_mark():
    alone, busy = {"other_cores": 0.05}, {"other_cores": 1.1}
    assert common.load_mark([alone, alone]) == ""
    assert common.load_mark([alone, busy]) == " *"
    assert common.load_mark([{"other_cores": None}]) == " *"  # not measurable: not claimed alone
    # older records: load averages count the run's own threads, so they never vouch for "alone"
    assert common.load_mark([{"load_average": [0.1, 0.2]}]) == " *"
    assert common.load_mark([{}]) == " °"
    assert common.load_mark([alone, {}]) == " °"
