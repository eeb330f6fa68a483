# Package sources for replay sandboxes, which have no network: the PyPI and
# Debian packages the agent traces install, downloaded once on the host and
# seen read-only in the sandbox at $SANDBOX_PACKAGES (a bind mount the replay
# adds), so `pip install` and `apt-get install` turns change the state they
# changed when the traces were recorded. Sourced after common.sh and images.sh.
#
# $CRAB_CACHE/packages/
#   pypi/files/*.whl           wheels for bookworm's python (CODE_REPAIR_PYTHON)
#   pypi/simple/<project>/     a PEP 503 index of them (PIP_INDEX_URL=file://...)
#   debian/*.deb, Packages     a flat Debian repository (trusted, file: URI)
#   .key                       what they were built from; unchanged key: nothing to do

PACKAGES_DIR="$CRAB_CACHE/packages"
# Where sandboxes see it, and what the images point pip and apt at.
SANDBOX_PACKAGES=/opt/crab-packages
PACKAGES_TOOL="$CRAB_ROOT/scripts/lib/packages.py"
PACKAGE_ENV=("PIP_INDEX_URL=file://$SANDBOX_PACKAGES/pypi/simple")
# Left out, with everything that needs them: each is hundreds of MB to GBs of
# wheels (CUDA libraries included). Their turns fail as they would offline.
PACKAGES_LEFT_OUT=(torch torchvision torchaudio tensorflow tensorflow-cpu tensorflow-intel
  tensorflow-io-gcs-filesystem jax jaxlib triton)
# Always in the index: what `pip install -e .` builds with, and pip itself.
PACKAGES_PIP_ALWAYS=(setuptools wheel pip)
# Seconds one requirement may take to resolve and download.
PACKAGES_PIP_TIMEOUT=120

