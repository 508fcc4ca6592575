"""A real one-node SLURM cluster on loopback, for the tests that run stages under `srun` and `sbatch`.

Debian's `slurm-wlm` and `munge` packages provide the daemons: `munged` with a fresh key,
`slurmctld` and `slurmd`, every one run in the foreground of its own process, with all
state (config, key, sockets, spool, logs) in one folder. Clients find the cluster
through `SLURM_CONF`, which `Cluster.env()` sets. The node claims more CPUs than the
machine has, so a job of a few tasks runs on a 2-core machine; a job larger than the
node is refused at once (`EnforcePartLimits`) instead of waiting forever.

The daemons run as root (munge and slurmd need it): the tests skip, naming what is
missing, unless the packages are installed and the user is root, and fail instead of
skipping when `STAGELM_REQUIRE_CLUSTER_TESTS` is set (.ci/run sets it).
"""

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import free_port

DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd")
INSTALL = "apt-get install slurm-wlm munge"
REQUIRED = "STAGELM_REQUIRE_CLUSTER_TESTS"
CPUS = 8  # what the node claims: enough for two jobs of a few tasks


def missing() -> str | None:
    """Why a cluster cannot start on this machine, or None when it can."""
    absent = [name for name in DAEMONS if not shutil.which(name, path=f"/usr/sbin:/usr/bin:{os.environ['PATH']}")]
    if absent:
        return f"needs Debian's slurm-wlm and munge ({INSTALL}; .ci/run installs them): {', '.join(absent)} not found"
    if os.geteuid() != 0:
        return "needs root: munged and slurmd run as root"
    return None


def skip_or_fail(reason: str) -> None:
    """Skip with `reason`, or fail when the environment asks for these tests to run."""
    if os.environ.get(REQUIRED):
        pytest.fail(f"{reason} ({REQUIRED} is set: these tests must run)")
    pytest.skip(reason)


def sbin(name: str) -> str:
    return shutil.which(name, path=f"/usr/sbin:/usr/bin:{os.environ['PATH']}") or name


class Cluster:
    """munged, slurmctld and slurmd under `root`; `stop()` ends every daemon by its pid."""

    def __init__(self, root: Path, timeout: float = 30.0):
        self.root = root
        self.procs: list[subprocess.Popen] = []
        started = time.monotonic()
        for sub in ("munge", "spool/ctld", "spool/d", "log"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        (root / "munge").chmod(0o755)  # munged refuses a socket folder others can write to, clients need to enter it
        self.socket = root / "munge/munge.socket.2"
        key = root / "munge/munge.key"
        subprocess.run([sbin("mungekey"), "--create", f"--keyfile={key}"], check=True, capture_output=True, timeout=30)
        ports = [free_port(), free_port()]
        self.conf = root / "slurm.conf"
        self.conf.write_text(self.config(ports))
        env = self.env()
        munge = [sbin("munged"), "--foreground", "--force", f"--key-file={key}", f"--socket={self.socket}"]
        munge += [f"--pid-file={root / 'munge/munged.pid'}", f"--log-file={root / 'log/munged.log'}"]
        munge += [f"--seed-file={root / 'munge/munged.seed'}"]
        self.start(munge, env)
        self.wait(lambda: self.socket.exists(), "munged's socket", timeout)
        self.start([sbin("slurmctld"), "-D", "-i", "-f", str(self.conf)], env)
        self.start([sbin("slurmd"), "-D", "-N", "localhost", "-f", str(self.conf)], env)
        self.wait(self.node_idle, "the node to be idle", timeout)
        self.start_seconds = time.monotonic() - started

    def config(self, ports: list[int]) -> str:
        r = self.root
        return "\n".join(
            [
                "ClusterName=stagelm-test",
                "SlurmctldHost=localhost",
                "SlurmUser=root",
                "SlurmdUser=root",
                f"SlurmctldPort={ports[0]}",
                f"SlurmdPort={ports[1]}",
                "AuthType=auth/munge",
                "CredType=cred/munge",
                f"AuthInfo=socket={self.socket}",
                f"StateSaveLocation={r / 'spool/ctld'}",
                f"SlurmdSpoolDir={r / 'spool/d'}",
                f"SlurmctldPidFile={r / 'slurmctld.pid'}",
                f"SlurmdPidFile={r / 'slurmd.pid'}",
                f"SlurmctldLogFile={r / 'log/slurmctld.log'}",
                f"SlurmdLogFile={r / 'log/slurmd.log'}",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "JobAcctGatherType=jobacct_gather/none",
                "AccountingStorageType=accounting_storage/none",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_CPU",
                "ReturnToService=2",
                "EnforcePartLimits=ALL",
                "MpiDefault=none",
                "SlurmdParameters=config_overrides",
                # Every fresh cluster numbers jobs from here: a random start keeps two clusters'
                # jobs (and JAX's default coordinator port, derived from the job id) apart.
                f"FirstJobId={int.from_bytes(os.urandom(2), 'big') + 1}",
                "InactiveLimit=0",
                "KillWait=5",
                "MinJobAge=300",
                f"NodeName=localhost NodeAddr=127.0.0.1 CPUs={CPUS} State=UNKNOWN",
                "PartitionName=test Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO",
                "",
            ]
        )

    def env(self, base: dict | None = None) -> dict:
        """`base` (default: this process's environment) with the variables a SLURM client needs."""
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.conf)
        for name in [k for k in env if k.startswith("SLURM_") and k != "SLURM_CONF"]:
            del env[name]  # a test run from inside a job must not hand that job's ids to this cluster's
        return env

    def start(self, cmd: list[str], env: dict) -> None:
        log = open(self.root / "log" / f"{Path(cmd[0]).name}.out", "wb")  # noqa: SIM115 (closed with the process)
        self.procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        log.close()

    def wait(self, ready, what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [p for p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                logs = "\n".join(f"{p.name}:\n{p.read_text()[-2000:]}" for p in sorted((self.root / "log").iterdir()))
                self.stop()
                raise RuntimeError(f"the test cluster did not start: waiting for {what}\n{logs}")
            time.sleep(0.05)

    def node_idle(self) -> bool:
        out = self.run(["sinfo", "-h", "-o", "%t"], check=False)
        return out.returncode == 0 and out.stdout.strip() == "idle"

    def run(self, cmd: list[str], check: bool = True, timeout: float = 30, env: dict | None = None, **kwargs):
        """A SLURM client command against this cluster; every call has a timeout (srun blocks if slurmd died)."""
        result = subprocess.run(
            cmd, env=self.env(env), capture_output=True, text=True, timeout=timeout, check=False, **kwargs
        )
        if check and result.returncode != 0:
            raise AssertionError(f"{cmd} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
        return result

    def wait_job(self, job_id: str, timeout: float) -> str:
        """The job's final state (COMPLETED, FAILED, ...), polled with `scontrol`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = self.run(["scontrol", "-o", "show", "job", job_id], check=False).stdout
            state = next((f.split("=", 1)[1] for f in out.split() if f.startswith("JobState=")), "")
            if state and state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
                return state
            time.sleep(0.2)
        self.run(["scancel", job_id], check=False)
        raise AssertionError(f"job {job_id} still running after {timeout} s")

    def stop(self) -> None:
        """End every daemon (SIGTERM, then SIGKILL) and reap it."""
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()
