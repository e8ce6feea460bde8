#!/usr/bin/env bash
# Builds of several revisions side by side, measured in one GPU run.
#
# A kernel change is judged against the code it replaces in the same run on the same machine
# (GPU timings move by several percent between machines and days). The GPU machine gets a copy
# of the working tree without the git history, so the other revisions travel as archives:
#
#   here:    dev/compare_builds.sh pack DIR REV...
#            writes DIR/<REV>.tar (git archive) for each REV; DIR must be git-ignored and
#            carried to the GPU machine (e.g. `.whl/compare` with carry [".whl"]).
#   there:   dev/compare_builds.sh run DIR COMMAND...
#            unpacks each archive under $TMPDIR/compare/<REV>, builds the extension of each and
#            of the working tree at once (the cores shared out), then runs COMMAND (one shell
#            string) in each tree in turn, with PYTHONPATH set to that tree, each output under a
#            "== <REV>" line ("== worktree" for the working tree). Build logs go to
#            $TMPDIR/compare/<REV>.build.log; a failed build is reported and skipped.
#
# Example: the decode GEMM at 16 rows on one shape, before and after two commits:
#   dev/compare_builds.sh pack .whl/compare 8fb46a7 e792e54
#   dev/compare_builds.sh run .whl/compare "python3 -c 'import sys; sys.path.insert(0, \"benchmarks\");
#       import bench_gemm as b; b.decode_section(28672, 8192, [16], False)'"
#
# Settings (read once, here): TMPDIR (default /tmp); MAX_JOBS, the cores to share out (default:
# all); QTENSOR_CUDA_ARCHS as for setup.py (exported unchanged); PYTHONPATH entries already set
# (such as the wheels' install folder) stay after the tree's own.
set -euo pipefail

usage() {
  sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2
  exit 2
}

cmd=${1:-}
[ $# -ge 3 ] || usage
dir=$2
shift 2
case "$cmd" in
  pack)
    mkdir -p "$dir"
    for rev in "$@"; do
      name=$(git rev-parse --short "$rev^{commit}") || { echo "compare_builds: no revision $rev" >&2; exit 1; }
      git archive -o "$dir/$name.tar" "$name"
      echo "$dir/$name.tar"
    done
    ;;
  run)
    [ $# -eq 1 ] || usage
    command=$1
    root=$(pwd)
    work=${TMPDIR:-/tmp}/compare
    mkdir -p "$work"
    trees=("$root")
    names=(worktree)
    for tar in "$dir"/*.tar; do
      [ -e "$tar" ] || { echo "compare_builds: no archives in $dir (run pack first)" >&2; exit 1; }
      name=$(basename "$tar" .tar)
      rm -rf "${work:?}/$name"
      mkdir -p "$work/$name"
      tar -xf "$tar" -C "$work/$name"
      trees+=("$work/$name")
      names+=("$name")
    done
    cores=${MAX_JOBS:-$(nproc)}
    jobs=$(( cores / ${#trees[@]} > 0 ? cores / ${#trees[@]} : 1 ))
    pids=()
    for i in "${!trees[@]}"; do
      (cd "${trees[$i]}" && MAX_JOBS=$jobs python3 setup.py build_ext --inplace \
        > "$work/${names[$i]}.build.log" 2>&1) &
      pids+=($!)
    done
    built=()
    for i in "${!trees[@]}"; do
      if wait "${pids[$i]}"; then
        built+=("$i")
      else
        echo "== ${names[$i]}: build failed (last lines of $work/${names[$i]}.build.log)"
        tail -5 "$work/${names[$i]}.build.log"
      fi
    done
    status=0
    for i in "${built[@]}"; do
      echo "== ${names[$i]}"
      (cd "${trees[$i]}" && PYTHONPATH="${trees[$i]}${PYTHONPATH:+:$PYTHONPATH}" \
        bash -c "$command") || status=$?
    done
    exit $status
    ;;
  *)
    usage
    ;;
esac
