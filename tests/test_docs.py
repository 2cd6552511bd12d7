"""Every code example of the README and docs/ runs.

The fenced ```python blocks of each page are extracted and executed:

* a block preceded by ``<!-- doctest: skip -->`` is not run (keep these few);
* a block preceded by ``<!-- doctest: dist -->`` runs on 2 gloo ranks of the shared pool,
  with the names a training script has (``Net``, ``model``, ``opt``, ``loader``, ``x``,
  ``y``, ``loss_fn``, ``device``...; see :func:`_fixtures`; ``dist.init_process_group()``
  is a no-op there). The dist blocks of one page share one namespace, in page order, so a
  later block may use what an earlier one built. Afterwards the model's parameters must be
  equal on every rank (expert-parallel ones excepted; each rank trains on its own data, so that holds only if the
  gradients were averaged);
* any other block runs in this process, one fresh namespace per page; a ``test_*``
  function a block defines is called (the layouts page's property-test recipe).

The README's two ``diff`` blocks (a DDP script turned into a tribucket one, with the DDP-shaped
class and with the context manager) are each run both ways on 2 ranks: the two scripts must
end with the same parameters.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import tempfile

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^(?:<!-- doctest: (\w+) -->\n)?```(\w*)\n(.*?)^```", re.M | re.S)


def _blocks(page: pathlib.Path, lang: str = "python") -> list[tuple[str, int, str]]:
    """(mode, line, source) of each ``lang`` block; mode is 'run', 'dist' or 'skip'."""
    text = page.read_text()
    out = []
    for m in _FENCE.finditer(text):
        if m.group(2) != lang:
            continue
        mode = m.group(1) or "run"
        if mode not in ("run", "dist", "skip"):
            raise ValueError(f"{page.name}: unknown doctest mode {mode!r} "
                             "(use dist or skip)")
        out.append((mode, text.count("\n", 0, m.start(3)) + 1, m.group(3)))
    return out


def _diff_scripts(diff: str) -> tuple[str, str]:
    """The before ('-' and context lines) and after ('+' and context) scripts of a diff."""
    before, after = [], []
    for line in diff.splitlines():
        mark, body = (line[:1], line[2:]) if line else (" ", "")
        if mark in (" ", "-"):
            before.append(body)
        if mark in (" ", "+"):
            after.append(body)
    return "\n".join(before), "\n".join(after)


# -- what a training script has at hand (built identically on every rank) ---------------

class Net(torch.nn.Module):
    """A small model with a BatchNorm buffer: two linear layers around it."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.bn = torch.nn.BatchNorm1d(32)
        self.fc2 = torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def _fixtures(workdir: str) -> dict:
    import torch.distributed as dist
    import tribucket

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Net()
    gen = torch.Generator().manual_seed(100 + rank)           # each rank its own data
    loader = [(torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen))
              for _ in range(2)]
    ddp = torch.nn.parallel.DistributedDataParallel(Net())     # for the checkpoint example
    torch.save(ddp.state_dict(), os.path.join(workdir, "ddp_checkpoint.pt"))
    return dict(
        torch=torch, dist=dist, tribucket=tribucket, nn=torch.nn, Net=Net, model=model,
        device=torch.device("cpu"), opt=torch.optim.SGD(model.parameters(), lr=0.1),
        loader=loader, x=loader[0][0], y=loader[0][1],
        loss_fn=torch.nn.functional.mse_loss, path=os.path.join(workdir, "checkpoint.pt"),
        my_shard_of_uneven_length=loader[:1 + rank],          # ranks of unequal length
    )


def _exec_dist(sources: list[tuple[int, str]], page: str, workdir: str):
    """Run the blocks in one namespace on this rank; return the model's parameters."""
    import torch.distributed as dist

    ns = _fixtures(workdir)
    cwd, init = os.getcwd(), dist.init_process_group
    os.chdir(workdir)
    dist.init_process_group = lambda *a, **k: None           # the pool is already set up
    try:
        for line, src in sources:
            exec(compile(src, f"{page}:{line}", "exec"), ns)
    finally:
        dist.init_process_group = init
        os.chdir(cwd)
    model = getattr(ns["model"], "module", ns["model"])
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _assert_ranks_agree(results: list[dict], what: str) -> None:
    """Replicated parameters are equal on every rank (experts, named by their global index,
    live on one rank each and are left out)."""
    shared = set(results[0]).intersection(*results[1:])
    assert shared, f"{what}: no parameter is held by every rank"
    for rank, params in enumerate(results[1:], 1):
        for name in sorted(shared):
            p = params[name]
            torch.testing.assert_close(p, results[0][name], rtol=0, atol=1e-6,
                                       msg=lambda m: f"{what}: rank {rank} vs rank 0, {name}: {m}")


_DIST = [(p, [(line, src) for mode, line, src in _blocks(p) if mode == "dist"]) for p in PAGES]
_LOCAL = [(p, [(line, src) for mode, line, src in _blocks(p) if mode == "run"]) for p in PAGES]


