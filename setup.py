"""Everything but the package list is in pyproject.toml. The list is here because
``[tool.setuptools.packages.find]`` cannot add ``console.themes``: its files are in ``themes/``
at the top of the tree (pyproject's package-dir maps it), and the wheel carries them inside the
console package, where ``importlib.resources`` finds them."""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["pipeline*", "console*"]), "console.themes"])
