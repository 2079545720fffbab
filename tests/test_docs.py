"""The design lives in the repository: every section that code cites exists, and nothing cites a
document outside it."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CITE = re.compile(r'docs/architecture\.md,\s*(?:#\s*)?"([^"]+)"')


def sources():
    for folder in ("specextend", "deploy", "tests", "benchmarks", "protos"):
        for path in (REPO / folder).rglob("*"):
            if path.suffix in (".py", ".proto", ".sh") and "v1/draft_pb2" not in str(path):
                yield path


def test_cited_sections_exist_and_no_outside_design_document_is_cited():
    headings = {m.group(1).strip() for m in re.finditer(r"^## (.+)$", (REPO / "docs/architecture.md").read_text(), re.M)}
    cited, outside = set(), []
    for path in sources():
        text = path.read_text()
        cited |= {(" ".join(c.split()), path.name) for c in CITE.findall(text)}
        if path.name != "test_docs.py" and re.search(r"\bDESIGN(\.md| \d)", text):
            outside.append(path.name)
    assert cited, "no code cites docs/architecture.md"
    missing = sorted((section, name) for section, name in cited if section not in headings)
    assert not missing, f"sections cited but not in docs/architecture.md: {missing}"
    assert not outside, f"files citing a design document outside the repository: {outside}"
