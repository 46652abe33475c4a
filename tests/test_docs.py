"""The docs state what the code does: generated tables are current, the API page covers the public API, and the
README's links resolve. (The site itself is built strictly in CI: mkdocs build --strict -f docs/mkdocs.yml.)"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

import hf_efficient

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("_script_render_docs_tables", ROOT / "scripts" /
                                                  "render_docs_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


render = _script()


@pytest.mark.parametrize("path", render.doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_generated_tables_are_current(path):
    text = path.read_text(encoding="utf-8")
    assert render.render(text, path.name) == text, (
        f"{path.relative_to(ROOT)}: a generated table differs from the code; run python scripts/render_docs_tables.py")


def test_every_table_is_somewhere_and_readme_has_names_and_options():
    keys = {m.group(2) for p in render.doc_files() for m in render.BLOCK.finditer(p.read_text(encoding="utf-8"))}
    assert keys == set(render.TABLES)
    readme = {m.group(2) for m in render.BLOCK.finditer((ROOT / "README.md").read_text(encoding="utf-8"))}
    assert {"names", "options"} <= readme


def test_tables_list_every_name_and_option():
    from hf_efficient.registry import all_options

    names, options, distributed = render.names_table(), render.options_table(), render.distributed_table()
    for trainer_name in hf_efficient.available_optimizers():
        assert f"| `{trainer_name}` (" in names
        assert f"| `{trainer_name}`" in distributed  # every family, each of its backends
    for key in all_options():
        assert f"| `{key}` |" in options


def test_a_stale_table_is_rewritten_and_an_unknown_one_refused():
    stale = "a\n<!-- BEGIN generated: names -->\n| old |\n<!-- END generated: names -->\nb\n"
    fresh = render.render(stale)
    assert "| old |" not in fresh and "`hf_eff_adam8bit`" in fresh and fresh.startswith("a\n") and fresh.endswith("b\n")
    assert render.render(fresh) == fresh
    with pytest.raises(ValueError, match="unknown generated block 'nope'"):
        render.render("<!-- BEGIN generated: nope -->\n<!-- END generated: nope -->")


def test_api_page_documents_the_public_api():
    page = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    documented = set(re.findall(r"^::: hf_efficient\.(\w+)$", page, re.M))
    assert set(hf_efficient.__all__) <= documented, set(hf_efficient.__all__) - documented


def test_readme_links_resolve():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    links = [t for t in re.findall(r"\]\(([^)#\s]+)", text) if "://" not in t]
    assert links
    missing = [t for t in links if not (ROOT / t).exists()]
    assert not missing, f"README.md links to missing files: {missing}"


def test_contributing_page_names_every_module():
    """docs/contributing.md's layout names every source file of the package (Python, C and headers), by its path
    under hf_efficient/, so a module added without a line there fails here."""
    page = (ROOT / "docs" / "contributing.md").read_text(encoding="utf-8")
    package = ROOT / "hf_efficient"
    modules = sorted(str(p.relative_to(package)) for ext in ("py", "c", "h") for p in package.rglob(f"*.{ext}"))
    assert modules
    missing = [m for m in modules if f"`{m}`" not in page]
    assert not missing, f"docs/contributing.md does not name these modules in its layout: {missing}"


def test_readme_speed_figures_are_the_gpu_results_page():
    """The README's speed section is a short excerpt of docs/results/bench_cuda.md (written by its script): each
    ratio and GB figure it quotes, and the GPU it names, are on that page, so a re-run that changes them shows here."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("\n## Speed\n", 1)[1].split("\n## ", 1)[0]
    page = (ROOT / "docs" / "results" / "bench_cuda.md").read_text(encoding="utf-8")
    figures = re.findall(r"\b\d+\.\d+x|\b\d+\.\d+ GB", section)
    assert len(figures) >= 8, figures
    missing = [f for f in figures if f.removesuffix(" GB") not in page]
    assert not missing, f"README's speed figures not on docs/results/bench_cuda.md: {missing}"
    gpu = re.search(r"\(([^)]*NVIDIA[^)]*)\)", page.splitlines()[0]).group(1)
    assert gpu in section, f"README's speed section should name the results page's GPU, {gpu}"


