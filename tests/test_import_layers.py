"""Imports point one way: the API (`kvtopo`) -> `export` -> `passes`, `runtime` -> `kernels`;
`models` (model definitions and tasks) and `kernels` import nothing of kvtopo. `kvtopo.config`
(the settings object) is the one API module every layer may import. Checked on the source's
syntax tree, lazy imports inside functions included, so an upward import fails here."""

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# package -> the other kvtopo packages (and "config") it may import
ALLOWED = {
    "kernels": set(),
    "models": set(),
    "runtime": {"kernels", "config"},
    "passes": {"kernels", "config"},
    "serving": {"runtime", "kernels", "models", "config"},
    "export": {"runtime", "passes", "kernels", "models", "config"},
}
PACKAGES = set(ALLOWED) | {"kvtopo"}


def imported_kvtopo_modules(path: Path, package: str) -> set[str]:
    """Every kvtopo module `path` imports, as "kvtopo.<package>[.rest]" (relative imports resolved)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                found.add(node.module or "")
            else:
                parts = ["kvtopo", package, *path.relative_to(ROOT / package).parent.parts]
                base = parts[: len(parts) - (node.level - 1)]
                found.add(".".join(base + ([node.module] if node.module else [])))
    return {name for name in found if name.startswith("kvtopo.")}


def target(module: str) -> str:
    """The layer a kvtopo module belongs to: a package name, "config", or "api"."""
    part = module.split(".")[1]
    if part in ALLOWED:
        return part
    return "config" if part == "config" else "api"


def violations() -> list[str]:
    found = []
    for package, allowed in ALLOWED.items():
        for path in sorted((ROOT / package).rglob("*.py")):
            for module in sorted(imported_kvtopo_modules(path, package)):
                layer = target(module)
                if layer != package and layer not in allowed:
                    found.append(f"{path.relative_to(ROOT)} imports {module} ({package} may import {sorted(allowed)})")
    return found


def test_imports_point_one_way():
    assert violations() == []


def test_no_private_name_crosses_a_package():
    """A leading underscore means "this module's business": other packages use public names."""
    crossing = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("kvtopo."):
                    other = node.module.split(".")[1]
                    private = [a.name for a in node.names if a.name.startswith("_")]
                    if other != package and private and not (package == "kvtopo" and other not in ALLOWED):
                        crossing.append(f"{path.relative_to(ROOT)}: {node.module} {private}")
    assert crossing == []


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    fake = tmp_path / "kernels"
    fake.mkdir()
    (fake / "bad.py").write_text("def f():\n    from kvtopo.runtime.session import Session\n")
    (fake / "rel.py").write_text("from ..export import layout\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "ALLOWED", {"kernels": set()})
    assert violations() == [
        "kernels/bad.py imports kvtopo.runtime.session (kernels may import [])",
        "kernels/rel.py imports kvtopo.export (kernels may import [])",
    ]
