"""What stagelm knows of a device, and what a stage says when it cannot have one."""

import subprocess
import sys
from types import SimpleNamespace

from conftest import ROOT

from stagelm.infra.devices import hbm_bandwidth, peak_flops


def test_published_figures_by_device_kind():
    v5e = [SimpleNamespace(device_kind="TPU v5 lite")]
    assert peak_flops("bfloat16", v5e) == 197e12 and hbm_bandwidth(v5e) == 819e9
    assert peak_flops("bfloat16", v5e * 4) == 4 * 197e12
    cpu = [SimpleNamespace(device_kind="cpu")]
    assert peak_flops("float32", cpu) is None and hbm_bandwidth(cpu) is None


def test_a_tpu_held_by_another_process_is_one_line():
    # what libtpu raises at a process's first JAX call while another holds the chip (seen on a v5e)
    script = (
        "from stagelm.infra.errors import run_main\n"
        "def main():\n"
        "    raise RuntimeError('Unable to initialize backend tpu: INTERNAL: Internal error when accessing "
        'libtpu multi-process lockfile. Run "$ sudo lsof -w /dev/accel0" to figure out which process '
        "is using the TPU.')\n"
        "run_main(main)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr == (
        "error: the TPU is held by another process (one process at a time can use it): wait for that one, "
        "and run experiments one at a time (dvc exp run --queue, then dvc queue start -j 1)\n"
    )