@pytest.mark.parametrize("page, sources", [d for d in _DIST if d[1]],
                         ids=[d[0].name for d in _DIST if d[1]])
def test_dist_examples(page, sources, dist_run):
    with tempfile.TemporaryDirectory() as workdir:
        results = dist_run(_exec_dist, sources, page.name, workdir, world_size=2, timeout=120)
    _assert_ranks_agree(results, page.name)


@pytest.mark.parametrize("page, sources", [d for d in _LOCAL if d[1]],
                         ids=[d[0].name for d in _LOCAL if d[1]])
def test_local_examples(page, sources, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ns: dict = {"__name__": f"doc_{page.stem}"}
    for line, src in sources:
        exec(compile(src, f"{page.name}:{line}", "exec"), ns)
    for name, fn in list(ns.items()):
        if name.startswith("test_") and callable(fn):
            fn()


@pytest.mark.parametrize("which", [0, 1], ids=["class", "context-manager"])
def test_readme_diff_matches_ddp(dist_run, which):
    """The README's two ways from DDP (the DDP-shaped class, one line; the context manager):
    the DDP script and the tribucket script it becomes train alike."""
    diffs = _blocks(ROOT / "README.md", "diff")
    assert len(diffs) == 2, "the README shows two DDP -> tribucket diffs"
    before, after = _diff_scripts(diffs[which][2])
    assert "torch.nn.parallel.DistributedDataParallel" in before and "torchrun" in before
    assert "torch.nn.parallel.DistributedDataParallel" not in after
    assert ("tribucket.DistributedDataParallel(model)", "fused_bucketing")[which] in after
    line = diffs[which][1]
    with tempfile.TemporaryDirectory() as workdir:
        ddp = dist_run(_exec_dist, [(line, before)], "README.md (DDP)", workdir, world_size=2)
        ours = dist_run(_exec_dist, [(line, after)], "README.md", workdir, world_size=2)
    _assert_ranks_agree(ours, "README.md diff")
    for rank, (a, b) in enumerate(zip(ours, ddp)):
        assert a.keys() == b.keys()
        for name in a:
            torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank}, {name}: tribucket vs DDP: {m}")
    torch.manual_seed(0)
    init = Net().state_dict()
    assert any(not torch.equal(ours[0][n], init[n]) for n in ours[0]), "the script did not train"


def test_doctest_markers_are_well_placed():
    """A page's python blocks are all found (a typo in a marker would silently skip one)."""
    for page in PAGES:
        text = page.read_text()
        assert text.count("```python") == len(_blocks(page)), page.name
        for m in re.finditer(r"<!-- doctest: (\w+) -->\n(?!```)", text):
            raise AssertionError(f"{page.name}: the doctest marker {m.group(0)!r} is not "
                                 "directly before a fenced block")


def _anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_resolve():
    """Every relative link of the README and docs/ names an existing file (and heading)."""
    for page in PAGES:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"\w+://", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            assert dest.exists(), f"{page.name}: link to {target!r}: no such file"
            if anchor:
                heads = re.findall(r"^#+ (.*)$", dest.read_text(), flags=re.M)
                assert anchor in {_anchor(h) for h in heads}, \
                    f"{page.name}: link to {target!r}: {dest.name} has no such heading"


def test_tables_are_generated_from_perf_results():
    """Every table between perf markers is what perf/update_readme.py makes from the results
    (so none is typed or edited by hand), and every benchmark's table appears on some page."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("update_readme", ROOT / "perf" / "update_readme.py")
    upd = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(upd)
    seen = set()
    for page in upd.pages():
        text = page.read_text()
        filled, written = upd.fill(text)
        assert filled == text, (f"{page.name}: a perf table differs from perf/results; "
                                "run python perf/update_readme.py")
        seen.update(written)
    assert "headline" in seen
    missing = {md.stem for md in (ROOT / "perf" / "results").glob("*.md")} - seen
    assert not missing, f"no page shows the perf tables {sorted(missing)}"


def test_perf_scripts_answer_help_without_running(tmp_path):
    # --help prints the usage and exits 0; it must not run a benchmark (which rewrites the
    # committed results). The scripts start side by side (each pays torch's import).
    results = ROOT / "perf" / "results"
    before = {p.name: p.stat().st_mtime_ns for p in results.iterdir()}
    scripts = sorted(p for p in (ROOT / "perf").glob("*.py")
                     if p.name.startswith(("bench", "update")))
    procs = {p.name: subprocess.Popen([sys.executable, str(p), "--help"], cwd=tmp_path,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True) for p in scripts}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, (name, err[-2000:])
        assert "usage" in out.lower(), (name, out[:500])
    assert {p.name: p.stat().st_mtime_ns for p in results.iterdir()} == before


def test_update_readme_refuses_an_unknown_table(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "perf" / "update_readme.py"), "stepp"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "stepp" in proc.stderr and "step" in proc.stderr, proc.stderr
