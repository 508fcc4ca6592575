"""The documentation against what it describes: the params reference against the typed
configs, the README's DAG against dvc.yaml, the README's links against the pages, and no
page holding a path of the machine it was written on. (The pages themselves are built by
`make docs` in .ci/run, warnings as errors.)"""

import dataclasses
import itertools
import re
import sys
import typing
from pathlib import Path

import networkx as nx
import pytest
from conftest import BIN, ROOT, run
from dvc.repo import Repo

from stagelm.infra.errors import StagelmError
from stagelm.pipeline import paramsdoc
from stagelm.pipeline.config import SECTIONS, param

README = (ROOT / "README.md").read_text()
REGENERATE = "stagelm params --markdown > docs/params.md"


def test_params_reference_is_what_the_configs_print():
    page = (ROOT / "docs/params.md").read_text()
    assert page == paramsdoc.markdown(ROOT / "params.yaml"), f"docs/params.md is stale; run `{REGENERATE}`"


def accepted_keys(cls: type, prefix: str) -> set[str]:
    """Every dotted key `stagelm check` accepts under dataclass `cls`, nested ones too."""
    keys = set()
    for name, hint in typing.get_type_hints(cls).items():
        if name in {f.name for f in dataclasses.fields(cls)}:  # not a ClassVar
            keys.add(f"{prefix}.{name}")
            if dataclasses.is_dataclass(hint):
                keys |= accepted_keys(hint, f"{prefix}.{name}")
    return keys


def test_params_reference_lists_every_key_check_accepts():
    page = (ROOT / "docs/params.md").read_text()
    listed = set(re.findall(r"^\| `([\w.]+)` \|", page, flags=re.M))
    accepted = {"seed"} | {k for name, cls in SECTIONS.items() for k in accepted_keys(cls, name)}
    assert {"sft.lora.rank", "distill.student.d_ff", "grpo.lora.targets"} <= accepted
    assert listed == accepted


def test_a_key_without_a_meaning_is_refused(tmp_path):
    @dataclasses.dataclass(frozen=True)
    class Section:
        """A section."""

        documented: int = param("has a meaning")
        bare: int

    with pytest.raises(StagelmError, match=r"^demo\.bare: no meaning in stagelm.pipeline.config"):
        paramsdoc.section_keys(Section, "demo", {"documented": 1, "bare": 2})


def test_params_command_prints_the_page_and_a_plain_list():
    page = run([str(BIN / "stagelm"), "params", "--markdown"], ROOT).stdout
    assert page == (ROOT / "docs/params.md").read_text()
    plain = run([str(BIN / "stagelm"), "params"], ROOT).stdout.splitlines()
    assert "training.lr: 0.003" in plain[[line.split(":")[0] for line in plain].index("training.lr")]
    assert len(plain) == page.count("\n| `") - page.count("| mapping |")


def mermaid_edges(text: str) -> set[tuple[str, str]]:
    """The edges of the README's Mermaid flowchart: `a & b --> c["label"] --> d` lines."""
    (chart,) = re.findall(r"```mermaid\n(.*?)```", text, flags=re.S)
    edges = set()
    for line in chart.splitlines()[1:]:
        groups = [[re.sub(r"\[.*?\]", "", n).strip() for n in part.split("&")] for part in line.split("-->")]
        for left, right in itertools.pairwise(groups):
            edges |= {(a, b) for a in left for b in right}
    return edges


def test_readme_dag_is_dvc_yaml():
    """The picture is dvc.yaml's stage graph, transitively reduced, each foreach drawn once."""
    with Repo(str(ROOT)) as repo:
        graph = nx.DiGraph((dep.addressing, stage.addressing) for stage, dep in repo.index.graph.edges)
    reduced = nx.transitive_reduction(graph)
    grouped = {(a.split("@")[0], b.split("@")[0]) for a, b in reduced.edges}
    assert mermaid_edges(README) == grouped


def slug(heading: str) -> str:
    """The anchor GitHub and MyST give a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


def test_readme_links_reach_pages_and_headings():
    links = re.findall(r"\]\(([^)\s]+)\)", README)
    local = [link for link in links if not link.startswith(("http://", "https://"))]
    assert len(local) >= 20
    for link in local:
        path, _, anchor = link.partition("#")
        assert (ROOT / path).is_file(), f"README links to {path}, which does not exist"
        if anchor:
            assert anchor in anchors(ROOT / path), f"README links to #{anchor}, not a heading of {path}"


def test_readme_is_short_and_every_page_is_in_the_docs():
    assert len(README.splitlines()) <= 250
    pages = {p.stem for p in (ROOT / "docs").glob("*.md")}
    linked = {Path(link.partition("#")[0]).stem for link in re.findall(r"\]\((docs/[^)\s]+)\)", README)}
    assert pages - {"index"} <= linked, "a docs page the README does not link"


# A path of the machine a page was written on: a command holding one runs nowhere else.
MACHINE_PATH = re.compile(r"(?<![\w.])/(?:tmp|work|home|root|Users|mnt|scratch|opt|var)/")


@pytest.mark.parametrize("name", ["README.md", "docs", "benchmarks/README.md"])
def test_no_machine_paths(name):
    target = ROOT / name
    for page in [target] if target.is_file() else sorted(target.glob("*.md")):
        for number, line in enumerate(page.read_text().splitlines(), 1):
            assert not MACHINE_PATH.search(line), f"{page.relative_to(ROOT)}:{number}: {line.strip()}"


def test_the_accelerator_page_holds_the_tables_its_json_files_give():
    result = run([sys.executable, "benchmarks/accelerator_table.py", "--check"], ROOT, check=False)
    assert result.returncode == 0, "docs/accelerators.md is stale: run python benchmarks/accelerator_table.py"
