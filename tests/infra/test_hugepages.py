"""Huge pages for malloc: when an entry point restarts itself, and what it buys (stagelm.infra.hugepages)."""

import os
import subprocess
import sys
import textwrap

from stagelm.infra.hugepages import THP_MODE, TUNABLE, glibc_version, huge_pages_help


def this_machine_helps() -> bool:
    """Whether the tunable changes anything here, whatever this process's own environment."""
    try:
        mode = THP_MODE.read_text()
    except OSError:
        return False
    return sys.platform == "linux" and huge_pages_help({}, glibc_version(), mode)


def run_child(code: str, tunables: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    if tunables is not None:
        env["GLIBC_TUNABLES"] = tunables
    cmd = [sys.executable, "-c", textwrap.dedent(code), "a b", "--flag"]
    return subprocess.run(cmd, env=env, text=True, capture_output=True, check=True).stdout


def test_huge_pages_help_only_where_the_tunable_changes_something():
    madvise = "always [madvise] never\n"
    assert huge_pages_help({}, (2, 36), madvise)
    assert huge_pages_help({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, (2, 40), madvise)
    assert not huge_pages_help({"GLIBC_TUNABLES": f"{TUNABLE}=0"}, (2, 36), madvise)  # the caller's choice stands
    assert not huge_pages_help({}, (2, 34), madvise)  # the tunable is new in glibc 2.35
    assert not huge_pages_help({}, None, madvise)  # musl and others
    assert not huge_pages_help({}, (2, 36), "[always] madvise never\n")
    assert not huge_pages_help({}, (2, 36), "always madvise [never]\n")


def test_an_entry_point_restarts_itself_once_with_the_tunable_and_its_arguments():
    code = """
        import os, sys
        from stagelm.infra.errors import run_main
        print("start", os.getpid(), flush=True)
        run_main(lambda: print("run", os.getpid(), os.environ.get("GLIBC_TUNABLES"), sys.argv[1:]))
    """
    lines = run_child(code, "glibc.malloc.arena_max=4").splitlines()
    runs = [line for line in lines if line.startswith("run ")]
    assert len(runs) == 1
    starts = {line.split()[1] for line in lines if line.startswith("start ")}
    assert starts == {runs[0].split()[1]}  # os.execve: the same process
    if this_machine_helps():
        assert len(lines) == 3  # started twice, ran once
        assert runs[0].endswith(f"glibc.malloc.arena_max=4:{TUNABLE}=1 ['a b', '--flag']")
    else:
        assert lines[0].startswith("start ") and len(lines) == 2
        assert runs[0].endswith("glibc.malloc.arena_max=4 ['a b', '--flag']")
    kept = run_child(code, f"{TUNABLE}=0").splitlines()
    assert len(kept) == 2 and kept[1].endswith(f"{TUNABLE}=0 ['a b', '--flag']")


def test_huge_pages_cut_the_page_faults_of_a_jitted_step():
    """A gradient whose 64 MiB activation XLA allocates afresh on every call."""
    code = """
        import resource, jax, jax.numpy as jnp
        grad = jax.jit(jax.grad(lambda w, x: jnp.sum(jnp.tanh(x @ w) @ w.T)))
        x, w = jnp.full((4096, 128), 0.01), jnp.full((128, 4096), 0.01)
        grad(w, x).block_until_ready()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(4):
            grad(w, x).block_until_ready()
        print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 4)
    """
    small_pages = float(run_child(code, f"{TUNABLE}=0"))
    huge_pages = float(run_child(code, f"{TUNABLE}=1"))
    assert small_pages > 10_000  # 4 KiB pages: one fault per page of each fresh buffer
    if this_machine_helps():
        assert huge_pages * 5 < small_pages, (huge_pages, small_pages)
    else:
        assert huge_pages > small_pages / 2
