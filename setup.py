"""Package layout: `envs/`, `tools/` and `sandboxes/` are top-level folders (DESIGN.md)
installed under the `libra` namespace as `libra.envs`, `libra.tools`, `libra.sandboxes`.
Everything else lives in pyproject.toml."""

from setuptools import find_packages, setup

MAPPED = {"libra.envs": "envs", "libra.tools": "tools", "libra.sandboxes": "sandboxes"}

packages = find_packages(include=["libra", "libra.*"])
package_dir = {"libra": "libra"}
for name, folder in MAPPED.items():
    packages.append(name)
    packages += [f"{name}.{sub}" for sub in find_packages(folder)]
    package_dir[name] = folder

setup(packages=packages, package_dir=package_dir)
