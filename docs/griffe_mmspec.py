"""Griffe extension for the API pages: ``pipelines/`` and ``kernels/`` sit at the top of the repository
but are installed as ``mmspec.pipelines`` and ``mmspec.kernels`` (setuptools ``package-dir``), which
griffe's static finder does not follow. Load them as members of ``mmspec`` under their import paths."""

from pathlib import Path

import griffe

ROOT = Path(__file__).resolve().parent.parent
INSTALLED = {"pipelines": ROOT / "pipelines" / "__init__.py", "kernels": ROOT / "kernels" / "__init__.py"}


class InstalledSubpackages(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs) -> None:
        if pkg.name != "mmspec":
            return
        for name, init in INSTALLED.items():
            if name not in pkg.members:
                pkg.set_member(name, loader._load_module(name, init, parent=pkg))
