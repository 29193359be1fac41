"""What `kubectl explain`, the chart's values and the code point users to exists: a README section
named in a CRD description (`README, "Review"`) that the README does not have sends them nowhere."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tether.devcluster.crds import read_crd

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
SOURCES = [*sorted((ROOT / "crds").glob("*.yaml")), *sorted((ROOT / "charts" / "tether").rglob("*.yaml")),
           ROOT / "charts" / "tether" / "values.schema.json", *sorted((ROOT / "operator" / "tether").rglob("*.py"))]
NAMED = re.compile(r'README,? "([^"]+)"')
DOC = re.compile(r"\bdocs/([a-z0-9-]+\.md)")


def test_every_readme_section_and_docs_page_named_exists() -> None:
    headings = [line.lstrip("#").strip() for line in (ROOT / "README.md").read_text().splitlines()
                if line.startswith("#")]
    missing = []
    for path in SOURCES:
        text = path.read_text()
        missing += [f"{path.relative_to(ROOT)}: README section {name!r}" for name in NAMED.findall(text)
                    if not any(name.lower() in h.lower() for h in headings)]
        missing += [f"{path.relative_to(ROOT)}: docs/{page}" for page in DOC.findall(text)
                    if not (ROOT / "docs" / page).exists()]
    assert not missing, missing


def test_sample_kubectl_get_output_has_the_crds_columns() -> None:
    """A README or docs sample of `kubectl get wr` shows the columns kubectl prints (it lacked QUEUE)."""
    crd = read_crd(ROOT / "crds" / "workerruns.tether.dev.yaml")
    columns = ["NAME", *[c["name"].upper() for c in crd["spec"]["versions"][0]["additionalPrinterColumns"]
                         if not c.get("priority")]]
    samples = [(path, line.split()) for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
               for line in path.read_text().splitlines() if line.startswith("NAME ") and " PHASE " in line]
    assert samples and all(header == columns for _, header in samples), (columns, samples)
