"""A persistent XLA compilation cache for every stage and command.

Stages compile what others compiled before them: the eval and sample stages read four
models of the default pipeline's shape (and two of the student's), `dvc exp run` reruns
stages with new params on the same shapes, and a resumed run compiles its step again.
With `jax_compilation_cache_dir` set, JAX keeps each compiled executable on disk, keyed
by the program, the JAX and XLA versions, the XLA flags and the device, and a later
compile of the same program loads it. The executable is the same, so are its results,
bit for bit: only the time changes (eval@sft of the default run, 40.7 s with the cache
empty, 27.4 s with it filled; docs/speed.md).

Where it lives: `$JAX_COMPILATION_CACHE_DIR` where set (set empty, it is off), else
`$XDG_CACHE_HOME/stagelm/jax` (`~/.cache/stagelm/jax`; delete it at any time; where it
cannot be written, no cache). Every
compile is kept however short it was (`JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`, JAX's
default 1 s, would skip most of a CPU stage's). A setting in the environment is kept;
these are JAX's own variables. No size limit is set: with one
(`JAX_COMPILATION_CACHE_MAX_SIZE`) JAX's eviction reads a timestamp file beside every
entry, and fails on each write where any process without the limit has written entries
(a warning on stderr, the executable not kept).
"""

import os
import sys
from pathlib import Path


def default_dir(environ: dict[str, str]) -> Path:
    base = environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "stagelm" / "jax"


def cache_settings(environ: dict[str, str]) -> dict[str, object]:
    """The cache's defaults, set in `environ` where it leaves them unset (JAX reads them at
    import, as do the processes a stage starts), and the JAX config values this process must
    take for them if JAX is imported already; none where the default folder cannot be made or
    written (JAX would warn at every compile)."""
    if "JAX_COMPILATION_CACHE_DIR" not in environ:
        folder = default_dir(environ)
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError:
            return {}
        if not os.access(folder, os.W_OK):
            return {}
        environ["JAX_COMPILATION_CACHE_DIR"] = str(folder)
    settings: dict[str, object] = {"jax_compilation_cache_dir": environ["JAX_COMPILATION_CACHE_DIR"] or None}
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in environ:
        environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
        settings["jax_persistent_cache_min_compile_time_secs"] = 0.0
    return settings


def use_compile_cache() -> None:
    """This process's cache, in its environment and, where JAX is imported, its config: nothing has compiled yet."""
    settings = cache_settings(os.environ)
    jax = sys.modules.get("jax")
    for name, value in settings.items() if jax is not None else ():
        jax.config.update(name, value)
