"""The docs site builds (mkdocs, strict) and every internal link in it and in README.md resolves.

The checker is hack/check_docs.py (`make docs`); these tests run it on the real site and show, on a
small site of their own, that it refuses what it must: a missing page, a missing anchor, a README
link to nothing.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]

check_docs = load_script("hack/check_docs.py")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    site = tmp_path_factory.mktemp("site")
    check_docs.build(site)
    return site


def test_every_internal_link_of_the_site_resolves(site: Path) -> None:
    report = check_docs.check_site(site)
    assert report.broken == []
    assert (site / "protocol" / "index.html").is_file() and (site / "console-runs.png").is_file()


@pytest.mark.parametrize("markdown", ["README.md", "SECURITY.md", "CHANGELOG.md"])
def test_every_link_of_the_top_level_markdown_resolves(site: Path, markdown: str) -> None:
    report = check_docs.check_readme(ROOT / markdown, site)
    assert report.broken == []


def test_every_docs_page_is_in_the_nav() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert pages == set(re.findall(r":\s*([\w-]+\.md)\s*$", nav, flags=re.M))


def test_the_readme_has_one_quick_start_block() -> None:
    text = (ROOT / "README.md").read_text()
    block = text.split("<!-- quickstart:begin -->", 1)[1].split("<!-- quickstart:end -->", 1)[0]
    assert block.strip().startswith("```bash") and block.count("```") == 2
    assert "helm install tether charts/tether" in block and "kubectl tether status" in block


def _tiny_site(tmp_path: Path, index: str, readme: str) -> tuple[Path, Path]:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text(index)
    (docs / "other.md").write_text("# Other\n\n## A part\n\ntext\n")
    config = tmp_path / "mkdocs.yml"
    config.write_text("site_name: t\nnav:\n  - index.md\n  - other.md\n")
    (tmp_path / "README.md").write_text(readme)
    site = tmp_path / "site"
    check_docs.build(site, config)
    return site, tmp_path / "README.md"


def test_the_checker_accepts_good_links(tmp_path: Path) -> None:
    site, readme = _tiny_site(tmp_path, "# Home\n\n[ok](other.md#a-part) [out](https://example.com)\n",
                              "# R\n\n## Here\n\n[in](docs/other.md#a-part) [self](#here)\n")
    site_report, readme_report = check_docs.check_site(site), check_docs.check_readme(readme, site)
    assert site_report.broken == [] and readme_report.broken == []
    assert "https://example.com" in site_report.external


def test_the_checker_refuses_a_missing_anchor_and_a_missing_file(tmp_path: Path) -> None:
    site, readme = _tiny_site(tmp_path, "# Home\n\n<a href=\"other/#no-such-part\">x</a> <a href=\"gone/\">y</a>\n",
                              "# R\n\n[a](docs/other.md#no-such-part) [b](docs/gone.md) [c](#nowhere)\n")
    site_report, readme_report = check_docs.check_site(site), check_docs.check_readme(readme, site)
    assert len(site_report.broken) == 2, site_report.broken
    assert len(readme_report.broken) == 3, readme_report.broken


def test_a_strict_build_refuses_a_link_to_a_missing_page(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="strict"):
        _tiny_site(tmp_path, "# Home\n\n[gone](gone.md)\n", "# R\n")
