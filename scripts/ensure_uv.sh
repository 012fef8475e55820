# Sourced by the demo and CI: make `uv` available, installing it with pip on a machine that has only Python.
if ! command -v uv >/dev/null 2>&1; then
    echo "uv not found: installing it with pip" >&2
    python3 -m pip install --quiet --user uv 2>/dev/null || python3 -m pip install --quiet uv
    # pip puts the binary beside its scripts (user or system); the package knows where
    PATH="$(python3 -c 'import os, uv; print(os.path.dirname(uv.find_uv_bin()))'):$PATH"
    export PATH
fi
