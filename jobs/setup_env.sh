# Sourced by jobs/local.sh and tests/run.sh: create .venv if missing and install boostmpi into it
# (again only when pyproject.toml changed). Needs only python3 with venv and pip.
# Sets VENV and PY.
setup_venv() {
  local extras="${1:-}"
  VENV="${BOOSTMPI_VENV:-$PWD/.venv}"
  PY="$VENV/bin/python"
  if [ ! -x "$PY" ]; then
    echo "creating $VENV"
    python3 -m venv "$VENV" || { echo "error: python3 -m venv failed (install python3-venv)" >&2; exit 1; }
  fi
  local spec="." stamp key
  [ -n "$extras" ] && spec=".[$extras]"
  key="$(cat pyproject.toml)|$extras"
  key="$(printf '%s' "$key" | "$PY" -c 'import hashlib,sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())')"
  stamp="$VENV/.boostmpi-installed-$key"
  if [ ! -f "$stamp" ]; then
    echo "installing boostmpi$([ -n "$extras" ] && echo "[$extras]") into $VENV (first run only)"
    "$PY" -m pip install -q --disable-pip-version-check -e "$spec" || { echo "error: pip install failed" >&2; exit 1; }
    touch "$stamp"
  fi
  export VENV PY
}
