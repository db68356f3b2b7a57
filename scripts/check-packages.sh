#!/usr/bin/env bash
# Checks that scripts/setup.sh installs every Debian package the build reads, so that a package
# installed by hand on one machine cannot hide a missing line in setup's list (a fresh machine
# would then fail at configure, as it once did for oneDNN's OpenCL dependency).
#
# What is read, three ways:
#   1. a CMake configure in a scratch directory, under strace (every file it opens or executes:
#      find_package configs and whatever they pull in, pkg-config files, compiler probes);
#   2. the compiler's dependency files (*.o.d) of the build directories given (default: build,
#      and build-fuzz / build-cuda / build-emu / build-emu-asan where they exist): every header the build included;
#   3. their link lines (link.txt): every library given by path or as -lNAME.
# Each file under /usr, /lib, /bin, /sbin or /etc is mapped to its Debian package (dpkg's file
# lists, merged-/usr aware); files no package owns (the CUDA toolkit under /usr/local, generated
# files) are not Debian's to install and are skipped. A package passes if it is in setup's
# PACKAGES, a dependency of one (apt-cache depends --recurse --installed), or Priority: required
# (on every Debian system). Anything else fails the check, named with a file that needed it.
#
#   scripts/check-packages.sh [BUILD_DIR...]   # all builds against PACKAGES + TEST_PACKAGES
#   scripts/check-packages.sh --demo            # what `scripts/setup.sh` alone builds (configure
#     without tests, the library parts and bertrain in build/) against PACKAGES alone: the demo's
#     first command installs no more than it needs, and no less
#   scripts/check-packages.sh --reuse --without PKG [--without PKG2]   # the last trace, as if
#     these were not listed: must fail naming them (the self-test; a package another listed one
#     depends on stays in the closure, so remove both)
set -euo pipefail
cd "$(dirname "$0")/.."

REUSE=0
DEMO=0
WITHOUT=()
DIRS=()
while (($#)); do
  case "$1" in
    --reuse) REUSE=1 ;;
    --demo) DEMO=1 ;;
    --without) WITHOUT+=("$2"); shift ;;
    -h|--help) sed -n '2,/^set /p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) DIRS+=("$1") ;;
  esac
  shift
