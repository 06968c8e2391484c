#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (the peer of `python -m benchmarks.peers`) from the llama.cpp
# sources vendored in the llama-cpp-python source distribution on PyPI.
#
# The Python package's own server handles one request at a time; llama-server has parallel
# slots with continuous batching, which is the fair peer. CPU only, -DGGML_NATIVE=ON (this
# machine's instruction set, e.g. AVX-512), no curl or OpenSSL, no web UI (whose prebuilt
# assets the build would otherwise try to download), only the llama-server target.
#
# Usage: benchmarks/build_llama_server.sh
#   PAGEDLLM_PEERS_DIR   where the sources, the build and the binary go
#                        (default ~/.cache/pagedllm/peers); the binary is $PAGEDLLM_PEERS_DIR/llama-server
#   LLAMA_CPP_PYTHON_VERSION  the pinned llama-cpp-python sdist (default below)
#   JOBS                 parallel compile jobs (default 2)
#   GGML_AMX             ON to keep llama.cpp's AMX kernels (off by default, see below)
#   PIP                  the pip to download with (default: python3 -m pip)
# Idempotent: when the binary is there it only prints its path and version.
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
PEERS_DIR="${PAGEDLLM_PEERS_DIR:-$HOME/.cache/pagedllm/peers}"
JOBS="${JOBS:-2}"
BIN="$PEERS_DIR/llama-server"

report() {
    echo "llama-server: $BIN"
    "$BIN" --version 2>&1 | grep -i -E 'version|built' || true
    if [ -f "$PEERS_DIR/llama-server.source" ]; then
        cat "$PEERS_DIR/llama-server.source"
    fi
}

if [ -x "$BIN" ]; then
    echo "already built (delete $BIN to rebuild)"
    report
    exit 0
fi

for tool in cmake make c++; do
    command -v "$tool" >/dev/null || { echo "error: $tool is needed (apt-get install cmake build-essential)" >&2; exit 1; }
done

if [ -n "${PIP:-}" ]; then
    read -r -a pip_cmd <<<"$PIP"
else
    pip_cmd=(python3 -m pip)
fi

SRC_DIR="$PEERS_DIR/src"
mkdir -p "$SRC_DIR"
sdist="$(ls "$SRC_DIR"/llama_cpp_python-"$VERSION".tar.gz 2>/dev/null || true)"
if [ -z "$sdist" ]; then
    echo "downloading llama-cpp-python==$VERSION (source distribution)"
    "${pip_cmd[@]}" download --no-binary :all: --no-deps \
        -d "$SRC_DIR" "llama-cpp-python==$VERSION"
    sdist="$(ls "$SRC_DIR"/llama_cpp_python-"$VERSION".tar.gz)"
fi

TREE="$SRC_DIR/llama_cpp_python-$VERSION"
if [ ! -d "$TREE/vendor/llama.cpp" ]; then
    tar -xzf "$sdist" -C "$SRC_DIR"
fi
LLAMA_DIR="$TREE/vendor/llama.cpp"
[ -f "$LLAMA_DIR/CMakeLists.txt" ] || { echo "error: no vendor/llama.cpp in $sdist" >&2; exit 1; }

BUILD_DIR="$PEERS_DIR/build-$VERSION"
# -march=native turns on AMX where the CPU lists it, and llama.cpp then runs its AMX matmul
# kernels: on a VM whose CPU lists AMX (e.g. Sapphire Rapids guests) they crashed at the first
# matmul (SIGSEGV at ldtilecfg) with the Q4_1 default model. So AMX is off unless GGML_AMX=ON;
# everything else -march=native gives (AVX-512, VNNI, BF16) stays.
native_flags=""
if [ "${GGML_AMX:-OFF}" != "ON" ] &&
    echo 'int main(){}' | c++ -mno-amx-tile -mno-amx-int8 -mno-amx-bf16 -x c++ -fsyntax-only - 2>/dev/null; then
    native_flags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
fi
start=$(date +%s)
cmake -S "$LLAMA_DIR" -B "$BUILD_DIR" \
    -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF \
    -DGGML_NATIVE=ON \
    -DCMAKE_C_FLAGS="$native_flags" -DCMAKE_CXX_FLAGS="$native_flags" \
    -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_SERVER=ON
cmake --build "$BUILD_DIR" --config Release --target llama-server -j "$JOBS"
built="$(find "$BUILD_DIR" -type f -name llama-server -perm -u+x | head -n 1)"
[ -n "$built" ] || { echo "error: the build made no llama-server" >&2; exit 1; }
install -m 0755 "$built" "$BIN.tmp"
mv "$BIN.tmp" "$BIN"
# The sdist has no git metadata (llama-server --version says "unknown"): the changelog names
# the llama.cpp commit this version vendors.
commit="$(grep -m 1 -o 'llama\.cpp@[0-9a-f]*' "$TREE/CHANGELOG.md" || echo 'llama.cpp@unknown')"
echo "$commit vendored in llama-cpp-python $VERSION (PyPI sdist), built in" \
    "$(($(date +%s) - start)) s" >"$PEERS_DIR/llama-server.source"
report
