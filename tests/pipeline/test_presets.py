"""Presets are params.yaml overrides a user runs as a DVC experiment: valid keys and values, printed as -S flags."""

import copy

import pytest
import yaml
from conftest import ROOT, run

from stagelm.infra.errors import StagelmError
from stagelm.pipeline.params import validate_params
from stagelm.pipeline.presets import PRESETS, flags, preset


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_a_preset_is_a_valid_params_file_once_applied(name):
    params = copy.deepcopy(yaml.safe_load((ROOT / "params.yaml").read_text()))
    for key, value in preset(name).items():
        section, field = key.split(".")
        params[section][field] = value
    sections = validate_params(params)
    assert sections["model"].dtype == "bfloat16" and sections["model"].attention == "auto"
    rows = sections["training"].batch_size * sections["training"].grad_accum
    assert rows >= 64 and sections["pack"].seq_len == 2048


def test_the_cli_prints_the_flags_dvc_exp_run_takes():
    out = run(["stagelm", "preset", "tpu-150m"], ROOT).stdout.split()
    assert out == " ".join(flags("tpu-150m")).split()
    assert out[:2] == ["-S", "model.dtype=bfloat16"] and "model.scan_layers=false" in out
    listing = run(["stagelm", "preset"], ROOT).stdout
    assert listing.startswith("tpu-150m: pretrain a 155M decoder")
    bad = run(["stagelm", "preset", "tpu-9000"], ROOT, check=False)
    assert bad.returncode == 2 and bad.stderr.startswith("error: tpu-9000: no such preset; choose one of")


def test_a_preset_naming_a_key_params_yaml_lacks_is_refused(monkeypatch):
    monkeypatch.setitem(PRESETS, "broken", PRESETS["tpu-150m"]._replace(values={"model.d_modl": 1}))
    with pytest.raises(StagelmError, match=r"^preset broken: model.d_modl is not a params.yaml key$"):
        preset("broken")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_a_presets_figures_are_read_from_its_committed_measurement(name):
    """No figure is typed by hand: describe() quotes the benchmarks/ file the preset names."""
    import json

    from stagelm.pipeline.presets import describe

    file, shape = PRESETS[name].measured
    result = json.loads((ROOT / "benchmarks" / file).read_text())
    (entry, *_) = [e for e in result["train"] if e["name"] == shape and not e["scan_layers"]]
    line = describe(name)
    assert (
        line.startswith(PRESETS[name].about) and "tok/s" not in PRESETS[name].about and "MFU" not in PRESETS[name].about
    )
    assert f"{entry['tokens_per_sec'] / 1e3:.1f}k tok/s, MFU {entry['mfu']:.1%}" in line and file in line
