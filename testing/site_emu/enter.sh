#!/bin/bash
# enter.sh ROOT COMMAND...: run COMMAND chrooted into ROOT/fs, inside the private mount namespace
# the caller made (unshare -m --propagation private): the host's top-level folders are bound in,
# /opt keeps the host's entries plus /opt/cray from ROOT/cray, and /soft, /lustre, /pscratch,
# /eagle come from ROOT. The mounts end with the namespace; nothing is created outside ROOT.
set -euo pipefail
ROOT="$1"
shift
FS="$ROOT/fs"
mkdir -p "$FS"
for entry in /*; do
  name="${entry#/}"
  case "$name" in opt|soft|lustre|pscratch|eagle) continue ;; esac
  if [ -L "$entry" ]; then
    [ -L "$FS/$name" ] || ln -s "$(readlink "$entry")" "$FS/$name"
    continue
  fi
  [ -d "$entry" ] || continue
  mkdir -p "$FS/$name"
  mount --rbind "$entry" "$FS/$name"
done
mkdir -p "$FS/opt"
for entry in /opt/*; do
  [ -d "$entry" ] || continue
  mkdir -p "$FS$entry"
  mount --rbind "$entry" "$FS$entry"
done
for pair in opt/cray:cray soft:soft lustre:lustre pscratch:pscratch eagle:eagle; do
  mkdir -p "$FS/${pair%%:*}" "$ROOT/${pair#*:}"
  mount --bind "$ROOT/${pair#*:}" "$FS/${pair%%:*}"
done
exec chroot "$FS" "$@"
