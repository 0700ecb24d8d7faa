#!/usr/bin/env bash
# Pack a device call's $OUT for the trip back: the device returns at most 8 files (scripts/gpu_run.sh's outputs
# are often more). Past MAX files (default 8), every file but summary.txt goes into one bundle.tgz (tar xzf it),
# and the packed files and emptied folders are removed; at or under MAX nothing changes.
#   scripts/pack_out.sh DIR [MAX]
set -eu
dir="$1"; max="${2:-8}"
n_files=$(find "$dir" -type f | wc -l)
[ "$n_files" -gt "$max" ] || exit 0
tmp="$(mktemp /tmp/pack_out.XXXXXX.tgz)"
( cd "$dir" && tar czf "$tmp" --exclude=./summary.txt . && find . -type f ! -name summary.txt -delete \
    && find . -mindepth 1 -type d -empty -delete )
mv "$tmp" "$dir/bundle.tgz"
echo "$n_files"
