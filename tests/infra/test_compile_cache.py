"""The persistent compilation cache every entry point uses (stagelm.infra.compile_cache)."""

import os
import subprocess
import sys
import textwrap

from stagelm.infra.compile_cache import cache_settings

# An entry point that compiles one program and prints how many compiles the cache served.
CHILD = """
import jax, jax.numpy as jnp
from jax import monitoring
from stagelm.infra.errors import run_main
hits = []
monitoring.register_event_listener(lambda event, **kw: hits.append(event) if event.endswith("cache_hits") else None)
def main():
    print(float(jax.jit(lambda x: jnp.sin(x) @ x.T)(jnp.ones((64, 64))).sum()), len(hits))
run_main(main, interrupted=None)
"""


def run_child(environ: dict[str, str]) -> tuple[str, int]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")} | environ
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CHILD)], env=env, text=True, capture_output=True, check=True
    )
    assert result.stderr == ""  # JAX warns on stderr where it cannot read or write the cache
    out = result.stdout.split()
    return out[0], int(out[1])


def test_defaults_fill_only_what_the_environment_leaves_unset(tmp_path):
    environ = {"XDG_CACHE_HOME": str(tmp_path)}
    settings = cache_settings(environ)
    folder = str(tmp_path / "stagelm" / "jax")
    assert environ["JAX_COMPILATION_CACHE_DIR"] == folder
    assert environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "0"
    assert settings == {"jax_compilation_cache_dir": folder, "jax_persistent_cache_min_compile_time_secs": 0.0}
    mine = {"JAX_COMPILATION_CACHE_DIR": "/elsewhere", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "2"}
    assert cache_settings(mine) == {"jax_compilation_cache_dir": "/elsewhere"}  # JAX read the user's minimum itself
    assert mine == {"JAX_COMPILATION_CACHE_DIR": "/elsewhere", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "2"}


def test_a_second_process_loads_what_the_first_compiled_and_computes_the_same(tmp_path):
    home = {"XDG_CACHE_HOME": str(tmp_path)}
    first, hits = run_child(home)
    assert hits == 0
    entries = sorted((tmp_path / "stagelm" / "jax").glob("*-cache"))  # one per executable
    assert entries, "the first run wrote nothing to the cache"
    second, hits = run_child(home)
    assert (second, hits) == (first, len(entries))  # every program the first compiled, loaded
    assert sorted((tmp_path / "stagelm" / "jax").glob("*-cache")) == entries  # and nothing compiled anew


def test_no_cache_where_its_default_folder_cannot_be_written(tmp_path):
    (tmp_path / "stagelm").write_text("a file where the folder would go")
    environ = {"XDG_CACHE_HOME": str(tmp_path)}
    assert cache_settings(environ) == {} and "JAX_COMPILATION_CACHE_DIR" not in environ
    out, hits = run_child(environ)
    assert hits == 0 and float(out) > 0


def test_an_empty_setting_turns_the_cache_off(tmp_path):
    off = {"XDG_CACHE_HOME": str(tmp_path), "JAX_COMPILATION_CACHE_DIR": ""}
    run_child(off)
    assert run_child(off)[1] == 0
    assert not (tmp_path / "stagelm").exists()
