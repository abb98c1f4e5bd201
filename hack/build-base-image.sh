#!/usr/bin/env bash
# Make a base image from Debian's packages, for machines that reach Debian's archive but no image
# registry: debootstrap a minimal bookworm with Python (3.11) and CA certificates, bring it up to date
# with bookworm-updates and -security, and `docker import` it. The rootfs tarball is cached under
# ~/.cache/kascade/images keyed by what went into it, so a second run only imports (seconds) or, when
# the image is already there, only checks. Prints the image name.
#   KASCADE_BASE_IMAGE   name to give it (default kascade/base:bookworm)
#   KASCADE_DEBIAN_MIRROR  (default http://deb.debian.org/debian)
#   KASCADE_BASE_REFRESH=1  debootstrap again (new security updates) instead of the cached tarball
# Both Dockerfiles take it as `--build-arg BASE=kascade/base:bookworm` (hack/build-images.sh does).
set -euo pipefail
cd "$(dirname "$0")/.."
NAME=${KASCADE_BASE_IMAGE:-kascade/base:bookworm}
SUITE=bookworm
MIRROR=${KASCADE_DEBIAN_MIRROR:-http://deb.debian.org/debian}
SECURITY_MIRROR=${KASCADE_DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
# python3-venv: the images' build stage makes its venv with it (ensurepip); a few MB in the runtime too
INCLUDE=python3,python3-venv,ca-certificates
CACHE=${KASCADE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kascade}/images
log() { echo "[build-base-image] $(date +%H:%M:%S) $*" >&2; }

# the key changes when anything that shapes the rootfs changes (this script included)
KEY=$(printf '%s\n' "$SUITE" "$MIRROR" "$SECURITY_MIRROR" "$INCLUDE" "$(sha256sum "$0" | cut -c1-64)" | sha256sum | cut -c1-16)
TARBALL=$CACHE/rootfs-$SUITE-$KEY.tar

# the imported image is also kept as a `docker save` tarball: loading it gives the same image ID every time
# (a new `docker import` would not), so the images' dependency layers built on it stay valid (build-images.sh
# keys them by the base's ID) when the Docker store is gone but ~/.cache is kept (CI)
SAVED=$CACHE/base-$SUITE-$KEY.docker.tar
current() { [ "$(docker image inspect -f '{{index .Config.Labels "io.kascade.base.key"}}' "$NAME" 2>/dev/null)" = "$KEY" ]; }
if [ "${KASCADE_BASE_REFRESH:-0}" != 1 ]; then
  current || { [ -s "$SAVED" ] && docker load -q -i "$SAVED" >/dev/null && log "$NAME loaded from $SAVED"; } || true
  if current; then
    log "$NAME is current (key $KEY)"
    echo "$NAME"
    exit 0
  fi
fi

if [ "${KASCADE_BASE_REFRESH:-0}" = 1 ] || [ ! -s "$TARBALL" ]; then
  command -v debootstrap >/dev/null || { log "debootstrap missing (hack/docker-up.sh installs it)"; exit 1; }
  [ "$(id -u)" = 0 ] || { log "debootstrap needs root"; exit 1; }
  mkdir -p "$CACHE"
  ROOTFS=$(mktemp -d "$CACHE/rootfs.XXXXXX")
  trap 'rm -rf "$ROOTFS" "$TARBALL.tmp"' EXIT
  t0=$(date +%s)
  log "debootstrap --variant=minbase $SUITE (+ $INCLUDE) from $MIRROR (~1 min)"
  debootstrap --variant=minbase --include="$INCLUDE" "$SUITE" "$ROOTFS" "$MIRROR" >"$ROOTFS.log" 2>&1 || {
    tail -n 30 "$ROOTFS.log" >&2; rm -f "$ROOTFS.log"; exit 1; }
  rm -f "$ROOTFS.log"
  cat >"$ROOTFS/etc/apt/sources.list" <<EOF
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb $SECURITY_MIRROR $SUITE-security main
EOF
  log "apt-get upgrade from $SUITE-updates and $SUITE-security"
  chroot "$ROOTFS" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive \
    sh -c 'apt-get -o APT::Sandbox::User=root update -qq && apt-get -o APT::Sandbox::User=root upgrade -y -qq --no-install-recommends >/dev/null && apt-get clean'
  # nothing the image needs: package lists, apt caches, logs, man pages; /usr/share/doc keeps the
  # copyright files
  rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/* "$ROOTFS"/var/cache/debconf/*-old \
         "$ROOTFS"/var/log/* "$ROOTFS"/usr/share/man/* "$ROOTFS"/usr/share/info/* "$ROOTFS"/tmp/* "$ROOTFS"/root/.bash_history
  rm -f "$ROOTFS"/etc/hostname "$ROOTFS"/etc/resolv.conf  # the container runtime writes these
  rm -f "$CACHE"/rootfs-"$SUITE"-*.tar  # older keys
  tar --numeric-owner -C "$ROOTFS" -cf "$TARBALL.tmp" .
  mv "$TARBALL.tmp" "$TARBALL"
  log "rootfs $(du -h "$TARBALL" | cut -f1) in $(( $(date +%s) - t0 )) s: $TARBALL"
fi

docker import \
  --change 'ENV LANG=C.UTF-8 PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change "LABEL io.kascade.base.key=$KEY org.opencontainers.image.description=\"Debian $SUITE minbase + python3 (hack/build-base-image.sh)\"" \
  --change 'CMD ["/bin/bash"]' \
  "$TARBALL" "$NAME" >/dev/null
log "$NAME imported ($(docker image inspect -f '{{.Size}}' "$NAME" | awk '{printf "%.0f MB", $1/1e6}'))"
rm -f "$CACHE"/base-"$SUITE"-*.docker.tar
docker save "$NAME" -o "$SAVED.tmp" && mv "$SAVED.tmp" "$SAVED"
echo "$NAME"
