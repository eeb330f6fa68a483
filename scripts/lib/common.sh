# Shared helpers for crab's scripts. Sourced, never executed.
# Every script that sources this runs as root on a Debian bookworm machine.

set -euo pipefail
shopt -s inherit_errexit

CRAB_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# Slow artifacts (CRIU build, image tarballs) are cached here; nothing depends
# on the cache existing: every step rebuilds what is missing.
CRAB_CACHE="${CRAB_CACHE:-/var/cache/crab-dev}"

log() { printf '[%s] %s\n' "$(basename "$0")" "$*" >&2; }
die() { log "error: $*"; exit 1; }

need_root() { [ "$(id -u)" = 0 ] || die "must run as root"; }

# The Debian archive URI this machine's apt uses (deb822 or one-line format),
# so nothing in the repository names a mirror.
debian_mirror_uri() {
  local uri=""
  if [ -f /etc/apt/sources.list.d/debian.sources ]; then
    uri=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources)
  fi
  if [ -z "$uri" ] && [ -f /etc/apt/sources.list ]; then
    uri=$(awk '$1 == "deb" && $0 ~ / bookworm / {for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\//) {print $i; exit}}' /etc/apt/sources.list)
  fi
  [ -n "$uri" ] || die "cannot find the Debian archive URI in /etc/apt/sources.list.d/debian.sources or /etc/apt/sources.list"
  echo "$uri"
}

# rustup installs cargo into ~/.cargo/bin, which non-login shells (CI, sudo)
# often lack on PATH.
ensure_cargo() {
  local dir
  for dir in "${CARGO_HOME:-$HOME/.cargo}/bin" /root/.cargo/bin; do
    case ":$PATH:" in *":$dir:"*) ;; *) [ -x "$dir/cargo" ] && PATH="$dir:$PATH" ;; esac
  done
  export PATH
  command -v cargo >/dev/null 2>&1 ||
    die "cargo not found on PATH or in ~/.cargo/bin: install the Rust toolchain with rustup (rustup toolchain install stable), then re-run"
  cargo --version >/dev/null 2>&1 ||
    die "cargo is present but does not run (rustup has no default toolchain? try: rustup default stable)"
}

# The binaries containerd runs, staged in one directory (CRAB_SHIM_DIR, on
# containerd's PATH): the shim built for size ([profile.shim] in Cargo.toml:
# one runs per container, so its resident size is paid per sandbox), crabd and
# crabctl from the release build. Each is replaced by a rename, so shims that
# are running keep their binary. Prints the directory.
stage_crab_bins() {
  local target_dir="${CARGO_TARGET_DIR:-$CRAB_ROOT/target}" dir b from
  dir="$target_dir/crab-bin"
  (cd "$CRAB_ROOT" && cargo build --release --quiet --bin crabd --bin crabctl --bin crab-replay &&
    cargo build --profile shim --quiet --bin containerd-shim-crab-v2) >&2 || die "building the shim, crabd, crabctl and crab-replay failed"
  mkdir -p "$dir"
  for b in containerd-shim-crab-v2 crabd crabctl crab-replay; do
    from="$target_dir/release/$b"
    [ "$b" = containerd-shim-crab-v2 ] && from="$target_dir/shim/$b"
    install -m 0755 "$from" "$dir/.$b.tmp"
    mv -f "$dir/.$b.tmp" "$dir/$b"
  done
  echo "$dir"
}

# crab-init runs as PID 1 inside containers whose images may have no libc
# (busybox), so it is linked statically. It is built for the explicit host
# target: that keeps it in its own directory, where no later
# `cargo build --workspace` replaces it with a dynamically linked one.
CRAB_INIT_INSTALL="${CRAB_INIT_INSTALL:-/usr/local/lib/crab/crab-init}"
install_crab_init() {
  local target_dir="${CARGO_TARGET_DIR:-$CRAB_ROOT/target}" triple built
  triple=$(rustc -vV | awk '/^host:/ {print $2}')
  [ -n "$triple" ] || die "cannot tell the host target from rustc -vV"
  log "building static crab-init ($triple)"
  (cd "$CRAB_ROOT" && RUSTFLAGS="-C target-feature=+crt-static" \
    cargo build --release --quiet -p crab-init --bin crab-init --target "$triple")
  built="$target_dir/$triple/release/crab-init"
  if readelf -l "$built" | grep -q 'Requesting program interpreter'; then
    die "$built is dynamically linked; containers without libc could not run it"
  fi
  # Running containers have the installed file bind-mounted: a new inode in
  # its place turns theirs into a deleted file, which every later dump must
  # carry (the shim's CRIU config allows for that). The same build leaves it.
  if cmp -s "$built" "$CRAB_INIT_INSTALL"; then
    log "crab-init at $CRAB_INIT_INSTALL is up to date"
    return 0
  fi
  install -D -m 0755 "$built" "$CRAB_INIT_INSTALL.tmp"
  mv -f "$CRAB_INIT_INSTALL.tmp" "$CRAB_INIT_INSTALL"
  log "crab-init installed at $CRAB_INIT_INSTALL"
}
