"""Package layout the pyproject table cannot express: kernels/ ships inside the wheel as freetoken.kernels."""

from setuptools import find_packages, setup

kernel_packages = ["freetoken.kernels"] + [f"freetoken.kernels.{p}" for p in find_packages("kernels")]
kernel_dirs = {p: "/".join(["kernels", *p.split(".")[2:]]) for p in kernel_packages}

setup(
    packages=find_packages(include=["freetoken", "freetoken.*"]) + kernel_packages,
    package_dir={"freetoken": "freetoken", **kernel_dirs},
)
