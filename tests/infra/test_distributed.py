"""Multi-process training on JAX's own runtime: two CPU processes ≡ one process with the same devices."""

import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml
from conftest import (
    BIN,
    ROOT,
    TEST_XLA_FLAGS,
    env_with_venv,
    free_port,
    micro_params,
    run,
    tree_bytes,
    write_params,
)
from pretrain_runs import assert_trained_alike, command

from stagelm.infra.files import read_json
from stagelm.model.modeldir import load_model

pytestmark = pytest.mark.slow

# fsdp inside a process, data across processes: params, optimizer state and batches
# all cross the process boundary.
MESH = {"data": -1, "fsdp": 2, "tensor": 1}


def env(devices: int, **extra: str) -> dict:
    flags = f"--xla_force_host_platform_device_count={devices} {TEST_XLA_FLAGS}"
    return {**env_with_venv(), "XLA_FLAGS": flags, **extra}


def start_two(cmds: list[list[str]], cwd) -> list[subprocess.Popen]:
    """Start `stagelm launch <cmds[i]>` as process i of a two-process loopback job."""
    port = free_port()
    return [
        subprocess.Popen(
            [str(BIN / "stagelm"), "launch", *cmd],
            cwd=cwd,
            env=env(
                2,
                JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                JAX_NUM_PROCESSES="2",
                JAX_PROCESS_ID=str(i),
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i, cmd in enumerate(cmds)
    ]


def launch_two(cmd: list[str], cwd) -> list[str]:
    """Run `stagelm launch <cmd>` as processes 0 and 1 of a loopback job; their output."""
    procs = start_two([cmd, cmd], cwd)
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out
    return outs


def test_two_processes_match_one(micro_data, tmp_path):
    single, multi = tmp_path / "single", tmp_path / "multi"
    for work in (single, multi):
        work.mkdir()
        write_params(work / "params.yaml", micro_params(mesh=MESH))
    run(command(micro_data, single), single, env=env(4))
    outs = launch_two(command(micro_data, multi), multi)

    # One process writes the metrics; both print their progress only through process 0.
    assert "pretrain: done at step 12" in outs[0]
    assert "step 12/12" in outs[0] and "step 12/12" not in outs[1]
    assert read_json(multi / "out/provenance.json")["devices"]["processes"] == 2
    assert_trained_alike(single / "out", multi / "out")

    # Both processes restore the sharded state from Orbax: a rerun resumes at the last step.
    model_before = [np.asarray(x) for x in jax.tree.leaves(load_model(multi / "out/model"))]
    outs = launch_two(command(micro_data, multi), multi)
    assert "resuming from step 12" in outs[0] and "resuming from step 12" in outs[1]
    for x, y in zip(model_before, jax.tree.leaves(load_model(multi / "out/model")), strict=True):
        np.testing.assert_array_equal(x, np.asarray(y))


def test_a_process_that_fails_leaves_at_once(micro_data, tmp_path):
    """Process 1 of two meets a bad input after joining the runtime: it prints its line and
    exits, without waiting in JAX's shutdown for process 0, which waits on it in turn (so a
    launcher such as srun can end the job at once)."""
    write_params(tmp_path / "params.yaml", micro_params())
    good = command(micro_data, tmp_path)
    bad = [*good[:5], str(tmp_path / "missing"), *good[6:]]
    procs = start_two([good, bad], tmp_path)
    try:
        out = procs[1].communicate(timeout=20)[0]  # an orderly exit waits on process 0 far longer
    finally:
        for p in procs:
            p.kill()
            p.communicate()
    assert procs[1].returncode == 2, out
    assert out.strip().splitlines()[-1].startswith(f"error: {tmp_path / 'missing'}"), out


def test_launch_prefix_and_bad_variables(micro_data, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    # The prefix runs before the stage command (here `env`, which sets a variable and execs the rest).
    write_params(work / "params.yaml", micro_params(launch={"command": "env JAX_NUM_PROCESSES=2"}))
    out = run([str(BIN / "stagelm"), "launch", *command(micro_data, work)], work, check=False)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == (
        "error: JAX_COORDINATOR_ADDRESS: not set, but JAX_NUM_PROCESSES is; "
        "set all of JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID or none"
    )
    assert not (work / "out").exists()

    write_params(work / "params.yaml", micro_params(launch={"command": "no-such-launcher --nodes=2"}))
    out = run([str(BIN / "stagelm"), "launch", *command(micro_data, work)], work, check=False)
    assert out.returncode == 2
    assert out.stderr.strip() == (
        "error: launch.command: cannot run 'no-such-launcher' (No such file or directory); fix launch.command"
    )


def launch_one_of_two(micro_data, work: Path, address: str, index: int, timeout: int) -> tuple[int, str, float]:
    """`timeout -s TERM <timeout> stagelm launch <pretrain>` as process `index` of two whose
    coordinator is `address`: (exit code, stderr, seconds it lived)."""
    variables = {"JAX_COORDINATOR_ADDRESS": address, "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(index)}
    cmd = ["timeout", "-s", "TERM", str(timeout), str(BIN / "stagelm"), "launch", *command(micro_data, work)]
    t0 = time.perf_counter()
    out = run(cmd, work, check=False, env=env(1, **variables), timeout=120)
    return out.returncode, out.stderr, time.perf_counter() - t0


def test_an_unreachable_coordinator_ends_in_one_line_or_at_sigterm(micro_data, tmp_path):
    """Round four's hang: a join that cannot reach its coordinator sat out JAX's 300 s and
    ignored SIGTERM (the handler cannot run inside JAX's C++ join). Now SIGTERM ends it at once,
    `launch.initialization_timeout` bounds it with one line naming the address, and a host that
    does not resolve fails at once."""
    write_params(tmp_path / "params.yaml", micro_params())  # initialization_timeout: 300 s
    nobody = f"127.0.0.1:{free_port()}"
    for index in (1, 0):  # process 1 waits for the coordinator; process 0 is it, waiting for process 1
        code, err, seconds = launch_one_of_two(micro_data, tmp_path, nobody, index, timeout=8)
        assert code == 124 and seconds < 8 + 30, (index, code, seconds, err)
        assert "Traceback" not in err and "Check failure" not in err
    code, err, seconds = launch_one_of_two(micro_data, tmp_path, "no.such.host.invalid:1234", 1, timeout=60)
    assert code == 2 and seconds < 30, (code, seconds, err)
    assert err.strip().splitlines()[-1].startswith("error: JAX_COORDINATOR_ADDRESS: the host 'no.such.host.invalid'")
    write_params(tmp_path / "params.yaml", micro_params(launch={"command": "", "initialization_timeout": 3}))
    code, err, seconds = launch_one_of_two(micro_data, tmp_path, nobody, 1, timeout=60)
    assert code == 2 and seconds < 30, (code, seconds, err)
    assert err.strip().splitlines()[-1] == (
        f"error: JAX_COORDINATOR_ADDRESS: the coordinator at {nobody} did not answer within 3 s "
        "(launch.initialization_timeout); check that process 0 runs there and that the port is open between the hosts"
    )
    assert not (tmp_path / "out").exists()


def test_pack_in_two_processes_writes_the_one_process_bytes(micro_data, tmp_path):
    """Two processes encode a contiguous half of each corpus split apiece and share the
    shards: the folder is the one process's, file for file (small shards, so each process
    writes several and one straddles the halves)."""
    write_params(tmp_path / "params.yaml", micro_params(pack={**micro_params()["pack"], "rows_per_shard": 7}))
    inputs = ["--raw", str(micro_data / "raw"), "--tokenizer", str(micro_data / "tokenizer")]
    cmd = [sys.executable, str(ROOT / "stages/pack.py"), "--params", "params.yaml", *inputs]
    run([*cmd, "--out", "one"], tmp_path)
    outs = launch_two([*cmd, "--out", "two"], tmp_path)
    assert "pack: train:" in outs[0] and "pack: train:" not in outs[1]
    assert len(read_json(tmp_path / "one/train/manifest.json")["shards"]) > 2
    assert tree_bytes(tmp_path / "one") == tree_bytes(tmp_path / "two")
    assert read_json(tmp_path / "two.provenance.json")["processes"] == 2


def test_training_stages_start_through_launch():
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    for name in ("pack", "pretrain", "sft", "distill", "grpo"):
        assert stages[name]["cmd"].startswith(f"PYTHONPATH=src stagelm launch python stages/{name}.py"), name
