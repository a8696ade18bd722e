"""The package list, found rather than written out (everything else is in pyproject.toml): every dflash_local.*
package on disk, so a new subpackage is never left out of the wheel, plus kernels/ and models/ mapped into it."""

from setuptools import find_namespace_packages, find_packages, setup

setup(
    packages=[
        *find_namespace_packages(include=["dflash_local", "dflash_local.*"], exclude=["*.__pycache__"]),
        "dflash_local.kernels",
        *(f"dflash_local.kernels.{name}" for name in find_packages("kernels")),
        "dflash_local.models",  # data only: the catalog, the bundled pair, its prompts
    ]
)
