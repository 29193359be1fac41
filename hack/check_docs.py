#!/usr/bin/env python3
"""Builds the docs site (mkdocs, strict) and checks that every internal link resolves.

Checked: every relative href/src in the built HTML (the file exists in the site; a #fragment is an
id or name on the target page), and every relative link in README.md (the file exists in the
checkout; a link into docs/*.md#anchor names a heading of that page as the site renders it; a bare
#anchor names a README heading as GitHub slugs it). External http(s) links are listed, never
fetched: the build needs no network. Also checked: the user docs (README, docs/, CHANGELOG,
SECURITY, the examples' READMEs) speak to users, not in the project's internal voice (no issue
numbers, no "this project's machines" or "the test machine"; see VOICE). `make docs` runs this;
tests/unit/docs/test_docs.py imports it.
"""

from __future__ import annotations

import argparse
import html.parser
import posixpath
import re
import subprocess
import sys
import tempfile
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOP_LEVEL = (ROOT / "SECURITY.md", ROOT / "CHANGELOG.md")  # checked like README.md
SKIPPED_SCHEMES = ("mailto:", "javascript:", "data:", "tel:")

# Phrases of the project's internal voice that users cannot follow: issue numbers of the project's
# tracker, the machines the project is built and measured on, its review and work sessions. Say
# what changed or what was measured, on what hardware, instead.
VOICE = {
    r"\bissues? ?#?\d+": "an issue number of the project's tracker: say what changed",
    r"\bthis project's machines?\b": "the project's machines: name the hardware (\"on 2 cores\")",
    r"\bthe test machine\b": "the test machine: name the hardware (\"on 2 cores\")",
    r"\bthis machine\b": "whose machine? (\"your machine\", \"the local host\", \"a 2-core host\")",
    r"\bthe machine's\b": "whose machine? name the host or the hardware",
    r"\b(?:built|measured|ran|run) here\b": "where is here? (\"built from Go modules\", \"on 2 cores\")",
    r"\bthis round\b": "which round? say what changed",
    r"\bon this work\b": "which work? say what changed",
    r"\b(?:a|the|this|the test) session\b(?!.{0,3}(?:cookie|token))": "a session of the project's work: say what happened",
    r"\b(?:the|a|an adversarial) review (?:found|of (?:the|these))\b|\bthe review's\b|\bfound by the review\b":
        "the project's code review: say what was found and fixed",
}


def user_docs(root: Path = ROOT) -> list[Path]:
    """The Markdown users read: the README, the docs site's pages, CHANGELOG, SECURITY and the
    examples' READMEs."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md")),
            *(root / path.name for path in TOP_LEVEL), *sorted((root / "examples").rglob("README.md"))]


def check_voice(paths: list[Path] | None = None, root: Path = ROOT) -> list[str]:
    """Every internal-voice phrase (VOICE) in the user docs, as `file:line: phrase (why)`."""
    found = []
    for path in user_docs(root) if paths is None else paths:
        text = path.read_text(encoding="utf-8")
        name = path.relative_to(root) if path.is_relative_to(root) else path
        for pattern, why in VOICE.items():
            # A phrase may be wrapped: a space in a pattern matches any run of white space.
            for match in re.finditer(pattern.replace(" ", r"\s+"), text, flags=re.I):
                number = text.count("\n", 0, match.start()) + 1
                found.append(f"{name}:{number}: {' '.join(match.group(0).split())!r} ({why})")
    return sorted(found, key=lambda f: (f.split(":")[0], int(f.split(":")[1])))


@dataclass
class Page:
    ids: set[str] = field(default_factory=set)
    links: list[str] = field(default_factory=list)


class _Parser(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.page = Page()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if value is None:
                continue
            if name == "id" or (name == "name" and tag == "a"):
                self.page.ids.add(value)
            elif name in ("href", "src"):
                self.page.links.append(value)


@dataclass
class Report:
    broken: list[str] = field(default_factory=list)
    external: set[str] = field(default_factory=set)


def build(site: Path, config: Path = ROOT / "mkdocs.yml") -> None:
    """`mkdocs build --strict`; raises with mkdocs' own output when it warns or fails."""
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                           "--config-file", str(config), "--site-dir", str(site)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"mkdocs build --strict failed:\n{done.stdout}{done.stderr}")


