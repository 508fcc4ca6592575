"""Write plots/offline.html: DVC's plots page with Vega, Vega-Lite and Vega-Embed inside it.

    python plots/make_offline.py     # needs npm and the npm registry; run when the versions change

DVC's default page loads Vega from a CDN, so `dvc plots show` and `dvc plots diff` draw
nothing without internet (treeverse/dvc#5679), the usual case on a cluster node. This
template (set as `plots.html_template` in .dvc/config) carries the three libraries
inline instead, at versions that work together (DVC's own page asks for vega 5,
vega-lite 5 and vega-embed 6), and draws SVG. The packages come from the npm registry
with their dependencies; plots/LICENSES.md gathers the licence of every package whose
code the three bundles carry. DVC fills `{plot_divs}` and `{refresh_tag}`; without a
`{scripts}` placeholder it adds no CDN tags.
"""

import json
import subprocess
import tempfile
from pathlib import Path

VERSIONS = {"vega": "5.33.1", "vega-lite": "5.23.0", "vega-embed": "6.29.0"}
BUNDLES = {"vega": "build/vega.min.js", "vega-lite": "build/vega-lite.min.js", "vega-embed": "build/vega-embed.min.js"}
HERE = Path(__file__).resolve().parent

# After vega-embed: every chart as SVG (so a test can see what was drawn), and no action
# that would open the online Vega editor.
SVG = """window.vegaEmbed = (function (embed) {
  const actions = {export: true, source: true, compiled: true, editor: false};
  return function (el, spec, opt) {
    return embed(el, spec, Object.assign({renderer: "svg", actions: actions}, opt));
  };
})(window.vegaEmbed);"""

PAGE = """<!DOCTYPE html>
<html>
<head>
    {refresh_tag}
    <meta charset="utf-8">
    <title>DVC Plot</title>
    <!-- %(banner)s -->
%(scripts)s
    <style>
        table {
            border-spacing: 15px;
        }
    </style>
</head>
<body>
    {plot_divs}
</body>
</html>
"""


def install(work: Path) -> Path:
    specs = [f"{name}@{version}" for name, version in VERSIONS.items()]
    subprocess.run(["npm", "install", "--no-save", "--no-audit", "--no-fund", *specs], cwd=work, check=True)
    return work / "node_modules"


def bundled(modules: Path, names: list[str]) -> dict[str, Path]:
    """The packages the bundles were built from: the named ones and their runtime dependencies."""
    seen: dict[str, Path] = {}
    todo = list(names)
    while todo:
        name = todo.pop()
        if name in seen or not (modules / name / "package.json").is_file():
            continue
        seen[name] = modules / name
        todo += list(json.loads((modules / name / "package.json").read_text()).get("dependencies", {}))
    return seen


def licences(packages: dict[str, Path]) -> str:
    lines = [
        "# Licences of the code inside plots/offline.html",
        "",
        "plots/offline.html carries the minified bundles of "
        + ", ".join(f"{n} {v}" for n, v in VERSIONS.items())
        + " from the npm registry. They were built from the packages below: the three and their",
        "runtime dependencies as npm installs them (a superset: a few node-only packages, such as",
        "yargs and node-fetch, stay out of the browser bundles). Made by plots/make_offline.py.",
        "",
    ]
    for name in sorted(packages):
        meta = json.loads((packages[name] / "package.json").read_text())
        lines += [f"## {name} {meta['version']} ({meta.get('license', 'no licence field')})", ""]
        texts = sorted(p for p in packages[name].iterdir() if p.name.upper().startswith(("LICENSE", "LICENCE")))
        if texts:
            lines += ["```", texts[0].read_text().strip(), "```", ""]
        else:
            lines += [f"The package ships no licence file; its package.json names {meta.get('license')}.", ""]
    return "\n".join(lines)


def main() -> None:
    with tempfile.TemporaryDirectory() as work:
        modules = install(Path(work))
        scripts = []
        for name, path in BUNDLES.items():
            code = (modules / name / path).read_text()
            assert "</script" not in code.lower() and "{plot_divs}" not in code
            scripts.append(f"    <script>/* {name} {VERSIONS[name]} */\n{code}\n    </script>")
        scripts.append(f"    <script>\n{SVG}\n    </script>")
        banner = (
            "Vega "
            + VERSIONS["vega"]
            + ", Vega-Lite "
            + VERSIONS["vega-lite"]
            + ", Vega-Embed "
            + VERSIONS["vega-embed"]
            + " inline (BSD-3-Clause; plots/LICENSES.md): this page draws without a network"
        )
        page = PAGE.replace("%(banner)s", banner).replace("%(scripts)s", "\n".join(scripts))
        (HERE / "offline.html").write_text(page)
        (HERE / "LICENSES.md").write_text(licences(bundled(modules, list(VERSIONS))) + "\n")


if __name__ == "__main__":
    main()
