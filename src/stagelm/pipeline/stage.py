"""The frame every stage script shares, so a script holds only its own work.

    stage = start(__doc__, "raw", "out")           # --raw, --out (paths) and --params
    cfg = load_section(stage.params, "tokenizer")  # literal section names: `stagelm deps` reads them
    ...
    stage.record(beside(stage.args.out), read, inputs)  # provenance next to the output folder

`beside(out)` names the provenance file next to an output folder (never inside it,
so the folder's bytes do not change with the times). `start` parses the command line
(every path flag required, `--params` defaulting to params.yaml), notes the start
time and reads params.yaml on first use. Training stages start through
`stagelm.train.run.start_training`, which adds the multi-process runtime and the mesh.
Nothing here imports JAX, so the data stages start in a fraction of a second.
"""

import argparse
import dataclasses
import functools
import sys
from pathlib import Path
from typing import Any

from stagelm.infra.errors import OneLineParser
from stagelm.pipeline.params import read_params
from stagelm.pipeline.provenance import now, write_provenance


@dataclasses.dataclass
class Stage:
    name: str  # as provenance.json and `stagelm lineage` name it, e.g. "pretrain", "eval@sft"
    args: argparse.Namespace
    started: str
    script: Path  # the stage script: a training run's fingerprint hashes it with the code it imported

    @functools.cached_property
    def params(self) -> dict[str, Any]:
        return read_params(self.args.params)

    def record(
        self, path: Path, read: dict[str, Any], inputs: dict[str, Any], extra: dict[str, Any] | None = None
    ) -> None:
        """Write the provenance file `path`: the params read, the inputs' hashes, times, code and libraries."""
        write_provenance(path, self.name, read, inputs, self.started, extra)


def beside(out: Path) -> Path:
    """Where the provenance of output folder `out` goes: `<out>.provenance.json`, next to it.
    Times and the commit live there, so they never change the bytes of what other stages
    read, and DVC sees an unchanged folder as unchanged."""
    return out.with_name(out.name + ".provenance.json")


def start(doc: str | None, *paths: str, options: dict[str, dict[str, Any]] | None = None) -> Stage:
    """Parse `--<path>` for each of `paths` (required `Path`s), `options` (flag: argparse keywords) and `--params`.

    The stage is named after its script; a script run per model (`eval@sft`) renames it.
    """
    parser = OneLineParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag in paths:
        parser.add_argument(f"--{flag}", required=True, type=Path)
    for flag, keywords in (options or {}).items():
        parser.add_argument(f"--{flag}", **keywords)
    parser.add_argument("--params", default="params.yaml")
    args = parser.parse_args()
    return Stage(Path(sys.argv[0]).stem, args, now(), Path(sys.argv[0]))
