"""The micro project's stages as `dvc repro` and `dvc exp run` name them: shared by the DVC tests
(tests/pipeline/test_dvc_*.py), which each check what an edit reruns."""

MODELS = ("pretrain", "sft", "distill", "distill_control", "grpo", "dpo")  # as dvc.yaml's `models` var lists them
EXPORTED = ("pretrain", "sft", "distill", "grpo", "dpo")  # the control is measured, not shipped


def stages_ran(stdout: str) -> list[str]:
    """The stages a `dvc repro` or `dvc exp run` ran, in order, from its output."""
    return [line.split("'")[1] for line in stdout.splitlines() if line.startswith("Running stage")]
