# Sourced (bash or POSIX sh) by the demos and scripts/uv: puts a working `uv` on PATH for the sourcing script.
# In order: uv already on PATH; one installed earlier (~/.local/bin/uv, our private copy, ~/.cargo/bin/uv); else it
# installs uv without touching any system Python (PEP 668 "externally managed" ones included):
#   1. pip in a private venv, ${XDG_CACHE_HOME:-~/.cache}/prime-rl/uv-venv (honours pip's config: index, proxy, certs);
#   2. where `python3 -m venv` does not work (Debian/Ubuntu without python3-venv), scripts/fetch_uv.py downloads the
#      uv wheel from the index (PIP_INDEX_URL, default PyPI) with Python's standard library and unpacks the binary;
# and links it as ~/.local/bin/uv. It prints one line of what it did, and a hint when ~/.local/bin is not on PATH.
# When no route works it says so and exits (returns, in an interactive shell): it never goes on to a missing uv.

_ensure_uv_find() {
    command -v uv >/dev/null 2>&1 && return 0
    for _ensure_uv_bin in "$HOME/.local/bin/uv" "$_ensure_uv_root/bin/uv" "$HOME/.cargo/bin/uv"; do
        if "$_ensure_uv_bin" --version >/dev/null 2>&1; then
            PATH="${_ensure_uv_bin%/uv}:$PATH"
            export PATH
            return 0
        fi
    done
    return 1
}

_ensure_uv_install() {
    if ! command -v python3 >/dev/null 2>&1; then
        echo "ensure_uv: no uv, and no python3 to install it with" >&2
        return 1
    fi
    rm -rf "$_ensure_uv_root"
    _ensure_uv_how=
    if python3 -m venv "$_ensure_uv_root" >/dev/null 2>&1 && [ -x "$_ensure_uv_root/bin/python" ]; then
        if "$_ensure_uv_root/bin/python" -m pip install --quiet --disable-pip-version-check uv >&2; then
            _ensure_uv_how="with pip in a private venv"
        else
            echo "ensure_uv: pip in the private venv could not install uv; trying the wheel download" >&2
        fi
    else
        echo "ensure_uv: python3 -m venv does not work here (no python3-venv?); fetching the uv wheel instead" >&2
    fi
    if [ -z "$_ensure_uv_how" ]; then
        rm -rf "$_ensure_uv_root"
        if mkdir -p "$_ensure_uv_root/bin" && python3 "$_ensure_uv_dir/fetch_uv.py" "$_ensure_uv_root/bin" >/dev/null
        then
            _ensure_uv_how="from the wheel on ${PIP_INDEX_URL:-https://pypi.org/simple}"
        else
            return 1
        fi
    fi
    if ! "$_ensure_uv_root/bin/uv" --version >/dev/null 2>&1; then
        echo "ensure_uv: the uv installed in $_ensure_uv_root does not run" >&2
        return 1
    fi
    mkdir -p "$HOME/.local/bin" || return 1
    for _ensure_uv_bin in uv uvx; do
        if [ -x "$_ensure_uv_root/bin/$_ensure_uv_bin" ]; then
            ln -sf "$_ensure_uv_root/bin/$_ensure_uv_bin" "$HOME/.local/bin/$_ensure_uv_bin" || return 1
        fi
    done
    echo "ensure_uv: installed $("$HOME/.local/bin/uv" --version) $_ensure_uv_how into $_ensure_uv_root," \
        "linked as ~/.local/bin/uv (no system Python was changed)" >&2
    case ":$PATH:" in
        *":$HOME/.local/bin:"*) ;;
        *) echo "ensure_uv: hint: ~/.local/bin is not on your PATH; add it (e.g. in ~/.profile) to type \`uv\`," \
            "or use scripts/uv meanwhile" >&2 ;;
    esac
    PATH="$HOME/.local/bin:$PATH"
    export PATH
}

_ensure_uv_root="${XDG_CACHE_HOME:-$HOME/.cache}/prime-rl/uv-venv"
# where fetch_uv.py lies: bash knows the sourced file; scripts/uv (POSIX sh) sets _ensure_uv_dir; else the repo root
if [ -z "${_ensure_uv_dir:-}" ]; then
    _ensure_uv_dir=$(dirname -- "${BASH_SOURCE:-scripts/ensure_uv.sh}")
fi
if ! _ensure_uv_find && ! _ensure_uv_install; then
    echo "ensure_uv: error: could not install uv (see above). Install it yourself" \
        "(https://docs.astral.sh/uv/getting-started/installation/) and rerun." >&2
    case $- in
        *i*) return 1 ;;
        *) exit 1 ;;
    esac
fi
