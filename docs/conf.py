"""Sphinx configuration: MyST Markdown pages and API pages from the docstrings.
`make docs` builds them: sphinx-build -W --keep-going -n docs docs/_build/html."""

project = "stagelm"
author = "the stagelm authors"
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
html_theme = "sphinx_book_theme"
html_title = "stagelm"
html_theme_options = {"show_toc_level": 2}

# `#anchor` links to headings are checked: a heading renamed without its links fails the build.
myst_heading_anchors = 4
myst_enable_extensions = ["colon_fence", "deflist"]

# API pages: signatures as written, types in the text; `x` in a docstring is code, as in Markdown.
autodoc_member_order = "bysource"
autodoc_typehints = "none"
autodoc_default_options = {"members": True, "undoc-members": False}
default_role = "code"
napoleon_google_docstring = False
napoleon_numpy_docstring = False

# Dataclass fields show their types; those of other libraries have no page here to link to.
nitpick_ignore_regex = [("py:class", r"(argparse|pathlib|tokenizers|flax|jax|numpy)\..*")]
# jinja2's own attribute docs, inherited by stagelm.data.template_sandbox.Bounded, name its other attributes
nitpick_ignore = [("py:attr", "binop_table")]
