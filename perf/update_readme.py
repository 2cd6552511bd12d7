"""Copy the benchmark tables from perf/results/*.md into README.md.

Every benchmark writes ``perf/results/<name>.json`` (the figures), ``<name>.png`` (a plot)
and ``<name>.md`` (a markdown table made from the JSON). The README holds each table
between ``<!-- perf:<name> -->`` and ``<!-- /perf:<name> -->``; this script replaces what
is between the markers with the file, so no figure in the README is typed by hand.

    python perf/update_readme.py          # all tables
    python perf/update_readme.py pack     # just one
"""

from __future__ import annotations

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "perf" / "results"


def update(names: list[str] | None = None) -> list[str]:
    readme = ROOT / "README.md"
    text = readme.read_text()
    done = []
    for md in sorted(RESULTS.glob("*.md")):
        name = md.stem
        if names and name not in names:
            continue
        pattern = re.compile(rf"(<!-- perf:{re.escape(name)} -->\n).*?(<!-- /perf:{re.escape(name)} -->)",
                             re.S)
        if not pattern.search(text):
            print(f"README.md has no <!-- perf:{name} --> markers; skipped", file=sys.stderr)
            continue
        body = md.read_text().rstrip("\n") + "\n"
        text = pattern.sub(lambda m: m.group(1) + body + m.group(2), text)
        done.append(name)
    readme.write_text(text)
    return done


if __name__ == "__main__":
    print("updated:", ", ".join(update(sys.argv[1:] or None)) or "nothing")
