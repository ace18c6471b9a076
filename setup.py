"""Only what pyproject.toml cannot say: the cffi extension (`native/build.py`). All metadata is in pyproject.toml."""

from setuptools import setup

setup(cffi_modules=["native/build.py:ffibuilder"])
