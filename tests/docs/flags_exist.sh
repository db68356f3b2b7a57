#!/bin/bash
# Every flag README.md and docs/*.md name is a flag of bertrain (some subcommand's --help lists it),
# or of another tool the page runs, listed below with its owner: docs cannot promise a flag that
# was renamed or removed.
# usage: flags_exist.sh <bertrain binary>
set -u
BT=$1
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
# Flags of the other tools the pages show (the tool, for whoever reads a failure).
FOREIGN=(
  "--oversubscribe"   # mpirun
  "--mpi"             # srun --mpi=pmix
  "--gpus-per-task"   # Slurm
  "--logdir"          # tensorboard
  "--full"            # tests/faults/run.sh
  "--flag"            # design.md's words about this very test
  "--tests"           # scripts/setup.sh
  "--demo"            # scripts/check-packages.sh
  "--image"           # scripts/package.sh
  "--install"         # cmake --install
  "--requeue"         # sbatch --requeue
  "--no-kill"         # sbatch --no-kill
  "--overlap"         # srun --overlap
  "--kill-on-bad-exit" # srun --kill-on-bad-exit
  "--nodelist"        # srun --nodelist
  "--nodes"           # srun --nodes
  "--ntasks"          # srun --ntasks
)
subs=$("$BT" --help | awk '/^Subcommands:/{f=1; next} f && NF {print $1}')
[ -n "$subs" ] || { echo "FAIL: no subcommands in '$BT --help'"; exit 1; }
known=$({ "$BT" --help; for s in $subs; do "$BT" "$s" --help; done; } 2>&1 |
          grep -o -- '--[a-z][a-z0-9-]*' | sort -u)
failed=0
checked=0
for page in "$ROOT"/README.md "$ROOT"/docs/*.md; do
  while IFS=: read -r line flag; do
    checked=$((checked + 1))
    grep -qx -- "$flag" <<<"$known" && continue
    foreign=0
    for f in "${FOREIGN[@]}"; do [ "$flag" = "$f" ] && foreign=1; done
    [ $foreign = 1 ] && continue
    echo "FAIL: ${page#"$ROOT"/}:$line names $flag, which no bertrain command has (nor a tool this test knows)"
    failed=1
  done < <(grep -no -- '--[a-z][a-z0-9-]*' "$page")
done
# The README stays the front page: what bertrain is, the two commands, a quick start, links.
lines=$(wc -l <"$ROOT/README.md")
if [ "$lines" -gt 200 ]; then
  echo "FAIL: README.md has $lines lines; keep it under 200 and move the rest to docs/"
  failed=1
fi
[ $failed = 0 ] && echo "ok: $checked flags named in README.md and docs/ exist ($(wc -w <<<"$subs") subcommands)"
exit $failed
