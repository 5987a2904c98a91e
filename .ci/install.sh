# Sourced by .ci/run, .ci/xla_stage and .ci/clients: `install_into VENV [--no-cache] [--compile] REQUIREMENT...`.
#
# CI's environments are installed with uv where it can be had, pip otherwise. On 2 cores the installs compete with
# the first stage's tests for the CPU. Measured here, pip spent about 470 CPU-seconds on them (176 for torch 2.9 and
# torch-xla alone: downloading and unpacking 4 GB in Python), uv about 200 for the same packages, most of it
# byte-compiling the first stage's environment. The README's own install command still runs with pip in the first
# stage: it then finds the requirements installed and installs the project itself (21 CPU-s instead of 94).
# Where uv cannot be installed, or fails, pip installs instead.
#
# uv reads neither pip's configuration nor its find-links, so the locations pip is told to search for wheels (a
# machine's own CPU build of torch, say) are passed on: without them torch==2.13.0 would be PyPI's CUDA build.
# pip's extra indexes are not passed: uv takes every version of a package from the first index that has it, and a
# partial local mirror would then pin old releases.
#
# --no-cache: nothing of these packages is kept in uv's cache (torch 2.9's CUDA wheels are 4 GB that a cache would
# hold a second copy of). Bytecode is compiled ahead only with --compile, as pip does: where PYTHONDONTWRITEBYTECODE
# is set (it is on this project's machines), an environment without it would compile torch again in every process
# the tests start (a first stage that took half as long again). The other stages unset it instead, and then each
# process compiles what it imports, once.

UV=.venv-uv/bin/uv

# Make uv available in .venv-uv (a second of pip); where that fails, installs fall back to pip.
ensure_uv() {
    [ -x "$UV" ] && return 0
    { python3 -m venv .venv-uv && .venv-uv/bin/pip install -q uv; } || echo "uv could not be installed; using pip"
}

# Where pip is told to look, as uv arguments: its index (a registry mirror, if one is configured) and its
# --find-links locations, each from its environment or else its configuration, as pip reads them.
pip_locations() {
    local index links
    index="${PIP_INDEX_URL:-$(python3 -m pip config get global.index-url 2>/dev/null || true)}"
    [ -z "$index" ] || printf -- '--default-index\n%s\n' "$index"
    links="${PIP_FIND_LINKS:-$(python3 -m pip config get global.find-links 2>/dev/null || true)}"
    for link in $links; do
        [ -e "${link#file://}" ] && printf -- '--find-links\n%s\n' "$link"
    done
    return 0
}
# Read once here, not at each install: every read starts two Pythons.
mapfile -t PIP_LOCATIONS < <(pip_locations)

# install_into VENV [--no-cache] [--compile] REQUIREMENT...
install_into() {
    local venv=$1 uv_options=() pip_options=(--no-compile)
    shift
    while [ "${1:-}" = "--no-cache" ] || [ "${1:-}" = "--compile" ]; do
        case $1 in
            --no-cache) uv_options+=(--no-cache) && pip_options+=(--no-cache-dir) ;;
            --compile) uv_options+=(--compile-bytecode) && pip_options[0]=--compile ;;
        esac
        shift
    done
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    ensure_uv
    if [ -x "$UV" ]; then
        # pip's certificate bundle, where it is given one (a registry behind a TLS proxy), for uv too.
        local cert="${SSL_CERT_FILE:-${PIP_CERT:-}}"
        env ${cert:+SSL_CERT_FILE="$cert"} "$UV" pip install --python "$venv/bin/python" \
            "${uv_options[@]}" "${PIP_LOCATIONS[@]}" "$@" && return 0
        echo "uv could not install into $venv; pip installs instead"
    fi
    "$venv/bin/pip" install "${pip_options[@]}" "$@"
}
