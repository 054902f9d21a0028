#!/usr/bin/env bash
# Pre-warm a cache in the background while training starts, and watch it fill.
#
#   examples/prewarm.sh [EPOCHS]
#
# Settings (environment): CACHE (path or bare name, default image-folder-example), FOLDER (JPEGs; default:
# synthetic ones in DATA_DIR), IMAGES, SIZE, WORKERS (DataLoader workers), BUILD_WORKERS, PYTHON.
#
# `mmapcache build` fills the cache with its own processes while the training script starts on the same cache:
# what the build has stored is a hit for training, the rest is computed by whoever gets there first, and every
# sample is stored once. `mmapcache inspect` reports progress meanwhile. Interrupting the build is safe: rerun
# it and it fills only what is missing.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
python=${PYTHON:-python3}
cache=${CACHE:-image-folder-example}
size=${SIZE:-128}
epochs=${1:-3}
workers=${WORKERS:-2}
build_workers=${BUILD_WORKERS:-2}

# The same folder and fingerprint for the build and for training (a different fingerprint would be refused).
source_args=(--size "$size" --images "${IMAGES:-512}")
if [[ -n ${FOLDER:-} ]]; then source_args+=(--folder "$FOLDER"); fi
if [[ -n ${DATA_DIR:-} ]]; then source_args+=(--data-dir "$DATA_DIR"); fi
IFS=$'\t' read -r folder fingerprint < <("$python" "$here/image_folder.py" "${source_args[@]}" --prepare)
kwargs=$("$python" -c 'import json, sys; print(json.dumps({"folder": sys.argv[1], "size": int(sys.argv[2])}))' \
    "$folder" "$size")

mmapcache build "$cache" --dataset "$here/image_folder.py:JpegFolder" --kwargs "$kwargs" \
    --fingerprint "$fingerprint" --workers "$build_workers" &
build=$!

# Watch: the "filled:" line of `mmapcache inspect` every few seconds while the build runs (the cache may not
# exist for the first moment, hence the silenced errors).
(
    while kill -0 "$build" 2>/dev/null; do
        mmapcache inspect "$cache" 2>/dev/null | grep '^filled:' | sed 's/^/[prewarm] /' || true
        sleep "${WATCH_INTERVAL:-2}"
    done
) &
watcher=$!
trap 'kill "$build" "$watcher" 2>/dev/null || true' EXIT

"$python" "$here/image_folder.py" "${source_args[@]}" --folder "$folder" --cache "$cache" --epochs "$epochs" \
    --workers "$workers"

wait "$build"   # its exit status is the script's (set -e): 0 when every sample is filled
wait "$watcher" 2>/dev/null || true
trap - EXIT
echo "[prewarm] build finished:"
mmapcache inspect "$cache"