# The requirements and Debian packages the traces' turns install (JSON).
packages_scan() {
  local traces=${CRAB_TRACES:-/work/shared/traces} files=()
  shopt -s nullglob
  files=("$traces"/*/*.jsonl)
  shopt -u nullglob
  python3 "$PACKAGES_TOOL" scan "${files[@]}"
}

# Wheels for each requirement (alone: one without a wheel for this python
# leaves the others alone), then the index.
packages_pypi() {
  local dir=$1
  shift
  local constraints req kept=0 skipped=() python=python3
  /usr/bin/python3 -m pip --version >/dev/null 2>&1 && python=/usr/bin/python3
  mkdir -p "$dir/files"
  # Files of the previous build are taken from there rather than downloaded again.
  local reuse=()
  [ -d "$PACKAGES_DIR/pypi/files" ] && reuse=(--find-links "$PACKAGES_DIR/pypi/files")
  constraints=$(mktemp)
  printf '%s<0\n' "${PACKAGES_LEFT_OUT[@]}" >"$constraints"
  for req in "${PACKAGES_PIP_ALWAYS[@]}" "$@"; do
    # Bounded: a requirement whose every version needs a framework left out makes pip
    # backtrack through all of them.
    if timeout "$PACKAGES_PIP_TIMEOUT" "$python" -m pip download --quiet --only-binary :all: --python-version "$CODE_REPAIR_PYTHON" \
      --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform linux_x86_64 \
      "${reuse[@]}" -c "$constraints" -d "$dir/files" "$req" >/dev/null 2>&1; then
      kept=$((kept + 1))
    else
      skipped+=("$req")
    fi
  done
  rm -f "$constraints"
  [ ${#skipped[@]} -eq 0 ] ||
    log "pypi: no wheels for python $CODE_REPAIR_PYTHON (or they need a framework left out): ${skipped[*]}"
  rm -rf "$dir/simple"
  python3 "$PACKAGES_TOOL" index "$dir/files" "$dir/simple" >/dev/null
  log "pypi: $kept requirements, $(find "$dir/files" -type f | wc -l) files ($(du -sh "$dir/files" | cut -f1))"
}

# The .debs a terminal sandbox lacks to install the packages (with their
# recommends, as `apt-get install -y` does), resolved in a scratch rootfs of
# the terminal recipe's packages, then a flat repository of them.
packages_debian() {
  local dir=$1
  shift
  mkdir -p "$dir"
  if [ $# -gt 0 ]; then
    local work
    work=$(mktemp -d "$CRAB_CACHE/.packages.XXXXXX")
    (
      trap 'rm -rf "$work"' EXIT
      recipe_debian "$work" "${TERMINAL_PACKAGES[@]}" >&2
      cp /etc/resolv.conf "$work/etc/resolv.conf"
      in_rootfs "$work" apt-get update -qq >&2
      local pkg
      for pkg in "$@"; do
        in_rootfs "$work" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --download-only "$pkg" >/dev/null 2>&1 ||
          log "debian: cannot resolve $pkg on $CRAB_SUITE, left out"
      done
      find "$work/var/cache/apt/archives" -maxdepth 1 -name '*.deb' -exec cp {} "$dir/" \;
    )
  fi
  (cd "$dir" && dpkg-scanpackages --multiversion . /dev/null 2>/dev/null >Packages)
  log "debian: $(find "$dir" -name '*.deb' | wc -l) packages ($(du -sh "$dir" | cut -f1))"
}

# Builds $PACKAGES_DIR unless it was built from the same traces and recipe;
# prints the digest of what the images depend on (the Debian index).
packages_ensure() {
  local scan key
  scan=$(packages_scan)
  key=$(recipe_key packages_pypi packages_debian PACKAGES_LEFT_OUT PACKAGES_PIP_ALWAYS CODE_REPAIR_PYTHON \
    TERMINAL_PACKAGES CRAB_SUITE "$scan" "$(sha256sum <"$PACKAGES_TOOL")")
  if [ "$(cat "$PACKAGES_DIR/.key" 2>/dev/null)" != "$key" ]; then
    local started=$SECONDS new="$PACKAGES_DIR.new"
    log "downloading the packages the traces install (key $key)"
    rm -rf "$new"
    local pip=() apt=()
    mapfile -t pip < <(jq -r '.pip[]' <<<"$scan")
    mapfile -t apt < <(jq -r '.apt[]' <<<"$scan")
    packages_pypi "$new/pypi" "${pip[@]}"
    packages_debian "$new/debian" "${apt[@]}"
    # Readable by the sandbox's users (apt reads a file: repository as _apt).
    chmod -R a+rX "$new"
    echo "$key" >"$new/.key"
    rm -rf "$PACKAGES_DIR"
    mv "$new" "$PACKAGES_DIR"
    log "package sources ready in $((SECONDS - started))s: $PACKAGES_DIR"
  fi
  sha256sum <"$PACKAGES_DIR/debian/Packages" | cut -c1-16
}

# In an image rootfs $1: apt knows the sandbox's file repository (its index
# read now, from $PACKAGES_DIR mounted where sandboxes see it), and `python`
# is python3 where the image has python3.
recipe_package_sources() {
  local root=$1
  mkdir -p "$root$SANDBOX_PACKAGES"
  echo "deb [trusted=yes] file:$SANDBOX_PACKAGES/debian ./" >"$root/etc/apt/sources.list.d/crab-packages.list"
  unshare --mount --propagation private -- sh -c '
    root=$1 packages=$2 at=$3
    mount --bind -o ro "$packages" "$root$at"
    mount -t proc proc "$root/proc"
    chroot "$root" apt-get update -qq -o Dir::Etc::sourcelist=sources.list.d/crab-packages.list \
      -o Dir::Etc::sourceparts=- -o APT::Get::List-Cleanup=0
  ' recipe_package_sources "$root" "$PACKAGES_DIR" "$SANDBOX_PACKAGES" >&2
  rm -rf "$root"/var/cache/apt/*.bin
}