def test_nothing_says_to_install_hf_efficient_from_pypi():
    """hf_efficient is not on PyPI: `pip install hf_efficient` (or an extra of it by that name) finds nothing. Every
    page, example and message says to install from a checkout or a wheel built there, and names an extra's package."""
    wrong = re.compile(r"""pip install\s+["']?hf_efficient\b""")
    files = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "examples").iterdir(),
             *(ROOT / "hf_efficient").rglob("*.py")]
    said = [f"{p.relative_to(ROOT)}: {m[0]}" for p in files if p.is_file() for m in wrong.finditer(p.read_text("utf-8"))]
    assert not said, said


def _api_objects():
    """What docs/api.md renders: each ``::: module.name`` and, for a class, its public methods."""
    import importlib
    import inspect

    page = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    for path in re.findall(r"^::: ([\w.]+)$", page, re.M):
        module, name = path.rsplit(".", 1)
        obj = getattr(importlib.import_module(module), name)
        yield path, obj
        if inspect.isclass(obj):
            yield from ((f"{path}.{n}", m) for n, m in vars(obj).items() if not n.startswith("_") and callable(m))


def test_api_docstrings_render_as_written():
    """The API page is rendered from docstrings (mkdocstrings, Google style): an Args entry naming several parameters
    ("lr, weight_decay, betas, eps: ...") matches none, so each was listed as required though it has a default; and
    the page shows no table "above" a docstring (resolve's said "by the table above")."""
    import inspect

    checked = 0
    for path, obj in _api_objects():
        doc = inspect.getdoc(obj) or ""
        assert not re.search(r"\b(above|below)\b", doc), f"{path}: its docstring points at a place on a page"
        args = re.search(r"^Args:\n((?:    .*\n?|\n)+)", doc, re.M)
        if not args:
            continue
        params = inspect.signature(obj).parameters
        for entry in re.findall(r"^    (\S[^:]*?)(?: \([^)]*\))?:(?: |$)", args[1], re.M):
            assert entry.lstrip("*") in params, f"{path}: Args entry {entry!r} is not one of its parameters"
            checked += 1
    assert checked > 20


def _parametrized(fn, arg: str) -> set:
    """The values a test function is parametrized over for ``arg`` (its own marks, as pytest collects them)."""
    for mark in getattr(fn, "pytestmark", []):
        if mark.name == "parametrize" and mark.args[0] == arg:
            return {v.values[0] if hasattr(v, "values") else v for v in mark.args[1]}
    raise AssertionError(f"{fn.__name__} is not parametrized over {arg!r}")


def test_fsdp2_yes_is_where_the_fsdp2_tests_run():
    """docs/distributed.md says FSDP2 "yes" for exactly the names the FSDP2 tests parametrize over (both loops, the
    checkpoint tests): a name the registry allows but no test runs is not claimed. The example family runs there too
    but is no name of the package's: not in the table."""
    import test_fsdp2
    import test_fsdp2_integrations as integrations
    from cases import EXAMPLE

    ran = _parametrized(integrations.test_accelerate_fsdp2_trains_like_one_process, "name")
    assert ran == _parametrized(integrations.test_trainer_fsdp2_trains_and_logs_per_rank_state, "name")
    assert ran == _parametrized(test_fsdp2.test_dcp_save_on_two_ranks_resumes_exactly_on_two, "name")
    assert EXAMPLE.name in ran
    ran.discard(EXAMPLE.name)
    assert {(n, "torch") for n in ran} == render.fsdp2_tested()
    table = (ROOT / "docs" / "distributed.md").read_text(encoding="utf-8")
    yes = {m.group(1) for m in re.finditer(r"^\| `hf_eff_(\w+)` \(\w+\) \| [^|]* \| yes", table, re.M)}
    assert yes == ran and ran