done
if ((${#DIRS[@]} == 0)); then
  DIRS=(build)
  for d in build-fuzz build-cuda build-emu build-emu-asan; do [ -d "$d" ] && DIRS+=("$d"); done
fi
WORK=${CHECK_PACKAGES_DIR:-build/check-packages}
CONFIGURE_ARGS=()
if [ "$DEMO" = 1 ]; then
  DIRS=(build)
  WORK=$WORK-demo
  CONFIGURE_ARGS=(-DBERTRAIN_TESTS=OFF -DBERTRAIN_BENCH=OFF)
fi
mkdir -p "$WORK"

# --- setup's list (the same lines setup.sh reads) -------------------------------------------
lists='^PACKAGES=[(]'
[ "$DEMO" = 0 ] && lists='^(TEST_)?PACKAGES=[(]'
listed=$(awk -v start="$lists" '$0 ~ start {on = 1} on {print} on && /^\)/ {on = 0}' scripts/setup.sh |
  sed 's/#.*//; s/^[A-Z_]*=(//; s/)//' |
  tr -s ' \t' '\n\n' | grep -E '^[a-z0-9][a-z0-9.+-]+$' | sort -u)
for w in "${WITHOUT[@]}"; do listed=$(printf '%s\n' "$listed" | grep -vx -- "$w" || true); done
[ -n "$listed" ] || { echo "check-packages: no PACKAGES list found in scripts/setup.sh" >&2; exit 2; }

# Reads that succeed whatever is installed, so no package is needed for them: the loader's search
# path configuration (every file in /etc/ld.so.conf.d is read), locale data, and CMake/clang
# probing for optional linkers with --help. Directories are skipped too (listing one needs no
# package of the files in it).
PROBES='^/etc/ld\.so\.conf\.d/|^/etc/locale\.alias$|^/usr/(share|lib)/locale/|/ld\.lld$|/lld$|/ld\.gold$'

# --- files read --------------------------------------------------------------------------------
if [ "$REUSE" = 0 ] || [ ! -s "$WORK/files" ]; then
  command -v strace >/dev/null || { echo "check-packages: strace is missing (scripts/setup.sh installs it)" >&2; exit 2; }
  rm -rf "$WORK/configure"
  # Configure as setup does (plus the CUDA and fuzz projects where they are built), traced.
  strace -f -qq -e trace=open,openat,execve --status=successful -o "$WORK/trace" \
    cmake -S . -B "$WORK/configure" -DCMAKE_BUILD_TYPE=Release "${CONFIGURE_ARGS[@]}" \
    ${CMAKE_ARGS:-} >/dev/null
  if command -v clang++ >/dev/null && [ "$DEMO" = 0 ]; then
    strace -f -qq -e trace=open,openat,execve --status=successful -o "$WORK/trace-fuzz" \
      cmake -S tests/fuzz -B "$WORK/configure-fuzz" -DCMAKE_CXX_COMPILER=clang++ >/dev/null
  fi
  {
    cat "$WORK"/trace* | grep -oE '"/[^"]+"' | tr -d '"'
    for d in "${DIRS[@]}"; do
      [ -d "$d" ] || continue
      # (--demo: the top level's targets, the parts and bertrain; tests and bench are below)
      [ "$DEMO" = 1 ] && d=$d/CMakeFiles
      # gcc/clang -MD output: "target: dep dep \" lines.
      find "$d" -name '*.o.d' -print0 | xargs -0 -r cat | tr ' \\' '\n\n' | grep '^/' || true
      find "$d" -name link.txt -print0 | xargs -0 -r cat | tr ' ' '\n' | grep '^/' || true
      # -lNAME: the file the linker finds.
      find "$d" -name link.txt -print0 | xargs -0 -r cat | tr ' ' '\n' | sed -n 's/^-l\([^ ]\+\)$/\1/p' |
        sort -u | while read -r l; do
          for f in "lib$l.so" "lib$l.a"; do
            p=$(g++ -print-file-name="$f"); [ "$p" != "$f" ] && { echo "$p"; break; }
          done
        done
    done
  } | grep -E '^/(usr|lib|lib64|bin|sbin|etc)/' | grep -v '^/usr/local/' | sort -u |
    grep -vE "$PROBES" | while read -r f; do [ -f "$f" ] && echo "$f"; done > "$WORK/files" || true
fi

# --- owners --------------------------------------------------------------------------------
# path -> package from dpkg's file lists; merged /usr: /lib/x and /usr/lib/x are the same file.
canon() { sed -E 's#^/usr/(lib|lib64|bin|sbin)/#/\1/#'; }
(cd /var/lib/dpkg/info && for f in *.list; do awk -v p="${f%.list}" '{print $0 "\t" p}' "$f"; done) |
  sed 's/:[a-z0-9_]*$//' | awk -F'\t' '{print $1 "\t" $2}' > "$WORK/owners.raw"
canon < "$WORK/owners.raw" | sort -t$'\t' -k1,1 -u > "$WORK/owners"
while read -r f; do
  printf '%s\t%s\n' "$f" "$(readlink -f "$f" 2>/dev/null || echo "$f")"
done < "$WORK/files" | awk -F'\t' '{print $1; if ($2 != $1) print $2}' | canon | sort -u > "$WORK/files.canon"
join -t$'\t' "$WORK/files.canon" "$WORK/owners" > "$WORK/needed"
cut -f2 "$WORK/needed" | sort -u > "$WORK/needed.packages"

# --- allowed: setup's list, its dependency closure, and Priority: required -------------------
# shellcheck disable=SC2086
apt-cache depends --recurse --installed --no-recommends --no-suggests --no-conflicts --no-breaks \
  --no-replaces --no-enhances $listed 2>/dev/null | grep -E '^[a-z0-9]' | sed 's/:.*//' > "$WORK/allowed"
printf '%s\n' $listed >> "$WORK/allowed"
dpkg-query -W -f='${Package} ${Priority} ${Essential}\n' | awk '$2 == "required" || $3 == "yes" {print $1}' \
  >> "$WORK/allowed"
sort -u -o "$WORK/allowed" "$WORK/allowed"

missing=$(comm -23 "$WORK/needed.packages" "$WORK/allowed")
n_files=$(wc -l < "$WORK/files")
n_pkgs=$(wc -l < "$WORK/needed.packages")
if [ -n "$missing" ]; then
  echo "check-packages: the build reads files of packages that scripts/setup.sh does not install" >&2
  echo "(neither in its PACKAGES list nor a dependency of one); a fresh machine lacks them:" >&2
  for p in $missing; do
    echo "  $p   (e.g. $(awk -F'\t' -v p="$p" '$2 == p {print $1; exit}' "$WORK/needed"))" >&2
  done
  [ "$DEMO" = 1 ] && echo "fix: add them to PACKAGES in scripts/setup.sh (the demo's list)" >&2
  [ "$DEMO" = 0 ] && echo "fix: add them to PACKAGES or TEST_PACKAGES in scripts/setup.sh" >&2
  exit 1
fi
what="configure and build"; by="scripts/setup.sh --tests"
[ "$DEMO" = 1 ] && { what="the demo's configure and build"; by="scripts/setup.sh (PACKAGES alone)"; }
echo "check-packages: $n_files files read by $what come from $n_pkgs Debian packages, all installed by $by"
