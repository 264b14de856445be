#!/usr/bin/env bash
# Build llama.cpp's `llama-server` from the source vendored in the
# llama-cpp-python sdist, cached by version.
#
#   benchmarks/peers/build_llamacpp.sh [VERSION]
#
# VERSION defaults to $LLAMA_CPP_PYTHON_VERSION or 0.3.36. The binary lands in
#   ${ADASERVE_CACHE_DIR:-~/.cache/adaserve}/peers/llama.cpp-<VERSION>/bin/llama-server
# and the path is printed on the last line of stdout. A second run with the
# binary present does nothing (idempotent). Needs pip, cmake, ninja, a C++
# compiler; about 10 min on 2 cores (JOBS=2 by default).
set -euo pipefail

VERSION="${1:-${LLAMA_CPP_PYTHON_VERSION:-0.3.36}}"
JOBS="${JOBS:-2}"
PYTHON="${PYTHON:-python3}"
CACHE="${ADASERVE_CACHE_DIR:-$HOME/.cache/adaserve}/peers/llama.cpp-${VERSION}"

# GGML_NATIVE compiles ggml's AMX matmul wherever the CPU reports AMX, but some VMs
# report it and fault on the first tile instruction (a 2-core Xeon here: llama-server
# died with SIGSEGV in ggml_backend_amx_mul_mat at load). Run one tile instruction; if
# it faults, build without AMX (the AVX-512 path, what the CPU can run) in its own cache.
NATIVE_FLAGS=""
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
    PROBE="$(mktemp -d)"
    cat >"$PROBE/amx.c" <<'CEOF'
#include <immintrin.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(void) {
    unsigned char cfg[64];
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */)) return 2;
    memset(cfg, 0, sizeof cfg);
    cfg[0] = 1, cfg[16] = 64, cfg[48] = 16; /* palette 1, tile 0: 16 rows x 64 bytes */
    _tile_loadconfig(cfg);
    _tile_zero(0);
    _tile_release();
    return 0;
}
CEOF
    if ! { cc -O2 -mamx-tile "$PROBE/amx.c" -o "$PROBE/amx" && "$PROBE/amx"; } >/dev/null 2>&1; then
        NATIVE_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
        CACHE="$CACHE-noamx"
        echo "build_llamacpp: the CPU reports AMX but a tile instruction faults: building without AMX" >&2
    fi
    rm -rf "$PROBE"
fi
BIN="$CACHE/bin/llama-server"

if [[ -x "$BIN" ]]; then
    echo "$BIN"
    exit 0
fi

mkdir -p "$CACHE"
SRC="$CACHE/src"
if [[ ! -f "$SRC/CMakeLists.txt" ]]; then
    DL="$CACHE/sdist"
    mkdir -p "$DL"
    if ! ls "$DL"/llama_cpp_python-"${VERSION}".tar.gz >/dev/null 2>&1; then
        "$PYTHON" -m pip download --quiet --no-binary :all: --no-deps \
            "llama-cpp-python==${VERSION}" -d "$DL" >&2
    fi
    TARBALL="$(ls "$DL"/llama_cpp_python-"${VERSION}".tar.gz)"
    rm -rf "$SRC.tmp" && mkdir -p "$SRC.tmp"
    # Only the vendored llama.cpp tree is needed.
    tar -xzf "$TARBALL" -C "$SRC.tmp" --strip-components=3 \
        "llama_cpp_python-${VERSION}/vendor/llama.cpp"
    rm -rf "$SRC" && mv "$SRC.tmp" "$SRC"
fi

cmake -S "$SRC" -B "$CACHE/build" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_BUILD_SERVER=ON \
    -DGGML_NATIVE=ON \
    -DCMAKE_C_FLAGS="$NATIVE_FLAGS" \
    -DCMAKE_CXX_FLAGS="$NATIVE_FLAGS" \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_CURL=OFF \
    -DBUILD_SHARED_LIBS=OFF >&2
cmake --build "$CACHE/build" --target llama-server -j "$JOBS" >&2

mkdir -p "$CACHE/bin"
cp "$CACHE/build/bin/llama-server" "$BIN.tmp" && mv "$BIN.tmp" "$BIN"
"$BIN" --version >&2 2>&1 || true
echo "$BIN"
