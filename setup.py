"""Only `packages` is here (the rest is in setup.cfg): they come from two roots,
tfdist and its subpackages from the top, tfdist_launch from launch/ (setup.cfg's
package_dir), and setup.cfg's [options.packages.find] searches only one."""

from setuptools import find_packages, setup

setup(packages=find_packages(include=["tfdist", "tfdist.*"])
      + find_packages("launch", include=["tfdist_launch", "tfdist_launch.*"]))
