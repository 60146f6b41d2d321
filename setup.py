"""Package discovery for the mmgen namespace (pyproject.toml holds everything else).

Each top-level folder installs inside the `mmgen` namespace (docs/architecture.md: nothing
generic such as `kernels` or `audio` may land at the top of site-packages), and every package
under it is found, not listed: a new subfolder with an `__init__.py` ships without another edit.
"""

from setuptools import find_packages, setup

#: Import name -> the folder that holds it.
FOLDERS = {"mmgen": "mmgen", "mmgen.image_ar": "image_ar", "mmgen.vlm": "vlm", "mmgen.audio": "audio",
           "mmgen.video": "video", "mmgen.kernels": "kernels", "mmgen.apps": "apps"}


def packages() -> list[str]:
    """Every package of every folder, under its import name."""
    return [name + (f".{sub}" if sub else "") for name, folder in FOLDERS.items() for sub in ["", *find_packages(folder)]]


if __name__ == "__main__":
    setup(package_dir=FOLDERS, packages=packages())
