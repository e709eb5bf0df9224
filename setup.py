"""Builds `mlx_kvq._native`, the optional CPU kernels of quantized attention.

Everything else is in pyproject.toml. The extension links MLX's C++ library
and shares mlx.core's nanobind domain (build requirements: `mlx[cpu]`,
`nanobind`), and needs a C++20 compiler. It is optional: where it cannot be
built (no compiler, not Linux, an MLX without headers) the install goes on
without it and quantized attention uses MLX's operations
(`mlx_kvq.kernels.native_status()` says which).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

SOURCE = "mlx_kvq/native/qattn.cpp"


class OptionalNative(build_ext):
    """build_ext that configures the kernels against the installed MLX and
    nanobind, and warns instead of failing when they cannot be built."""

    def build_extensions(self) -> None:
        try:
            self._configure(self.extensions[0])
            super().build_extensions()
        except Exception as e:  # any compiler or configuration failure
            self.warn(
                f"mlx_kvq._native not built ({type(e).__name__}: {e}); "
                "quantized attention will use MLX's operations"
            )

    def _configure(self, ext: Extension) -> None:
        import mlx
        import mlx.core
        import nanobind

        nb = Path(nanobind.__file__).parent
        root = Path(mlx.__path__[0])
        ext.sources.append(str(nb / "src" / "nb_combined.cpp"))
        ext.include_dirs += [
            str(nb / "include"),
            str(nb / "ext" / "robin_map" / "include"),
            str(root / "include"),
        ]
        ext.library_dirs.append(str(root / "lib"))
        ext.libraries.append("mlx")
        ext.define_macros.append(("NB_DOMAIN", "mlx"))
        if Path(mlx.core.__file__).name.endswith(".abi3.so"):
            # mlx.core uses the stable ABI: nanobind's types are shared only
            # between modules built alike
            ext.define_macros.append(("Py_LIMITED_API", "0x030C0000"))
        ext.extra_compile_args += [
            "-std=c++20", "-O3", "-fvisibility=hidden", "-fno-strict-aliasing", "-Wno-psabi",
        ]  # fmt: skip


def _extensions() -> list[Extension]:
    if not sys.platform.startswith("linux") or os.environ.get("MLX_KVQ_NATIVE") == "0":
        return []
    return [Extension("mlx_kvq._native", sources=[SOURCE], language="c++", optional=True)]


setup(ext_modules=_extensions(), cmdclass={"build_ext": OptionalNative})
