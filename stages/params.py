"""params stage: check every key of params.yaml before any other stage runs.

python stages/params.py --params params.yaml --out data/params.valid.json

Stages list the params they read key by key, so DVC alone would take a misspelled key
(`training.learning_rate`) or section (`trainig:`) as a key no stage reads and rerun
nothing. This stage depends on params.yaml as a file and every other stage depends on
its stamp, so `dvc repro` fails here, naming the key, before anything runs. The stamp's
bytes never change, so a valid edit reruns this stage and only what reads the edited key.
"""

from stagelm.infra.errors import run_main
from stagelm.infra.files import write_json
from stagelm.pipeline.params import require_inputs, validate_params
from stagelm.pipeline.stage import start
from stagelm.tasks import require_family_sets


def main() -> None:
    stage = start(__doc__, "out")
    sections = validate_params(stage.params)
    require_family_sets(sections["data"], sections["grpo"], sections["dpo"])
    require_inputs(sections["data"])  # DVC would otherwise stop at download on a missing dependency
    write_json(stage.args.out, {"valid": sorted(sections)})
    print(f"params: {stage.args.params}: seed and {len(sections) - 1} sections valid")


if __name__ == "__main__":
    run_main(main)
