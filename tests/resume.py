"""The harness every training stage's resume test shares: a run killed after its first checkpoint
and rerun, beside the same run left whole, and the check that both end in the same bytes."""

from collections.abc import Callable
from pathlib import Path

from conftest import kill_after_first_checkpoint, run, tree_bytes, write_params


def killed_and_whole(tmp_path: Path, params: dict, command: Callable[[Path], list[str]]) -> tuple[Path, Path, str]:
    """(killed folder, whole folder, the rerun's output): `command(work)` run whole in one folder, and
    in another SIGKILLed once its first checkpoint is committed, then run again, which must resume."""
    killed, whole = tmp_path / "killed", tmp_path / "whole"
    for work in (killed, whole):
        work.mkdir()
        write_params(work / "params.yaml", params)
    run(command(whole), whole)
    kill_after_first_checkpoint(command(killed), killed, killed / "ckpt")
    resumed = run(command(killed), killed).stdout
    assert "resuming from step" in resumed, resumed
    return killed, whole, resumed


def assert_same_outputs(killed: Path, whole: Path, *folders: str) -> None:
    """The resumed run's output folders (`out/<folder>`) hold the uninterrupted run's bytes, file
    for file: the same weights, and for DVC the same model."""
    for folder in folders:
        a, b = tree_bytes(killed / "out" / folder), tree_bytes(whole / "out" / folder)
        assert a.keys() == b.keys(), (folder, sorted(a.keys() ^ b.keys()))
        different = sorted(name for name in a if a[name] != b[name])
        assert not different, f"out/{folder}: {different} differ after resume"
