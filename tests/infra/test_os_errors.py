"""A full disk, a read-only folder, a path that is a file: one line naming the path, exit 2,
and what existed before still there.

The full disk is real where the tests run as root (CI does): a small tmpfs mounted for
the test. Everywhere else ENOSPC is injected where files are written, so the message
is checked on any machine.
"""

import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, micro_params, run, run_in_process, tree_bytes, write_params

from stagelm.infra import files

ROOT_ONLY = "mounts a tmpfs: needs root (CI runs as root)"


@pytest.fixture
def mount(tmp_path):
    """mount(size, read_only=False) -> a fresh tmpfs folder of `size` bytes; unmounted afterwards."""
    if os.geteuid() != 0:
        if os.environ.get("CI"):
            pytest.fail(ROOT_ONLY)
        pytest.skip(ROOT_ONLY)
    mounted = []

    def make(size: int, read_only: bool = False) -> Path:
        point = tmp_path / f"fs{len(mounted)}"
        point.mkdir()
        options = f"size={size}" + (",ro" if read_only else "")
        subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)], check=True)
        mounted.append(point)
        return point

    yield make
    for point in reversed(mounted):
        subprocess.run(["umount", "-l", str(point)], check=False)


def folder_size(path: Path) -> int:
    """Bytes `path` takes on a tmpfs: whole 4 KiB pages per file."""
    return sum(-(-p.stat().st_size // 4096) * 4096 for p in path.rglob("*") if p.is_file())


def stage(script: str, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return run([sys.executable, str(ROOT / "stages" / script), "--params", "params.yaml", *args], cwd, check=False)


def one_line(result: subprocess.CompletedProcess, *words: str) -> None:
    err = result.stderr
    assert result.returncode == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    assert "Traceback" not in err and all(w in err for w in words), err


def test_download_and_pack_on_a_full_disk_keep_what_was_there(micro_data, tmp_path, mount):
    disk = mount(folder_size(micro_data / "raw") + folder_size(micro_data / "packed") + (64 << 10))
    shutil.copytree(micro_data / "raw", disk / "raw")
    shutil.copytree(micro_data / "packed", disk / "packed")
    before = tree_bytes(disk)
    (tmp_path / "inputs").mkdir()
    write_params(tmp_path / "params.yaml", micro_params(data={"seed": 1}, pack={"seq_len": 32}))
    download = stage("download.py", tmp_path, "--out", str(disk / "raw"))
    one_line(download)  # refused by its estimate of the corpus' bytes, or when the disk fills
    assert "no space left on the device" in download.stderr or "on disk, but" in download.stderr
    tokenizer = str(micro_data / "tokenizer")
    packed = str(disk / "packed")
    one_line(  # the line names the file the disk could not take (a failed write carries no name of its own)
        stage("pack.py", tmp_path, "--raw", str(disk / "raw"), "--tokenizer", tokenizer, "--out", packed),
        f"{disk}/",
        "no space",
    )
    assert tree_bytes(disk) == before  # the old download and all three old splits, nothing half-written beside
    assert sorted(p.name for p in disk.iterdir()) == ["packed", "raw"]


def test_training_checkpoints_and_exports_on_a_full_disk_are_one_line(pretrained, micro_data, tmp_path, mount):
    write_params(tmp_path / "params.yaml", micro_params())
    packed, tokenizer = micro_data / "packed", micro_data / "tokenizer/tokenizer.json"
    disk = mount(64 << 10)
    args = ["--train", str(packed / "train"), "--val", str(packed / "val"), "--tokenizer", str(tokenizer)]
    result = stage("pretrain.py", tmp_path, *args, "--out", "out", "--checkpoints", str(disk / "ckpt"))
    one_line(result, str(disk), "no space left on the device")
    export = run(["stagelm", "export-hf", str(pretrained), str(disk / "hf")], tmp_path, check=False)
    one_line(export, f"{disk}/", "no space left on the device")
    assert not [p for p in disk.iterdir() if p.name.endswith("hf") or "export" in p.name]
    run(["stagelm", "export-hf", str(pretrained), str(tmp_path / "hf")], tmp_path)
    imported = run(["stagelm", "import-hf", str(tmp_path / "hf"), str(disk / "imported")], tmp_path, check=False)
    one_line(imported, f"{disk}/", "no space left on the device")
    assert not [p for p in disk.iterdir() if "import" in p.name]  # no folder, empty or half-written


def test_a_read_only_folder_is_one_line(micro_data, pretrained, tmp_path, mount):
    disk = mount(1 << 20, read_only=True)
    (tmp_path / "inputs").mkdir()
    write_params(tmp_path / "params.yaml", micro_params())
    one_line(stage("download.py", tmp_path, "--out", str(disk / "raw")), "read-only; write to a writable folder")
    one_line(stage("params.py", tmp_path, "--out", str(disk / "stamp.json")), "read-only")
    one_line(run(["stagelm", "export-hf", str(pretrained), str(disk / "hf")], tmp_path, check=False), "read-only")
    run(["stagelm", "export-hf", str(pretrained), str(tmp_path / "hf")], tmp_path)
    one_line(run(["stagelm", "import-hf", str(tmp_path / "hf"), str(disk / "m")], tmp_path, check=False), "read-only")


def test_an_injected_full_disk_is_one_line_anywhere(monkeypatch, capsys, tmp_path):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "stamp.json"))

    monkeypatch.setattr(files.tempfile, "mkstemp", full)
    (tmp_path / "inputs").mkdir()
    monkeypatch.chdir(tmp_path)
    write_params(tmp_path / "params.yaml", micro_params())
    code, err = run_in_process([sys.executable, str(ROOT / "stages/params.py"), "--out", "stamp.json"], capsys)
    assert code == 2 and err == (
        f"error: {tmp_path / 'stamp.json'}: no space left on the device; "
        "free some (old runs/.checkpoints, `dvc gc`) and rerun\n"
    )


def test_paths_that_are_files_or_dirs_where_the_other_is_wanted(micro_data, pretrained, tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    for cmd in (
        ["stagelm", "generate", str(a_file), "--prompt", "x"],
        ["stagelm", "serve", str(a_file), "--port", "0"],
    ):
        one_line(run(cmd, tmp_path, check=False), f"{a_file}: a file, not a model folder")
    one_line(run(["stagelm", "import-hf", str(pretrained), str(a_file)], tmp_path, check=False), "a file, not a folder")
    lineage = run(["stagelm", "lineage", "x", "--lock", str(tmp_path)], tmp_path, check=False)
    one_line(lineage, str(tmp_path))
    (tmp_path / "inputs").mkdir()
    write_params(tmp_path / "params.yaml", micro_params())
    one_line(stage("download.py", tmp_path, "--out", str(a_file / "raw")), "not a folder")
