"""The engines users scale onto, run for real on loopback: stages as the tasks of a SLURM job
(`tests/slurm.py` starts munged, slurmctld and slurmd), and a DVC remote on S3 (moto's
server, through stagelm's `s3` extra)."""

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import slurm
from conftest import BIN, ROOT, env_with_venv, free_port, make_project, micro_params, run, tree_bytes, write_params
from pretrain_runs import assert_trained_alike

from stagelm.infra.files import read_json
from stagelm.train.checkpoints import HASHES

pytestmark = pytest.mark.slow

SRUN = "srun --ntasks=2"  # launch.command: two tasks of one node, found by JAX's own SLURM detection


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = slurm.missing()
    if reason:
        slurm.skip_or_fail(reason)
    c = slurm.Cluster(tmp_path_factory.mktemp("slurm"))
    print(f"slurm: munged, slurmctld and slurmd up in {c.start_seconds:.2f} s")
    yield c
    c.stop()


def job_env(cluster: slurm.Cluster) -> dict:
    """The tests' stage environment, pointed at the cluster, with a free coordinator port:
    JAX derives its default from the job id, which another test cluster may share."""
    return {**cluster.env(env_with_venv()), "JAX_COORDINATOR_PORT": str(free_port())}


def test_pack_as_two_slurm_tasks_writes_the_one_process_bytes(cluster, micro_data, tmp_path):
    write_params(tmp_path / "params.yaml", micro_params(launch={"command": SRUN}))
    pack = [sys.executable, str(ROOT / "stages/pack.py"), "--params", "params.yaml", "--out", "packed"]
    pack += ["--raw", str(micro_data / "raw"), "--tokenizer", str(micro_data / "tokenizer")]
    out = run([str(BIN / "stagelm"), "launch", *pack], tmp_path, env=job_env(cluster), timeout=120)
    assert out.stdout.count("pack: train:") == 1  # process 0 reports
    assert read_json(tmp_path / "packed.provenance.json")["processes"] == 2
    assert tree_bytes(tmp_path / "packed") == tree_bytes(micro_data / "packed")


def test_a_task_that_dies_takes_the_job_down_at_once(cluster, tmp_path):
    """`stagelm launch` asks srun to end a step when one of its tasks fails (srun's own
    default waits for the others: here, a minute)."""
    write_params(tmp_path / "params.yaml", micro_params(launch={"command": SRUN}))
    task = 'if [ "$SLURM_PROCID" = 1 ]; then exit 3; fi; sleep 60'
    started = time.monotonic()
    out = run([str(BIN / "stagelm"), "launch", "bash", "-c", task], tmp_path, env=job_env(cluster), check=False)
    assert out.returncode != 0
    assert time.monotonic() - started < 20, out.stderr
    assert "task 1: Exited with exit code 3" in out.stderr


