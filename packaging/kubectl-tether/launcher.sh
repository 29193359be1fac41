#!/bin/sh
# kubectl-tether as krew installs it: the wheel beside this script goes into a private virtualenv
# (in this plugin's own krew directory) on first use; later runs exec it directly.
set -eu
here=$(cd "$(dirname "$(readlink -f "$0")")" && pwd)
venv="$here/venv"
if [ ! -f "$venv/.installed" ]; then  # absent too after an interrupted first run: start over
  python=${TETHER_PYTHON:-python3}
  "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' ||
    { echo "kubectl-tether needs Python >= 3.11 (set TETHER_PYTHON to one)" >&2; exit 1; }
  echo "kubectl-tether: first run, installing into $venv" >&2
  rm -rf "$venv"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet "$here"/kubectl_tether-*.whl
  touch "$venv/.installed"
fi
exec "$venv/bin/kubectl-tether" "$@"
