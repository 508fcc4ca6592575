"""Check that `make repro` reproduced the committed dvc.lock entries of the data stages.

download, tokenizer and pack are deterministic, so on a clean clone their dvc.lock
entries (deps, params and the md5 of every output other stages read) must come out
as committed; only their provenance files (times, commit) may differ. A change to
their code, params or libraries must therefore commit the dvc.lock it produces, and a
library release cannot move the bytes unnoticed (README, "What is reproducible").
"""

import subprocess
import sys

import yaml

STAGES = ("download", "tokenizer", "pack")


def stable(entry: dict) -> dict:
    """A dvc.lock stage entry without the outputs that record times (`*.provenance.json`)."""
    outs = [o for o in entry.get("outs", []) if not o["path"].endswith("provenance.json")]
    return {**entry, "outs": outs}


def main() -> None:
    committed = yaml.safe_load(
        subprocess.run(["git", "show", "HEAD:dvc.lock"], capture_output=True, text=True, check=True).stdout
    )["stages"]
    with open("dvc.lock") as f:
        reproduced = yaml.safe_load(f)["stages"]
    failed = False
    for name in STAGES:
        before, after = stable(committed.get(name, {})), stable(reproduced.get(name, {}))
        if before == after:
            print(f"ok: dvc.lock {name}: as committed")
            continue
        failed = True
        for key in ("cmd", "deps", "params", "outs"):
            if before.get(key) != after.get(key):
                print(f"FAIL: dvc.lock {name}.{key}: committed {before.get(key)!r}, reproduced {after.get(key)!r}")
    if failed:
        sys.exit(
            "dvc.lock: the data stages did not reproduce the committed entries; commit the new dvc.lock "
            "with the change that moved them"
        )


if __name__ == "__main__":
    main()
