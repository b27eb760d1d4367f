"""The emulated `conda` (the shell function the site's conda module defines), strict.

  conda activate base        prints shell code: runs the base environment's activation scripts
                             (etc/conda/activate.d/*.sh, which, like many packages' real ones, read
                             variables that may be unset: a caller under `set -u` dies there, as
                             with the real conda), then puts the base's bin first on PATH
  conda create -y [-q] -p PREFIX python=X.Y [-c CHANNEL]...
                             makes PREFIX an environment with a Python (the machine's Python,
                             whatever X.Y asks: the emulation has one) and pip
Anything else is an error.
"""

import os
import shlex
import subprocess
import sys

base = os.environ.get("EMU_CONDA_BASE", "")


def fail(message):
    print(f"echo {shlex.quote('CondaError: ' + message)} >&2; false")
    sys.exit(0)


def main(argv):
    if not base:
        fail("conda is not set up: load the site's conda module first")
    if argv[:1] == ["activate"]:
        if argv[1:] != ["base"]:
            fail(f"the emulation activates only base, not {argv[1:]}")
        lines = [f". {shlex.quote(os.path.join(base, 'etc', 'conda', 'activate.d', name))}"
                 for name in sorted(os.listdir(os.path.join(base, "etc", "conda", "activate.d")))]
        lines += [f"export CONDA_PREFIX={shlex.quote(base)} CONDA_DEFAULT_ENV=base CONDA_SHLVL=1",
                  f"export PATH={shlex.quote(base + '/bin')}:\"$PATH\""]
        print("\n".join(lines))
        return
    if argv[:1] == ["create"]:
        prefix, python, i = None, None, 1
        while i < len(argv):
            a = argv[i]
            if a in ("-y", "--yes", "-q", "--quiet"):
                pass
            elif a in ("-p", "--prefix") and i + 1 < len(argv):
                prefix, i = argv[i + 1], i + 1
            elif a in ("-c", "--channel") and i + 1 < len(argv):
                i += 1
            elif a.startswith("python="):
                python = a
            else:
                fail(f"conda create: option or package {a!r} is not emulated")
            i += 1
        if not prefix or not python:
            fail("conda create needs -p PREFIX and python=X.Y")
        made = subprocess.run([sys.executable, "-m", "venv", prefix], stdout=sys.stderr)
        if made.returncode:
            fail(f"conda create -p {prefix} failed")
        with open(os.path.join(prefix, "conda-meta-emulated"), "w") as f:
            f.write(f"{python}\n")
        print("true")
        return
    fail(f"conda {' '.join(argv)} is not emulated (activate base, create)")


if __name__ == "__main__":
    main(sys.argv[1:])