def task_pids(script: str, rank: int) -> list[int]:
    """The pids of the processes running `script` as SLURM task `rank`."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if script in (proc / "cmdline").read_bytes().decode(errors="replace"):
                env = (proc / "environ").read_bytes().split(b"\0")
                if f"SLURM_PROCID={rank}".encode() in env:
                    pids.append(int(proc.name))
        except (OSError, ValueError):
            continue
    return pids


@pytest.fixture(scope="module")
def slurm_project(cluster, tmp_path_factory):
    """The micro project with `launch.command: srun --ntasks=2`: `dvc repro pretrain` started,
    one task of pretrain SIGKILLed after its first checkpoint, then `dvc repro sft eval@pretrain`
    submitted with `sbatch`. Returns (project folder, what the killed run printed, how long
    it lived on after the kill, the batch job's log)."""
    root = make_project(tmp_path_factory.mktemp("slurm_project"), micro_params(launch={"command": SRUN}))
    env = job_env(cluster)
    repro = subprocess.Popen(
        [str(BIN / "dvc"), "repro", "pretrain"],
        cwd=root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 180
    while not any(root.glob(f"runs/.checkpoints/pretrain/*/*/{HASHES}")):
        assert repro.poll() is None and time.monotonic() < deadline, repro.communicate()[0]
        time.sleep(0.02)
    victims = task_pids("stages/pretrain.py", 1)
    assert victims, "no task 1 of pretrain found"
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    killed_out = repro.communicate(timeout=60)[0]
    lived_on = time.monotonic() - killed
    assert repro.returncode != 0, killed_out
    print(f"slurm: `dvc repro pretrain` failed {lived_on:.1f} s after task 1 was killed")

    script = root / "job.sh"
    script.write_text(
        "#!/bin/bash\n#SBATCH --ntasks=2\n#SBATCH --output=job-%j.out\nset -e\ndvc repro sft eval@pretrain\n"
    )
    job = cluster.run(["sbatch", "--parsable", str(script)], cwd=root, env=env).stdout.strip().split(";")[0]
    state = cluster.wait_job(job, timeout=300)
    log = (root / f"job-{job}.out").read_text()
    assert state == "COMPLETED", log
    return root, killed_out, lived_on, log


def test_stages_run_as_slurm_tasks_and_resume_after_a_task_dies(slurm_project, micro_data, pretrained):
    root, killed_out, lived_on, log = slurm_project
    # The dead task took its step down at once; the survivor did not wait on it.
    assert "task 1: Killed" in killed_out, killed_out
    assert lived_on < 30, killed_out
    assert not task_pids("stages/pretrain.py", 0) and not task_pids("stages/pretrain.py", 1)
    # The batch job resumed pretrain from its checkpoint, in both tasks, then ran sft as two tasks.
    assert log.count("resuming from step ") == 2, log
    assert read_json(root / "data/packed.provenance.json")["processes"] == 2
    for stage in ("pretrain", "sft"):
        assert read_json(root / f"runs/{stage}/provenance.json")["devices"]["processes"] == 2, stage
    # The same bytes as one process packs; the same training as one uninterrupted process trains.
    assert tree_bytes(root / "data/packed") == tree_bytes(micro_data / "packed")
    assert_trained_alike(root / "runs/pretrain", pretrained.parent)
    status = run([str(BIN / "dvc"), "status", "pretrain", "sft", "eval@pretrain"], root).stdout
    assert "up to date" in status, status


# --- S3 -------------------------------------------------------------------------------------------

BUCKET = "stagelm-test"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory):
    """moto's S3 server on a free loopback port, with an empty bucket; (its endpoint URL, a client)."""
    absent = [name for name in ("boto3", "moto", "dvc_s3") if importlib.util.find_spec(name) is None]
    if absent:
        slurm.skip_or_fail(f"needs the test extra (pip install -e '.[test]'; make setup installs it): no {absent[0]}")
    import boto3

    port = free_port()
    started = time.monotonic()
    log = open(tmp_path_factory.mktemp("moto") / "server.log", "wb")  # noqa: SIM115 (closed below)
    server = subprocess.Popen(
        [str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT
    )
    log.close()
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, "moto_server did not start"
                time.sleep(0.05)
        endpoint = f"http://127.0.0.1:{port}"
        s3 = boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )
        s3.create_bucket(Bucket=BUCKET)
        print(f"s3: moto_server up, bucket made, in {time.monotonic() - started:.2f} s")
        yield endpoint, s3
    finally:
        server.terminate()
        server.wait(timeout=10)


def s3_env(**extra: str) -> dict:
    """No credentials from this machine's environment or an instance's metadata service."""
    env = {k: v for k, v in env_with_venv().items() if not k.startswith("AWS_")}
    return {**env, "AWS_EC2_METADATA_DISABLED": "true", **extra}


def dvc(root: Path, *args: str, env: dict | None = None, check: bool = True, timeout: int = 120):
    return run([str(BIN / "dvc"), *args], root, env=env or s3_env(), check=check, timeout=timeout)


def test_a_model_pulled_from_s3_evaluates_without_retraining(slurm_project, s3_server, tmp_path):
    root = slurm_project[0]
    endpoint, s3 = s3_server
    dvc(root, "remote", "add", "-d", "storage", f"s3://{BUCKET}/store")
    run(["git", "add", ".dvc/config", "dvc.lock"], root)
    run(["git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "trained on slurm"], root)
    dvc(root, "remote", "modify", "--local", "storage", "endpointurl", endpoint)

    # A push killed mid-way leaves part of the cache on the remote; the next push completes it.
    push = subprocess.Popen(
        [str(BIN / "dvc"), "push", "--jobs", "1"], cwd=root, env=s3_env(**CREDENTIALS), stdout=subprocess.DEVNULL
    )
    while not s3.list_objects_v2(Bucket=BUCKET).get("KeyCount"):
        assert push.poll() is None, "the push ended before any object reached the remote"
        time.sleep(0.01)
    assert push.poll() is None, "the push finished before it could be killed"
    push.kill()
    push.wait()
    partial = s3.list_objects_v2(Bucket=BUCKET)["KeyCount"]
    dvc(root, "push", env=s3_env(**CREDENTIALS))
    complete = s3.list_objects_v2(Bucket=BUCKET)["KeyCount"]
    assert 0 < partial < complete
    assert "in sync" in dvc(root, "status", "-c", env=s3_env(**CREDENTIALS)).stdout

    clone = tmp_path / "clone"
    run(["git", "clone", "-q", str(root), str(clone)], tmp_path)
    dvc(clone, "remote", "modify", "--local", "storage", "endpointurl", endpoint)
    # Without credentials: DVC's own error, at once.
    started = time.monotonic()
    out = dvc(clone, "pull", "pretrain", check=False, timeout=60)
    assert out.returncode != 0 and time.monotonic() - started < 30
    assert "credentials" in out.stderr.lower(), out.stderr
    for key, name in (("access_key_id", "AWS_ACCESS_KEY_ID"), ("secret_access_key", "AWS_SECRET_ACCESS_KEY")):
        dvc(clone, "remote", "modify", "--local", "storage", key, CREDENTIALS[name])

    dvc(clone, "pull", "--with-deps", "pretrain")
    out = dvc(clone, "repro", "eval@pretrain", timeout=300).stdout
    ran = [line.split("'")[1] for line in out.splitlines() if line.startswith("Running stage")]
    assert ran == ["eval@pretrain"], out
    original, pulled = (read_json(r / "runs/eval/pretrain/metrics.json") for r in (root, clone))
    assert pulled == original
