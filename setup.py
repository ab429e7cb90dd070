"""Only here to hand the cffi build to setuptools; metadata lives in pyproject.toml."""

from setuptools import setup

setup(cffi_modules=["native/build_native.py:ffibuilder"])
