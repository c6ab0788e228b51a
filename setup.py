"""Build the compiled hot path (ext/_hot.pyx -> interlock.core._hot) and the compiled decide
path (ext/_decide.pyx -> interlock.core._decide).

Everything else lives in pyproject.toml. Set INTERLOCK_NO_EXTENSIONS=1 to
install the pure-Python twin only.
"""

import os

from setuptools import setup

NO_EXTENSIONS = bool(os.environ.get("INTERLOCK_NO_EXTENSIONS"))

if NO_EXTENSIONS:
    ext_modules = []
else:
    from Cython.Build import cythonize
    from setuptools import Extension

    ext_modules = cythonize(
        [
            Extension("interlock.core._hot", ["ext/_hot.pyx"], extra_compile_args=["-O2", "-g0"]),
            Extension(
                "interlock.core._decide", ["ext/_decide.pyx"], extra_compile_args=["-O2", "-g0"]
            ),
        ],
        compiler_directives={"language_level": 3, "embedsignature": True},
    )

setup(ext_modules=ext_modules)
