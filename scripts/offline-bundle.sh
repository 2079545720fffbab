#!/usr/bin/env bash
# Everything `specextend bench` needs on a GPU machine without network access, in one folder:
# wheels for the GPU host's platform (`pip download --platform ... --only-binary`), the default
# model pair (sha256-checked GGUF files) and the Node.js API docs (from Debian's nodejs-doc).
#
# Here (with network; from the repository root):
#   bash scripts/offline-bundle.sh pack DIR     # PYTHON_VERSION=3.11 PLATFORMS="manylinux_2_28_x86_64 ..."
#                                               # WITH_TORCH=1: torch, triton and CUDA libraries too (GBs)
#                                               # FLASH="flash-attn-4[cu13]" (default; cu12 for a CUDA 12
#                                               # torch; empty: none): FlashAttention's prefill kernels
# There (the repository checked out, DIR copied beside it):
#   bash scripts/offline-bundle.sh install DIR  # pip install --no-index from DIR/wheels
#   . DIR/env.sh && specextend bench --suite e2e
set -euo pipefail
cmd=${1:?pack|install}; dir=${2:?folder}
PYTHON=${PYTHON:-python3}
case "$cmd" in
  pack)
    mkdir -p "$dir/wheels" "$dir/models" "$dir/texts/nodejs-api"
    py=${PYTHON_VERSION:-$($PYTHON -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')}
    # pip takes each manylinux tag literally: list the older ones the host also runs
    plat=$(printf -- '--platform %s ' ${PLATFORMS:-manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64})
    # the project's requirements and its bench extra (pyproject.toml), resolved for the host's platform
    $PYTHON -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]
print("\n".join(p["dependencies"] + p["optional-dependencies"]["bench"]))' > "$dir/requirements.txt"
    # flash-attn-4 (the `flash` extra's pin) with the CuTe-DSL libraries of the host's CUDA
    flash=${FLASH-flash-attn-4[cu13]}
    if [ -n "$flash" ]; then
      $PYTHON -c 'import sys, tomllib; pin = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["flash"][0]
print(sys.argv[1] + pin[len("flash-attn-4"):])' "$flash" >> "$dir/requirements.txt"
    fi
    $PYTHON -m pip install -q --dry-run --ignore-installed --report "$dir/resolved.json" --only-binary=:all: \
      --implementation cp --python-version "$py" $plat --target "$dir/.resolve" -r "$dir/requirements.txt"
    # pinned, less torch, triton and the CUDA libraries (the host's own) unless WITH_TORCH=1
    $PYTHON -c 'import json, re, sys
folder, with_torch = sys.argv[1], sys.argv[2] == "1"
host = re.compile(r"^(torch|triton|nvidia-(?!cutlass-dsl).*|cuda-(?!bindings$|pathfinder$).*)$", re.I)  # flash-attn-4 needs those
meta = [i["metadata"] for i in json.load(open(folder + "/resolved.json"))["install"]]
pins = [m["name"] + "==" + m["version"] for m in meta if with_torch or not host.match(m["name"])]
open(folder + "/pinned.txt", "w").write("\n".join(pins) + "\n")' "$dir" "${WITH_TORCH:-0}"
    $PYTHON -m pip download -q --no-deps --dest "$dir/wheels" --only-binary=:all: --implementation cp \
      --python-version "$py" $plat -r "$dir/pinned.txt"
    $PYTHON -m pip wheel -q --no-deps --wheel-dir "$dir/wheels" .
    # the default pair: copied from this machine's cache when verified there, else fetched into DIR
    for which in target draft; do
      here=$($PYTHON -c "from specextend import fetch; print(fetch.cached_path('$which') or '')")
      if [ -n "$here" ]; then cp "$here" "$here.sha256" "$dir/models/"; fi
    done
    SPECEXTEND_CACHE="$dir/models" $PYTHON -m specextend.cli fetch-models
    # the Node.js API docs (MIT) from Debian's nodejs-doc package, unpacked, not installed
    tmp=$(mktemp -d)
    if (cd "$tmp" && apt-get download nodejs-doc >/dev/null 2>&1); then
      dpkg-deb -x "$tmp"/nodejs-doc_*.deb "$tmp/x"
      cp "$tmp"/x/usr/share/doc/nodejs/api/*.md* "$dir/texts/nodejs-api/"  # large pages are .md.gz
    else
      cp /usr/share/doc/nodejs/api/*.md "$dir/texts/nodejs-api/"
    fi
    rm -rf "$tmp" "$dir/.resolve"
    du -sh "$dir"/* ;;
  install)
    flash=$(grep -E '^flash-attn-4' "$dir/requirements.txt" || true)
    $PYTHON -m pip install --no-index --find-links "$dir/wheels" "specextend[bench]" ${flash:+"$flash"}
    abs=$(cd "$dir" && pwd)
    printf 'export SPECEXTEND_CACHE=%q SPECEXTEND_NODEJS_DOCS=%q\n' "$abs/models" "$abs/texts/nodejs-api" \
      > "$dir/env.sh"
    echo "now: . $dir/env.sh && specextend bench --suite e2e" ;;
  *) echo "usage: $0 pack|install DIR" >&2; exit 2 ;;
esac
