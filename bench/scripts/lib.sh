# Sourced by the device-call scripts (from the checkout's root, on the GPU machine): activates the
# bundle, restores TileLang's kernel cache from .tl-cache/ (ignored; carried from an earlier call's
# $OUT/tl-cache.tar.gz) and defines `run NAME CMD...` (log in $out/NAME.log, at most $LIMIT s) and
# `save_cache` (packs the kernel cache into $out so the next call skips the compiles; gzipped, since
# a file comes back only up to 16 MiB).
out=${OUT:-runs/device}
mkdir -p "$out"
source .gpu-bundle/activate.sh
if [ -f .tl-cache/tl-cache.tar.gz ]; then mkdir -p "$TILELANG_CACHE_DIR" && tar -C "$TILELANG_CACHE_DIR" -xzf .tl-cache/tl-cache.tar.gz; fi
run() { local name=$1; shift; echo "== $name: $*"; local t0=$SECONDS; timeout "${LIMIT:-240}" "$@" > "$out/$name.log" 2>&1; echo "rc=$? $name ($((SECONDS - t0)) s)"; }
save_cache() { tar -C "$TILELANG_CACHE_DIR" -czf "$out/tl-cache.tar.gz" . && ls -la "$out/tl-cache.tar.gz"; }
# pack NAME: everything in $out into $out/NAME.tgz alone (a call returns at most 8 files)
pack() { tar -C "$out" -czf "/tmp/$1.tgz" . && find "$out" -mindepth 1 -delete && mv "/tmp/$1.tgz" "$out/"; }
