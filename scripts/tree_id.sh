#!/usr/bin/env bash
# Prints a content id of the work tree: sha1 over the tracked and untracked-but-not-ignored files that exist (names
# and contents), 12 hex digits. Why: the GPU machine's copy of the tree carries a stale .git (its `git rev-parse
# HEAD` named an old commit in every log of 2026-12-06; its index may list files since deleted, and files added
# since count as untracked, so both kinds are listed and missing ones skipped), so gpu_run.sh records this id
# too; run it here on a commit's checkout to tell which commit a log's tree was.
set -eu
cd "${1:-.}"
git ls-files -co --exclude-standard -z | sort -z -u | while IFS= read -r -d '' f; do
  [ -f "$f" ] && printf '%s\0' "$f"
done | xargs -0 -r sha1sum | sha1sum | cut -c1-12
