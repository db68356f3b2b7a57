#!/usr/bin/env bash
# Makes bertrain's Debian package and, with --image, its container image, from the build directory
# scripts/setup.sh --tests made (the man page and the bash completion need help2man).
#   scripts/package.sh           $BUILD_DIR/bertrain_<version>_amd64.deb (CPack; its library
#                                dependencies derived by dpkg-shlibdeps)
#   scripts/package.sh --image   and the OCI image bertrain:<version>: Debian 12 from Debian's
#                                mirror (mmdebstrap; no other registry), the package installed by
#                                apt with what it depends on, ssh for the MPI Operator's launcher;
#                                no compilers, no headers, no docs. Imported into podman and saved
#                                as $BUILD_DIR/bertrain_<version>_oci.tar (skopeo copy
#                                oci-archive:... docker://your-registry/bertrain:<version>).
# The job specs bertrain writes (launch --emit mpijob|dlc) name that image unless theirs say other.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
IMAGE=0
case "${1:-}" in
  --image) IMAGE=1 ;;
  "") ;;
  -h|--help) sed -n '2,/^set /p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) echo "package: unknown argument $1 (--image, or nothing)" >&2; exit 2 ;;
esac

cmake --build "$BUILD_DIR" -j"$(nproc)" --target bertrain bertrain_man >/dev/null
rm -f "$BUILD_DIR"/bertrain_*_amd64.deb
(cd "$BUILD_DIR" && cpack -G DEB >/dev/null)
DEB=$(ls "$BUILD_DIR"/bertrain_*_amd64.deb)
VERSION=$(dpkg-deb -f "$DEB" Version)
echo "package: $DEB ($(du -k "$DEB" | cut -f1) KiB), depends: $(dpkg-deb -f "$DEB" Depends)"
[ "$IMAGE" = 1 ] || exit 0

for tool in mmdebstrap podman; do
  command -v $tool >/dev/null || { echo "package: --image needs $tool (scripts/setup.sh --tests installs it)" >&2; exit 2; }
done
ROOT_TAR=$BUILD_DIR/image-root.tar
# A lean Debian 12: minbase, no documentation or locales (the copyright files kept), the package
# and what it depends on from the mirror, ssh for mpirun's remote starts; apt's lists and caches
# are left out (mmdebstrap's cleanup), and so are ssh's host keys: each container makes its own.
mmdebstrap --quiet --variant=minbase --mode=root \
  --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
  --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
  --dpkgopt='path-exclude=/usr/share/info/*' \
  --include=openssh-client,openssh-server \
  --customize-hook="copy-in $DEB /tmp" \
  --customize-hook="chroot \"\$1\" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends /tmp/$(basename "$DEB") >/dev/null" \
  --customize-hook='rm -f "$1"/tmp/*.deb "$1"/etc/ssh/ssh_host_*' \
  --customize-hook='printf "Host *\n    StrictHostKeyChecking no\n    UserKnownHostsFile /dev/null\n" > "$1"/etc/ssh/ssh_config.d/mpi.conf' \
  --customize-hook='sed -i "s/^#\?StrictModes .*/StrictModes no/" "$1"/etc/ssh/sshd_config' \
  bookworm "$ROOT_TAR"
TAG=bertrain:$VERSION
podman rmi -f "$TAG" >/dev/null 2>&1 || true
# Workers start sshd (the MPI Operator's launcher reaches them with ssh); the launcher's mpirun
# runs as root, as pods do by default.
podman import --quiet \
  --change 'CMD ["/bin/sh", "-c", "ssh-keygen -A -q && mkdir -p /run/sshd && exec /usr/sbin/sshd -De"]' \
  --change 'ENV OMPI_ALLOW_RUN_AS_ROOT=1' --change 'ENV OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1' \
  --change "LABEL org.opencontainers.image.version=$VERSION" \
  --change 'LABEL org.opencontainers.image.title=bertrain' \
  "$ROOT_TAR" "$TAG" >/dev/null
rm -f "$ROOT_TAR"
OCI=$BUILD_DIR/bertrain_${VERSION}_oci.tar
rm -f "$OCI"
podman save --quiet --format oci-archive -o "$OCI" "$TAG"
echo "package: image $TAG, $(($(podman image inspect --format '{{.Size}}' "$TAG") / 1048576)) MiB" \
  "($OCI, $(($(stat -c %s "$OCI") / 1048576)) MiB)"
