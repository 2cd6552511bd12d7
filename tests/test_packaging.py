"""What a non-editable install ships: every subpackage of tribucket, and the native hooks'
source, are listed in pyproject.toml (an editable install finds them anyway, so nothing
else in the suite would notice one missing)."""

import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _setuptools():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_subpackage_is_installed():
    listed = set(_setuptools()["packages"])
    found = {".".join(d.relative_to(ROOT).parts) for d in (ROOT / "tribucket").rglob("*")
             if d.is_dir() and (d / "__init__.py").exists()}
    assert found - listed == set(), f"add to [tool.setuptools] packages: {found - listed}"


def test_package_data_covers_the_native_source():
    patterns = _setuptools()["package-data"]["tribucket"]
    sources = [p.relative_to(ROOT / "tribucket") for p in (ROOT / "tribucket").rglob("*.cpp")]
    assert sources
    for src in sources:
        assert any(src.match(pat) for pat in patterns), f"{src} is not in package-data"
