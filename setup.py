"""Everything but the package list is in pyproject.toml. The list is here because the tree is
one namespace with its parts at the top: ``eagleops/`` holds the command line and links to
``pipeline/``, ``console/`` and ``themes/`` (the folders the design card fixes), so a wheel installs
``eagleops.pipeline``, ``eagleops.console`` and ``eagleops.themes`` and nothing else at the top of
``sys.path``. ``find_packages`` follows the links; the wheel carries real files."""

from setuptools import find_packages, setup

setup(packages=find_packages(include=["eagleops", "eagleops.*"]))
