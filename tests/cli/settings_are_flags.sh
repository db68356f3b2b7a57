#!/usr/bin/env bash
# Library messages name settings by field, setting("seq_len"), and the CLI shows each as its flag
# (src/cli/main.cpp). This checks that every field named anywhere in src/ is a real flag of some
# command, so no message tells a user to change a flag that does not exist.
#   tests/cli/settings_are_flags.sh BERTRAIN SRC_DIR
set -euo pipefail
bertrain=$1
src=$2
help=$("$bertrain" --help 2>&1)
commands=$(printf '%s\n' "$help" | awk 'tolower($0) ~ /^subcommands:/{on=1; next} on && NF {print $1}')
all=""
for c in $commands; do all+=$("$bertrain" "$c" --help 2>&1)$'\n'; done
fields=$(grep -rhoE 'setting\("[a-z_]+"\)' "$src" | sed -E 's/setting\("([a-z_]+)"\)/\1/' | sort -u)
[ -n "$fields" ] || { echo "no setting(\"...\") found under $src"; exit 1; }
missing=0
for f in $fields; do
  flag="--${f//_/-}"
  if ! grep -qE -- "(^|[ ,])${flag}([ =,]|$)" <<<"$all"; then
    echo "setting(\"$f\") is named in a message, but no command has $flag"
    missing=1
  fi
done
n=$(wc -w <<<"$fields")
[ $missing -eq 0 ] && echo "all $n settings named in messages are flags: $(tr '\n' ' ' <<<"$fields")"
exit $missing
