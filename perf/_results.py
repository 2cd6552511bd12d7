"""Writing a benchmark's results: ``perf/results/<name>.json`` (the figures), ``<name>.md``
(the markdown table made from them) and ``<name>.png`` (the plot)."""

from __future__ import annotations

import json
import pathlib
from typing import Callable


def save(out: str | pathlib.Path, name: str, res: dict, markdown: Callable[[dict], str],
         plot: Callable[[dict, pathlib.Path], None]) -> str:
    """Write the three files into ``out`` (created if missing); print and return the table."""
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(res, indent=1))
    md = markdown(res)
    (out / f"{name}.md").write_text(md)
    plot(res, out / f"{name}.png")
    print(md)
    return md
