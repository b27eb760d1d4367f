"""Build hook: the wheel carries the CUDA kernel sources of the top-level `kernels/` folder.

`kernels/` stays where the project keeps it (beside `boostmpi/`, with its README); building a
wheel copies its `*.cu` and `*.cuh` files into the package as `boostmpi/gpu/cuda/`, where
`boostmpi.gpu.kernels.kernels_dir()` finds them in an installed package. Everything else is in
pyproject.toml.
"""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

KERNELS_SOURCE = "kernels"
KERNELS_IN_PACKAGE = os.path.join("boostmpi", "gpu", "cuda")


class BuildPyWithKernels(build_py):
    def run(self):
        super().run()
        if self.editable_mode:  # an editable install reads them from the checkout
            return
        target = os.path.join(self.build_lib, KERNELS_IN_PACKAGE)
        self.mkpath(target)
        for name in sorted(os.listdir(KERNELS_SOURCE)):
            if name.endswith((".cu", ".cuh")):
                self.copy_file(os.path.join(KERNELS_SOURCE, name), os.path.join(target, name))


setup(cmdclass={"build_py": BuildPyWithKernels})
