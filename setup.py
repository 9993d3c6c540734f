"""Packaging beyond what pyproject.toml can say: the embedded default model travels in wheels.

models/ is a folder of the repository, not a Python package; in a wheel (`pip install .`) it is
installed as the data-only package `tandem_models`, where client.defaults finds it. Images that
copy only part of the tree (the scheduler's, which has the tokenizer alone) install the same way.
"""

import os

from setuptools import find_packages, setup

packages = find_packages(include=["protos*", "scheduler_service*", "executor_service*", "client*"])
package_dir = {}
package_data = {"protos": ["tandem/v1/*.proto", "tandem/v1/*.pyi"]}
if os.path.isdir("models/tandem-tiny-pydoc"):
    packages.append("tandem_models")
    package_dir["tandem_models"] = "models"
    package_data["tandem_models"] = ["tandem-tiny-pydoc/*"]

setup(packages=packages, package_dir=package_dir, package_data=package_data)
