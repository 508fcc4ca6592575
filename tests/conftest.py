"""Shared fixtures: micro params, micro data built through the real stage code, project copies.

Eight simulated CPU devices are requested before JAX is imported anywhere, so the
sharding tests can build real meshes; single-device tests use a one-device mesh.

One persistent JAX compilation cache serves the whole session: this process, the
pytest-xdist workers (they inherit the environment) and every stage subprocess the
tests start. A stage run again on the same shapes (a resume, a `dvc repro` after a
params change) then loads its executables instead of compiling them; the results are
the same executables, so every bitwise comparison still holds. The cache starts empty
each session and is removed at its end.
"""

import atexit
import os
import shutil
import tempfile

# XLA:CPU's backend at optimisation level 0, in this process and every one a test starts:
# the suite's programs are micro-sized and compiled by the thousand, so LLVM's passes cost
# far more than they save (tests/model/test_decoder.py and test_train.py: 30 s -> 17 s). Every process
# compiles alike, so comparisons between them still hold; `dvc repro` keeps XLA's defaults.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # the first process of the session makes it
    _cache = tempfile.mkdtemp(prefix="stagelm-test-jax-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"  # micro shapes compile in well under 1 s

import copy
import runpy
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from flax import nnx

from stagelm.train.checkpoints import HASHES

ROOT = Path(__file__).resolve().parents[1]
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"  # as above, for the processes a test starts
BIN = Path(sys.executable).parent

# The slowest test files, slowest first: their tests' seconds summed by file (`pytest --durations=0`),
# not their length. `-n 2 --dist loadfile` hands out whole files, and xdist by default hands out first
# the files with the most tests: the pipeline files, with few tests of minutes each, then started last
# and ran alone while the other worker idled (test_dvc_experiments.py's 292 s began with about 40 s of
# other work left: 1,070 s in all on a 185 GFLOP/s machine). Handed out slowest first, the quick files
# fill in at the end. A file missing here only runs later; test_dvc_repro.py leads because it builds
# the project the other test_dvc_*.py files then use. Those are one or two long tests a file: as one
# file (611 s in CI) they could only start once the build (234 s) was done, so no run could end
# before about 845 s however the rest was spread.
SLOWEST_FIRST = (
    "tests/pipeline/test_dvc_repro.py",
    "tests/interop/test_real_model.py",
    "tests/pipeline/test_dvc_experiments.py",
    "tests/pipeline/test_dvc_queue.py",
    "tests/post/test_grpo.py",
    "tests/interop/test_lm_eval_real.py",
    "tests/post/test_distill.py",
    "tests/test_cluster.py",
    "tests/train/test_pretrain_stage.py",
    "tests/infra/test_distributed.py",
    "tests/interop/test_hf.py",
    "tests/infer/test_serve.py",
    "tests/post/test_sft.py",
    "tests/measure/test_harness.py",
    "tests/model/test_attention_kernels.py",
)


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config.option, "loadscopereorder"):  # xdist's controller: keep the order below
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    stale = [path for path in SLOWEST_FIRST if not (ROOT / path).is_file()]
    if stale:  # a renamed file would silently lose its place, and the suite its time
        raise pytest.UsageError(f"tests/conftest.py SLOWEST_FIRST: no file {stale[0]}; rename or drop the entry")
    rank = {path: i for i, path in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest as collected


MICRO = {
    "data": {
        "num_documents": 400,
        "num_sft": 200,
        "num_rl": 40,
        "num_eval": 40,
        "val_fraction": 0.1,
        # more than the default set: the tests reward one family and check the others hold
        "families": ["arithmetic", "uses_word", "word_limit"],
    },
    "tokenizer": {"vocab_size": 300},
    "pack": {"seq_len": 64, "rows_per_shard": 32},
    "model": {"d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "d_ff": 64},
    "training": {
        "steps": 12,
        "batch_size": 8,
        "warmup_steps": 2,
        "eval_every": 4,
        "eval_batches": 2,
        "log_every": 2,
        "checkpoint_every": 4,
        "keep_checkpoints": 2,
        "lr": 3e-3,
    },
    "eval": {
        "batch_size": 8,
        "task_batch_size": 32,
        "max_new_tokens": 12,
        "pass_k": 4,
        "pass_k_prompts": 10,
        "temperatures": [0.5, 1.0],
        "temperature_prompts": 10,
    },
    "sample": {
        "max_new_tokens": 16,
        "prompts": ["Once upon a time,", "Work out 41 plus 17:"],
        "chat_prompts": ["What is 41 plus 17?"],
    },
    "sft": {
        "steps": 10,
        "batch_size": 8,
        "warmup_steps": 2,
        "eval_every": 5,
        "eval_batches": 2,
        "log_every": 2,
        "checkpoint_every": 5,
        "lora": {"rank": 4, "alpha": 8.0, "dropout": 0.0, "targets": ["q", "kv", "o", "gate_up", "down"]},
    },
    "distill": {
        "steps": 10,
        "batch_size": 8,
        "warmup_steps": 2,
        "eval_every": 5,
        "eval_batches": 2,
        "log_every": 2,
        "checkpoint_every": 5,
        "student": {"d_model": 32, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2, "d_ff": 32, "vocab_size": None},
    },
    "benchmark": {
        "vocab_size": 300,
        "d_model": 32,
        "n_layers": 2,
        "n_heads": 4,
        "n_kv_heads": 2,
        "d_ff": 64,
        "seq_len": 64,
        "batch_size": 4,
        "new_tokens": 8,
        "matmul_size": 256,
        "warmup": 1,
    },
    "dpo": {  # the micro policy never answers right: its pairs prefer the rl set's reference answers
        "families": ["arithmetic"],
        "reference_answers": True,
        "prompts": 16,
        "samples": 4,
        "max_new_tokens": 12,
        "sample_rows": 32,
        "batch_size": 4,
        "steps": 6,
        "warmup_steps": 1,
        "eval_every": 6,
        "eval_batches": 2,
        "log_every": 2,
        "checkpoint_every": 3,
        "lora": {"rank": 4, "alpha": 8.0, "dropout": 0.0, "targets": ["q", "kv", "o", "gate_up", "down"]},
    },
    "grpo": {
        "prompts_per_step": 8,
        "group_size": 4,
        "max_new_tokens": 12,
        "steps": 6,
        "warmup_steps": 1,
        "eval_every": 6,
        "eval_batches": 2,
        "log_every": 2,
        "checkpoint_every": 2,
        "anchor_rows": 4,
    },
}


def shipped_params() -> dict:
    return yaml.safe_load((ROOT / "params.yaml").read_text())


def micro_params(**overrides: dict) -> dict:
    """The shipped params.yaml with the micro sizes (and `overrides`, per section) applied."""
    params = shipped_params()
    for section, values in list(MICRO.items()) + list(overrides.items()):
        if isinstance(values, dict):
            params[section] = {**params[section], **copy.deepcopy(values)}
        else:
            params[section] = values
    return params


@nnx.jit
def forward(model, tokens, segment_ids, positions):
    """A decoder's logits through one jitted pass, as the stages run it. Run op by op, each of
    the pass's ~100 ops would compile on its own, ~0.1 s apiece on a 2-core CPU."""
    return model(tokens, segment_ids, positions)


def micro_decoder(micro_data: Path):
    """(a random micro decoder, the micro tokenizer): the shape the generator, engine and lm-eval tests run."""
    from flax import nnx

    from stagelm.data.tokenizer import load_tokenizer
    from stagelm.model.decoder import Decoder, DecoderConfig

    tok = load_tokenizer(micro_data / "tokenizer/tokenizer.json")
    cfg = DecoderConfig(
        vocab_size=tok.get_vocab_size(), d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, init_std=0.2
    )
    return Decoder(cfg, nnx.Rngs(0)), tok


def write_params(path: Path, params: dict) -> Path:
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    return path


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_with_venv() -> dict:
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env['PATH']}"
    env["XLA_FLAGS"] = TEST_XLA_FLAGS  # stage processes see the real device count
    return env


def run(cmd: list[str], cwd: Path, check: bool = True, env: dict | None = None, timeout: int = 600):
    result = subprocess.run(cmd, cwd=cwd, env=env or env_with_venv(), capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"{cmd} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result


def kill_after_first_checkpoint(cmd: list[str], cwd: Path, checkpoints: Path) -> None:
    """Start a training stage and SIGKILL it as soon as its first checkpoint is committed
    (the step folder's hashes written: stagelm.train.checkpoints)."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env_with_venv(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if any(checkpoints.glob(f"*/*/{HASHES}")):
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"


def run_in_process(cmd: list[str], capsys) -> tuple[int, str]:
    """Run a stage command (`python stages/x.py ...`) inside this process: (exit code, stderr).

    For failures that happen before any compute (bad params, bad inputs): it skips the
    interpreter start-up and imports a subprocess pays, and checks the same exit code
    and message.
    """
    script, args = cmd[1], cmd[2:]
    saved = sys.argv
    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    finally:
        sys.argv = saved
    return code, capsys.readouterr().err


def make_project(dest: Path, params: dict) -> Path:
    """A git + DVC copy of the project's tracked files at `dest`, with `params` as params.yaml."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    others = subprocess.run(
        ["git", "ls-files", "-z", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True, check=True
    ).stdout.split(b"\0")
    for name in filter(None, files + others):
        src = ROOT / name.decode()
        if src.is_file():
            target = dest / name.decode()
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)
    (dest / "dvc.lock").unlink(missing_ok=True)
    write_params(dest / "params.yaml", params)
    for cmd in (
        ["git", "init", "-q"],
        ["git", "add", "-A"],
        ["git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "init"],
    ):
        run(cmd, dest)
    return dest


def run_data_stages(root: Path) -> Path:
    """data/{raw,tokenizer,packed} under `root` from `root/params.yaml`, made by the real stage scripts."""
    params, py = str(root / "params.yaml"), sys.executable
    run([py, str(ROOT / "stages/download.py"), "--params", params, "--out", "data/raw"], root)
    run(
        [py, str(ROOT / "stages/tokenizer.py"), "--params", params, "--raw", "data/raw", "--out", "data/tokenizer"],
        root,
    )
    pack = [py, str(ROOT / "stages/pack.py"), "--params", params, "--raw", "data/raw", "--tokenizer", "data/tokenizer"]
    run([*pack, "--out", "data/packed"], root)
    return root / "data"


def tree_bytes(folder: Path) -> dict[str, bytes]:
    """Every file under `folder`, relative path → bytes: two folders are identical when these are equal."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def built_once(tmp_path_factory, name: str, build: Callable[[Path], Path]) -> Path:
    """`build(folder)`'s result, made once for the whole test run however many xdist workers need
    it: the first to ask builds it in the run's shared temp folder under a file lock, the others
    wait for it and read the same files (which no test may change; tests copy what they edit)."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder, done = shared / name, shared / f"{name}.done"
    with FileLock(str(shared / f"{name}.lock")):
        if not done.is_file():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            result = build(folder)
            done.write_text(str(result.relative_to(folder)))
    return folder / done.read_text()


def make_micro_data(root: Path) -> Path:
    (root / "inputs").mkdir()  # data.inputs: `stagelm check` run there wants the folder the download depends on
    write_params(root / "params.yaml", micro_params())
    return run_data_stages(root)


@pytest.fixture(scope="session")
def micro_data(tmp_path_factory) -> Path:
    """data/{raw,tokenizer,packed} of the micro params, made by the real stage scripts (once a run)."""
    return built_once(tmp_path_factory, "micro_data", make_micro_data)


@pytest.fixture(scope="session")
def pretrained(micro_data, tmp_path_factory):
    """A micro model trained by the real pretrain stage (the SFT base and the distillation teacher), once a run."""
    return built_once(tmp_path_factory, "pretrained", lambda work: pretrain_micro(micro_data, work))


def pretrain_micro(micro_data: Path, work: Path) -> Path:
    write_params(work / "params.yaml", micro_params())
    run(
        [
            sys.executable,
            str(ROOT / "stages/pretrain.py"),
            "--params",
            "params.yaml",
            "--train",
            str(micro_data / "packed/train"),
            "--val",
            str(micro_data / "packed/val"),
            "--tokenizer",
            str(micro_data / "tokenizer/tokenizer.json"),
            "--out",
            "out",
            "--checkpoints",
            "ckpt",
        ],
        work,
    )
    return work / "out/model"


@pytest.fixture(scope="session")
def built_project(tmp_path_factory):
    """A micro project after one full `dvc repro` (copied per test, .dvc/cache included), once a run."""
    return built_once(tmp_path_factory, "project", build_project)


def build_project(folder):
    root = make_project(folder / "stagelm", micro_params())
    run(["dvc", "repro"], root)
    run(["git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qam", "repro"], root)  # as a user would
    return root


@pytest.fixture
def project(built_project, tmp_path):
    dest = tmp_path / "stagelm"
    shutil.copytree(built_project, dest, symlinks=True)
    return dest
