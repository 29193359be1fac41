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

ROOT = Path(__file__).resolve().parents[3]

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


def test_the_user_docs_speak_to_users() -> None:
    """README, docs/, CHANGELOG, SECURITY and the examples' READMEs carry no internal voice: no
    issue numbers, no "this project's machines", "the test machine", sessions or reviews."""
    assert check_docs.check_voice() == []
    names = {p.relative_to(ROOT).as_posix() for p in check_docs.user_docs()}
    assert {"README.md", "CHANGELOG.md", "SECURITY.md", "docs/index.md", "examples/agent-loop/README.md"} <= names


@pytest.mark.parametrize("line, refused", [
    ("Added (issue 25: kind)", True),
    ("fixed in (issue #12).", True),
    ("3–4 s on the test machine, four workers", True),
    ("All of it ran on this project's machine: 2 cores", True),
    ("which this project's machines cannot reach", True),
    ("### kind, with a node image built here", True),
    ("Two were removed this round:", True),
    ("A review of these draws found a real gap", True),
    ("The test session's cluster has it on", True),
    ("the review's fixes to the Kueue integration", True),
    ("Measured on 2 cores (x86_64), warm caches.", False),
    ("pytest 9.2 drops the suffix (pytest-xdist#1386)", False),
    ("the reviewer's reason is handed to the next attempt", False),
    ("a random per-session token, exchanged for a session cookie", False),
    ("serves a web console on your machine", False),
])
def test_the_voice_check_refuses_internal_phrases(tmp_path: Path, line: str, refused: bool) -> None:
    page = tmp_path / "page.md"
    page.write_text(f"# Page\n\n{line}\n")
    assert bool(check_docs.check_voice([page], root=tmp_path)) is refused


def test_the_voice_check_sees_a_phrase_wrapped_over_two_lines(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Page\n\nkind and its node image are built\nhere from Go modules; see issue\n25.\n")
    assert [f.split(":")[1] for f in check_docs.check_voice([page], root=tmp_path)] == ["3", "4"]
