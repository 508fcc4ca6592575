"""Check that `make repro` reproduced the committed dvc.lock entries of the data stages.

params, download, tokenizer and pack are deterministic, so on a clean clone their dvc.lock
entries (deps, params and the md5 of every output other stages read) must come out
as committed; only their provenance files (times, commit) may differ. A change to
their code, params or libraries must therefore commit the dvc.lock it produces, and a
library release cannot move the bytes unnoticed (docs/reproducibility.md).
"""

import subprocess
import sys

import yaml

STAGES = ("params", "download", "tokenizer", "pack")


def stable(entry: dict) -> dict:
    """A dvc.lock stage entry without the outputs that record times (`*.provenance.json`)."""
    outs = [o for o in entry.get("outs", []) if not o["path"].endswith("provenance.json")]
    return {**entry, "outs": outs}


def differences(before: list | dict | str | None, after: list | dict | str | None) -> str:
    """What changed in one key of an entry: the paths whose md5 moved, came or went, else both values."""
    if isinstance(before, list) and isinstance(after, list):
        old = {e["path"]: e.get("md5") for e in before}
        new = {e["path"]: e.get("md5") for e in after}
        moved = [p for p in old.keys() & new.keys() if old[p] != new[p]]
        parts = [
            f"md5 of {sorted(moved)}" if moved else "",
            f"new {sorted(new.keys() - old.keys())}" if new.keys() - old.keys() else "",
            f"gone {sorted(old.keys() - new.keys())}" if old.keys() - new.keys() else "",
        ]
        return "; ".join(p for p in parts if p)
    return f"committed {before!r}, reproduced {after!r}"


def locks() -> tuple[dict, dict]:
    """The stages of dvc.lock as committed at HEAD, and as the workspace holds it now."""
    committed = yaml.safe_load(
        subprocess.run(["git", "show", "HEAD:dvc.lock"], capture_output=True, text=True, check=True).stdout
    )["stages"]
    with open("dvc.lock") as f:
        reproduced = yaml.safe_load(f)["stages"]
    return committed, reproduced


def main() -> None:
    committed, reproduced = locks()
    failed = False
    for name in STAGES:
        before, after = stable(committed.get(name, {})), stable(reproduced.get(name, {}))
        if before == after:
            print(f"ok: dvc.lock {name}: as committed")
            continue
        failed = True
        for key in ("cmd", "deps", "params", "outs"):
            if before.get(key) != after.get(key):
                print(f"FAIL: dvc.lock {name}.{key}: {differences(before.get(key), after.get(key))}")
    if failed:
        sys.exit(
            "dvc.lock: the data stages did not reproduce the committed entries; commit the new dvc.lock "
            "with the change that moved them"
        )


if __name__ == "__main__":
    main()
