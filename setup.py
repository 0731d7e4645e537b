"""Package list for setuptools; all other metadata lives in pyproject.toml.

`ssdlocal._pairs` is the top-level models/pairs/ directory (the pair registry),
mapped into the wheel by [tool.setuptools.package-dir] in pyproject.toml.
"""

from setuptools import find_packages, setup

setup(packages=find_packages(include=["ssdlocal", "ssdlocal.*"]) + ["ssdlocal._pairs"])
