"""The README's etcd key table ("etcd key schema") names the same keys as the table of ``coordinator/keys.py``'s
docstring, the module that owns the schema: a key added to one and not the other fails here."""
from __future__ import annotations

import re

from coordinator import keys
from tests.support.docs import ROOT

# A row's first cell: one key, or two joined by ", " (``election/<id>``, ``coordinators/<id>``).
MODULE_ROW = re.compile(r"^``([^`]+)``(?:, ``([^`]+)``)?(?:\s|$)")
README_ROW = re.compile(r"^\| `([^`]+)`(?:, `([^`]+)`)? \|")


def module_keys() -> set[str]:
    lines = (keys.__doc__ or "").splitlines()
    rules = [i for i, line in enumerate(lines) if line.startswith("=====")]
    assert len(rules) == 3, "keys.py's docstring has one table: a rule, the header, a rule, the rows, a rule"
    rows = lines[rules[1] + 1:rules[2]]
    return {k for line in rows if (m := MODULE_ROW.match(line)) for k in m.groups() if k}


def readme_keys() -> set[str]:
    text = (ROOT / "README.md").read_text()
    table = text.split("## etcd key schema", 1)[1].split("\n## ", 1)[0]
    return {k for line in table.splitlines() if (m := README_ROW.match(line)) for k in m.groups() if k}


def test_the_readme_key_table_lists_the_keys_of_the_schema_module() -> None:
    ours, readme = module_keys(), readme_keys()
    assert {"gangqueue/<rank>", "queue/<host>/<rank>", "cordons/<host>"} <= ours, sorted(ours)
    # <rev> in the module is the README's <create_revision>: the same key.
    readme = {k.replace("@<create_revision>", "@<rev>") for k in readme}
    assert readme == ours, f"only in keys.py: {sorted(ours - readme)}; only in README.md: {sorted(readme - ours)}"
