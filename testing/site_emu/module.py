"""The emulated `module` command (Lmod's behaviour as the job scripts meet it), strict.

Called by the shell function `module() { eval "$(python3 module.py "$@")"; }`; prints shell code
that changes the caller's environment, or an error on stderr and `false`. The modules of the site
come from $EMU_ROOT/emu/site.json (testing/site_emu/facts.py). Every load is appended to
$EMU_ROOT/log/module.log ("load NAME/VERSION"), so tests see what a script loaded.

What it models: an unknown module is an error (Lmod: "The following module(s) are unknown");
`module load NAME` takes the default version; a module of a family (PrgEnv, mpi, rocm) replaces
the loaded one of the same family, as Cray's Lmod does; `cpe/<release>` swaps cray-mpich to its
release's version; `module use DIR` makes the modules under DIR visible; unloading reverts
setenv (unset) and prepend-path (removes the entries).
"""

import json
import os
import shlex
import sys

ROOT = os.environ["EMU_ROOT"]


def _site():
    with open(os.path.join(ROOT, "emu", "site.json")) as f:
        site = json.load(f)
    text = json.dumps(site["modules"]).replace("@EMU@", ROOT)
    return site, json.loads(text)


SITE, MODULES = _site()
out = []


def emit(line):
    out.append(line)


def fail(message):
    print(f"echo {shlex.quote('Lmod has detected the following error: ' + message)} >&2; false")
    sys.exit(0)


def loaded():
    return [m for m in os.environ.get("LOADEDMODULES", "").split(":") if m]


def visible(full):
    path = MODULES[full].get("modulepath")
    return path is None or path in os.environ.get("MODULEPATH", "").split(":")


def resolve(name):
    if name in MODULES and visible(name):
        return name
    versions = [m for m in MODULES if m.split("/")[0] == name and visible(m)]
    if not versions:
        fail(f' The following module(s) are unknown: "{name}"')
    defaults = [m for m in versions if MODULES[m].get("default")]
    return (defaults or sorted(versions))[-1]


def env_value(var, state):
    return state.get(var, os.environ.get(var))


def apply(full, state, loading):
    spec = MODULES[full]
    for var, value in spec.get("setenv", {}).items():
        state[var] = value if loading else None
    for var, entries in spec.get("prepend", {}).items():
        parts = [p for p in (env_value(var, state) or "").split(":") if p]
        parts = [p for p in parts if p not in entries]
        state[var] = ":".join((entries + parts) if loading else parts) or None
    base = spec.get("conda_base")
    if base:
        parts = [p for p in (env_value("PATH", state) or "").split(":") if p and p != f"{base}/bin"]
        state["PATH"] = ":".join(([f"{base}/bin"] if loading else []) + parts)
        state["CONDA_EXE"] = f"{base}/bin/conda" if loading else None
        state["EMU_CONDA_BASE"] = base if loading else None
        if loading:
            emit('conda() { local _emu_code; _emu_code="$("$EMU_PYTHON" "$EMU_ROOT/emu/conda.py" "$@")" || return $?; '
                 'eval "$_emu_code"; }')


def load(name, state, mods):
    full = resolve(name)
    if full in mods:
        return
    spec = MODULES[full]
    family = spec.get("family")
    if family:
        for other in list(mods):
            if MODULES.get(other, {}).get("family") == family:
                print(f"echo {shlex.quote(f'Lmod is automatically replacing {other!r} with {full!r}.')} >&2")
                apply(other, state, loading=False)
                mods.remove(other)
    for fam, target in spec.get("swap", {}).items():
        load(target, state, mods)
    apply(full, state, loading=True)
    mods.append(full)
    with open(os.path.join(ROOT, "log", "module.log"), "a") as f:
        f.write(f"load {full}\n")


def unload(name, state, mods):
    matches = [m for m in mods if m == name or m.split("/")[0] == name]
    for full in matches:
        apply(full, state, loading=False)
        mods.remove(full)


def main(argv):
    if not argv:
        fail("module: a subcommand is needed")
    cmd, args = argv[0], argv[1:]
    state, mods = {}, loaded()
    if cmd in ("load", "add"):
        for name in args:
            load(name, state, mods)
    elif cmd in ("unload", "rm", "del"):
        for name in args:
            unload(name, state, mods)
    elif cmd in ("swap", "switch"):
        if len(args) != 2:
            fail("module swap takes two modules")
        unload(args[0], state, mods)
        load(args[1], state, mods)
    elif cmd == "use":
        paths = [p for p in os.environ.get("MODULEPATH", "").split(":") if p]
        state["MODULEPATH"] = ":".join([a for a in args if a not in paths] + paths)
    elif cmd == "list":
        print(f"echo {shlex.quote('Currently Loaded Modules: ' + ' '.join(mods))} >&2")
        return
    elif cmd == "is-avail":
        ok = all(any(m == a or m.split('/')[0] == a for m in MODULES if visible(m)) for a in args)
        print("true" if ok else "false")
        return
    else:
        fail(f"module {cmd} is not emulated (load, unload, swap, use, list, is-avail)")
    state["LOADEDMODULES"] = ":".join(mods)
    for var, value in state.items():
        print(f"unset {var}" if value is None else f"export {var}={shlex.quote(value)}")
    for line in out:
        print(line)


if __name__ == "__main__":
    main(sys.argv[1:])