def parse_site(site: Path) -> dict[str, Page]:
    """Every HTML page of the site by its path relative to the site (posix)."""
    pages = {}
    for path in site.rglob("*.html"):
        parser = _Parser()
        parser.feed(path.read_text(encoding="utf-8"))
        pages[path.relative_to(site).as_posix()] = parser.page
    return pages


def _is_external(link: str) -> bool:
    return link.startswith(("http://", "https://", "//"))


def _target(site: Path, base: str, path: str) -> str | None:
    """The site file a relative path from page `base` names, or None when there is none."""
    path = urllib.parse.unquote(path)
    # A path from the root (404.html's, as mkdocs writes them without a site_url) is the site's.
    joined = posixpath.normpath(path.lstrip("/") or "." if path.startswith("/")
                                else posixpath.join(posixpath.dirname(base), path))
    if joined.startswith(".."):
        return None
    for candidate in (joined, posixpath.join(joined, "index.html")):
        if (site / candidate).is_file():
            return "" if candidate == "." else candidate
    return None


def check_site(site: Path) -> Report:
    report = Report()
    pages = parse_site(site)
    for name, page in sorted(pages.items()):
        for link in page.links:
            if _is_external(link):
                report.external.add(link)
                continue
            if link.startswith(SKIPPED_SCHEMES):
                continue
            path, _, fragment = link.partition("#")
            target = _target(site, name, path) if path else name
            if target is None:
                report.broken.append(f"{name}: {link} (no such file)")
            elif fragment and target in pages and urllib.parse.unquote(fragment) not in pages[target].ids:
                report.broken.append(f"{name}: {link} (no anchor #{fragment} on {target})")
    return report


def github_slug(heading: str) -> str:
    """GitHub's anchor for a README heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_\[\]()]", "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


_MD_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HTML_LINK = re.compile(r"""(?:href|src)\s*=\s*["']([^"']+)["']""")


def _without_code(text: str) -> str:
    """Markdown outside fenced code blocks and inline code spans (links there are not links)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def check_readme(readme: Path, site: Path, pages: dict[str, Page] | None = None) -> Report:
    report = Report()
    pages = parse_site(site) if pages is None else pages
    text = readme.read_text(encoding="utf-8")
    own = {github_slug(m) for m in re.findall(r"^#{1,6}\s+(.+?)\s*$", _without_code(text), flags=re.M)}
    body = _without_code(text)
    for link in _MD_LINK.findall(body) + _HTML_LINK.findall(body):
        if _is_external(link):
            report.external.add(link)
            continue
        if link.startswith(SKIPPED_SCHEMES):
            continue
        path, _, fragment = link.partition("#")
        if not path:
            if fragment not in own:
                report.broken.append(f"{readme.name}: {link} (no such heading)")
            continue
        file = (readme.parent / urllib.parse.unquote(path)).resolve()
        if not file.exists():
            report.broken.append(f"{readme.name}: {link} (no such file)")
            continue
        if fragment and file.suffix == ".md" and file.parent == (readme.parent / "docs").resolve():
            rendered = "index.html" if file.stem == "index" else f"{file.stem}/index.html"
            if fragment not in pages.get(rendered, Page()).ids:
                report.broken.append(f"{readme.name}: {link} (no anchor #{fragment} on docs/{file.name})")
    return report


def check(site: Path, readme: Path = ROOT / "README.md", config: Path = ROOT / "mkdocs.yml") -> Report:
    build(site, config)
    report = check_site(site)
    pages = parse_site(site)
    for markdown in (readme, *TOP_LEVEL):
        found = check_readme(markdown, site, pages)
        report.broken += found.broken
        report.external |= found.external
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--site-dir", type=Path, default=None,
                        help="where the site is built (default: a temporary directory)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tether-site-") as tmp:
        site = args.site_dir or Path(tmp)
        try:
            report = check(site)
        except RuntimeError as error:
            print(error, file=sys.stderr)
            return 1
        print(f"external links (listed, not fetched): {len(report.external)}")
        for link in sorted(report.external):
            print(f"  {link}")
        for problem in report.broken:
            print(f"BROKEN {problem}", file=sys.stderr)
        voice = check_voice()
        for problem in voice:
            print(f"VOICE {problem}", file=sys.stderr)
        print(f"site built in {site}; {len(report.broken)} broken internal links; "
              f"{len(voice)} internal-voice phrases in the user docs")
        return 1 if report.broken or voice else 0


if __name__ == "__main__":
    sys.exit(main())
