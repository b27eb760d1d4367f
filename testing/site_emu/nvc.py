"""The emulated NVIDIA C compiler (nvc), as PrgEnv-nvidia's `cc` calls it: an option nvc does not
know is an error, "nvc-Error-Unknown switch: OPTION", as nvc reports it. GCC-only options (those of
Python's own build flags: -fwrapv, -Wsign-compare, -fno-strict-overflow, -fstack-protector-strong
...) are exactly what makes mpi4py's build fail under PrgEnv-nvidia. Known options go to GCC."""

import os
import sys

KNOWN_PREFIXES = ("-I", "-L", "-l", "-D", "-U", "-O", "-std=", "-Wl,", "-march=", "-mcpu=")
KNOWN = {"-c", "-o", "-g", "-shared", "-fPIC", "-fpic", "-E", "-S", "-M", "-MD", "-MF", "-w", "-Wall", "-pthread",
         "-v", "-V", "-fopenmp", "-mp", "-acc", "-gpu", "-cuda", "-x", "-Werror"}
# options that take the next word as their value
WITH_VALUE = {"-o", "-MF", "-x"}


def main(argv):
    args = iter(argv)
    for a in args:
        if a in WITH_VALUE:
            next(args, None)
            continue
        if not a.startswith("-") or a in KNOWN or a.startswith(KNOWN_PREFIXES):
            continue
        print(f"nvc-Error-Unknown switch: {a}", file=sys.stderr)
        return 1
    os.execvp("gcc", ["gcc", *argv])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
