# Sandbox images built from scratch (no registry, no image tools) and imported
# into the private containerd. Sourced after common.sh and containerd.sh.
#
# Each image is an OCI layout tarball cached as
# $CRAB_IMAGE_CACHE/<name>-<key>.tar; the key hashes the recipe (the bash
# functions that build the rootfs, their package lists, the OCI writer and the
# host inputs they copy), so editing a recipe rebuilds only that image.

CRAB_IMAGE_CACHE="$CRAB_CACHE/images"
CRAB_IMAGE_PREFIX="crab.local"
CRAB_SUITE=bookworm
IMAGE_PATH_ENV="PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# More KEY=VALUE for the image being built (the Debian images: where pip finds packages).
IMAGE_EXTRA_ENV=()
OCI_WRITER="$CRAB_ROOT/scripts/lib/oci_image.py"
# Reads and unpacks the sdists of code-repair images; its text is in their keys.
SDIST_TOOL="$CRAB_ROOT/scripts/lib/sdist.py"

TERMINAL_PACKAGES=(python3 python3-pip python3-venv git procps curl nginx tmux vim-tiny openssl
  sqlite3 iproute2 net-tools jq file less)
# python-is-python3: `python` is python3, as in SWE-bench's images (agents run `python ...`).
CODE_REPAIR_PACKAGES=(python3 python3-pip python3-venv git procps python-is-python3)
# Python all code-repair wheels are resolved for: bookworm's python3.
CODE_REPAIR_PYTHON=3.11
# What the environments the traces were recorded in had besides the project and its test extra
# (pinned). pydicom's tests read data files that pydicom downloads when it does not have them;
# without pydicom-data a sandbox (no network) spends 21 s of download retries on each, and
# pydicom-1413's one-module test runs took 42 s against the 0.3 s recorded (0.3 s with it). Its
# two files whose bytes pydicom 2.3 no longer accepts are downloaded still, as they were when
# the traces were recorded: a run over the whole suite timed out there too (pydicom-1256).
declare -gA CODE_REPAIR_ENV_PACKAGES=([pydicom]="pydicom-data==1.0.0")

# ---- recipes: each fills the rootfs directory $1 -------------------------

recipe_busybox() {
  local root=$1 applet
  mkdir -p "$root"/{bin,sbin,usr/bin,usr/sbin,etc,root,proc,sys,dev,tmp}
  chmod 1777 "$root/tmp"
  chmod 0700 "$root/root"
  install -m 0755 /bin/busybox "$root/bin/busybox"
  for applet in $(/bin/busybox --list-full); do
    [ "$applet" = bin/busybox ] || ln -sf /bin/busybox "$root/$applet"
  done
  printf '%s\n' 'root:x:0:0:root:/root:/bin/sh' 'nobody:x:65534:65534:nobody:/nonexistent:/bin/false' >"$root/etc/passwd"
  printf '%s\n' 'root:x:0:' 'nogroup:x:65534:' >"$root/etc/group"
}

# The pod sandbox ("pause") image of the CRI containerd (scripts/cri-containerd):
# one static busybox that sleeps until CRI kills it. No registry is reachable
# to pull the usual one, and it only has to hold the pod's namespaces.
recipe_pause() {
  local root=$1
  mkdir -p "$root"/{bin,proc,sys,dev,etc}
  install -m 0755 /bin/busybox "$root/bin/busybox"
  printf '%s\n' 'root:x:0:0:root:/:/bin/busybox' >"$root/etc/passwd"
  printf '%s\n' 'root:x:0:' >"$root/etc/group"
}

# debootstrap minbase plus packages, then drop what only apt needs at build time.
recipe_debian() {
  local root=$1
  shift
  local include logfile
  include=$(IFS=,; echo "$*")
  mkdir -p "$CRAB_CACHE/debs" "$CRAB_CACHE/logs"
  logfile=$(mktemp "$CRAB_CACHE/logs/debootstrap.XXXXXX")
  debootstrap --variant=minbase --include="$include" --cache-dir="$CRAB_CACHE/debs" \
    "$CRAB_SUITE" "$root" "$(debian_mirror_uri)" >"$logfile" 2>&1 || {
    tail -20 "$logfile" >&2
    die "debootstrap failed (log: $logfile)"
  }
  rm -f "$logfile"
  chroot "$root" apt-get clean
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/log/*.log
  # The build host's name and resolver mean nothing inside a sandbox.
  echo sandbox >"$root/etc/hostname"
  : >"$root/etc/resolv.conf"
}

recipe_terminal() {
  local root=$1
  recipe_debian "$root" "${TERMINAL_PACKAGES[@]}"
  mkdir -p "$root/app"
}

recipe_code_repair_base() {
  recipe_debian "$1" "${CODE_REPAIR_PACKAGES[@]}"
}

# The same with the package sources (package_sources_on).
recipe_terminal_packages() {
  recipe_terminal "$1"
  recipe_package_sources "$1"
}

recipe_code_repair_base_packages() {
  recipe_code_repair_base "$1"
  recipe_package_sources "$1"
}

# Runs a command inside the rootfs with /proc and the host's /dev mounted in
# a private mount namespace, so no mount outlives the command even when it fails.
in_rootfs() {
  local root=$1
  shift
  unshare --mount --propagation private -- sh -c '
    root=$1; shift
    mount -t proc proc "$root/proc"
    mount --bind /dev "$root/dev"
    exec chroot "$root" env -i HOME=/root LANG=C.UTF-8 TERM=dumb PIP_ROOT_USER_ACTION=ignore \
      PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$@"
  ' in_rootfs "$root" "$@"
}

host_pip() {
  if /usr/bin/python3 -m pip --version >/dev/null 2>&1; then
    /usr/bin/python3 -m pip "$@"
  else
    python3 -m pip "$@"
  fi
}

# Downloads (host side, the sandbox has no network) the sdist of
# PROJECT==VERSION into $3/sdist and wheels for pytest and the project's
# dependencies into $3/wheels.
code_repair_download() {
  local project=$1 version=$2 dir=$3
  mkdir -p "$dir/sdist" "$dir/wheels"
  host_pip download --quiet --no-deps --no-binary :all: -d "$dir/sdist" "$project==$version" >"$dir/pip.log" 2>&1 || {
    cat "$dir/pip.log" >&2; die "could not download the sdist of $project==$version"; }
  local extra requirement="$project==$version"
  extra=$(code_repair_test_extra "$(find "$dir/sdist" -maxdepth 1 -type f | head -1)")
  echo "$extra" >"$dir/extra"
  [ -z "$extra" ] || requirement="${project}[$extra]==$version"
  host_pip download --quiet --only-binary :all: --python-version "$CODE_REPAIR_PYTHON" \
    --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform linux_x86_64 \
    -d "$dir/wheels" pytest "$requirement" >"$dir/pip.log" 2>&1 || {
    cat "$dir/pip.log" >&2; die "could not download wheels for pytest and $requirement"; }
}

# The extra that carries a project's test dependencies (tests, test or
# testing), read from the sdist's metadata; empty when it declares none.
code_repair_test_extra() {
  python3 "$SDIST_TOOL" test-extra "$1"
}

# $1 rootfs (a copy of the code-repair base), $2 project, $3 version, $4 download dir.
recipe_code_repair() {
  local root=$1 project=$2 version=$3 dl=$4 sdist
  sdist=$(find "$dl/sdist" -maxdepth 1 -type f | head -1)
  [ -n "$sdist" ] || die "no sdist for $project==$version in $dl/sdist"
  mkdir -p "$root/testbed" "$root/tmp/wheels"
  python3 "$SDIST_TOOL" unpack "$sdist" "$root/testbed"
  cp "$dl"/wheels/* "$root/tmp/wheels/"
  local pip_install=(python3 -m pip install --quiet --break-system-packages --no-index --find-links /tmp/wheels)
  in_rootfs "$root" "${pip_install[@]}" pytest
  # Editable, as SWE-bench does: edits in /testbed are what the tests import.
  # Debian's setuptools builds it, the sandbox has no index to fetch another.
  local extra target=/testbed
  extra=$(cat "$dl/extra")
  [ -z "$extra" ] || target="/testbed[$extra]"
  in_rootfs "$root" "${pip_install[@]}" --no-build-isolation -e "$target"
  rm -rf "$root/tmp/wheels" "$root/root/.cache"
  find "$root/testbed" -name __pycache__ -type d -prune -exec rm -rf {} +
  # Committed after the install so the working tree starts clean.
  printf '%s\n' '__pycache__/' '*.pyc' '.pytest_cache/' 'build/' >>"$root/testbed/.git-exclude.tmp"
  in_rootfs "$root" sh -ec '
    cd /testbed
    git init -q -b main
    cat .git-exclude.tmp >>.git/info/exclude
    rm .git-exclude.tmp
    git add -A
    git -c user.name=crab -c user.email=crab@localhost commit -q -m "$1 $2 (sdist)"
  ' sh "$project" "$version"
}

# ---- packing and import ---------------------------------------------------

# Tars a rootfs into an uncompressed, name-sorted layer: /dev, /proc and /sys
# stay empty mount points (the runtime provides them).
pack_layer() {
  local root=$1 out=$2
  tar --create --file "$out" --directory "$root" --numeric-owner --sort=name \
    --format=posix --pax-option=delete=atime,delete=ctime \
    --xattrs --xattrs-include=security.capability \
    --anchored --exclude=./dev/* --exclude=./proc/* --exclude=./sys/* .
}

# Hash of everything that defines an image's content. Each word is a recipe
# function (hashed by its source), a variable (by its value) or a literal
# (host package version, arguments).
recipe_key() {
  local word
  {
    for word in "$@" pack_layer IMAGE_PATH_ENV; do
      # A literal such as NAME=value is no function name: declare -F would say so on stderr.
      if declare -F "$word" >/dev/null 2>&1; then
        declare -f "$word"
      elif declare -p "$word" >/dev/null 2>&1; then
        declare -p "$word"
      else
        printf '%s\n' "$word"
      fi
    done
    cat "$OCI_WRITER"
  } | sha256sum | cut -c1-16
}

image_ref() { echo "$CRAB_IMAGE_PREFIX/$1:latest"; }

# Package sources (scripts/lib/packages.sh) go into the terminal and code-repair images only
# when asked for (CRAB_PACKAGE_SOURCES=1, or scripts/build-images --package-sources; scripts/eval
# does): they download about 560 MB once and tie the image keys to the newest package versions
# of the day, which CI, the demo and the tests need neither of. Without them the images are
# built exactly as before they existed (same recipes, same keys).
package_sources_on() {
  case "${CRAB_PACKAGE_SOURCES:-0}" in
    0) return 1 ;;
    1) return 0 ;;
    *) die "CRAB_PACKAGE_SOURCES must be 0 or 1, got '$CRAB_PACKAGE_SOURCES'" ;;
  esac
}

# The cache file name of image $1's tarball: the variant with package sources has its own,
# so building one variant does not prune the other's tarball.
image_cache_name() {
  if package_sources_on; then echo "$1+packages"; else echo "$1"; fi
}

# Runs recipe $2 (with the remaining arguments) on an empty rootfs and packs
# it into the layer tar $1, atomically; the scratch rootfs never outlives it.
build_layer() {
  local out=$1 recipe=$2
  shift 2
  local work
  work=$(mktemp -d "$CRAB_IMAGE_CACHE/.work.XXXXXX")
  (
    trap 'rm -rf "$work"' EXIT
    mkdir "$work/rootfs"
    # Recipes log to stderr; stdout is reserved for the caller's result.
    "$recipe" "$work/rootfs" "$@" >&2
    pack_layer "$work/rootfs" "$work/layer.tar"
    mv "$work/layer.tar" "$out"
  )
}

# Removes cached artifacts of an image that a newer recipe key superseded.
prune_superseded() {
  local keep=$1 pattern=$2
  find "$CRAB_IMAGE_CACHE" -maxdepth 1 -name "$pattern" ! -name "$(basename "$keep")" -delete
}

# Builds the OCI tarball for image $1 unless cached; prints its path.
# $2 is the recipe function, $3 the key, $4 Cmd (JSON), $5 WorkingDir,
# the rest are the recipe's extra arguments.
image_build_cached() {
  local name=$1 recipe=$2 key=$3 cmd=$4 workdir=$5
  shift 5
  local file
  file=$(image_cache_name "$name")
  local out="$CRAB_IMAGE_CACHE/$file-$key.tar"
  if [ ! -f "$out" ]; then
    local layer="$CRAB_IMAGE_CACHE/.layer-$file-$key.tar" started=$SECONDS
    log "building $name (recipe key $key)"
    build_layer "$layer" "$recipe" "$@"
    local env=(--env "$IMAGE_PATH_ENV") e
    for e in "${IMAGE_EXTRA_ENV[@]}"; do env+=(--env "$e"); done
    python3 "$OCI_WRITER" --layer "$layer" --output "$out" \
      --name "$(image_ref "$name")" --cmd "$cmd" --workdir "$workdir" "${env[@]}" \
      --label "dev.crab.recipe-key=$key" >/dev/null || { rm -f "$layer"; die "writing $out failed"; }
    rm -f "$layer"
    prune_superseded "$out" "$file-*.tar"
    log "built $name in $((SECONDS - started))s: $out ($(du -h "$out" | cut -f1))"
  fi
  echo "$out"
}

# Manifest digest inside an OCI layout tarball.
oci_tar_digest() {
  tar -xOf "$1" --occurrence=1 index.json | jq -r '.manifests[0].digest'
}

# Imports the tarball as image $1 unless containerd has that digest already.
image_import() {
  local name=$1 tarball=$2 ref want have
  ref=$(image_ref "$name")
  want=$(oci_tar_digest "$tarball")
  have=$(ctrd_image_digest "$ref")
  if [ "$have" = "$want" ]; then
    log "$ref is up to date ($want)"
    return 0
  fi
  local started=$SECONDS
  ctrd_ctr images import "$tarball" >/dev/null
  have=$(ctrd_image_digest "$ref")
  [ "$have" = "$want" ] || die "import of $tarball gave $ref digest '${have:-none}', expected $want"
  log "imported $ref ($want) in $((SECONDS - started))s"
}

# Serialises builds of one image across concurrent callers.
with_image_lock() {
  local name=$1
  shift
  mkdir -p "$CRAB_IMAGE_CACHE"
  (
    flock 9
    "$@"
  ) 9>"$CRAB_IMAGE_CACHE/.$name.lock"
}

validate_name_part() {
  [[ "$2" =~ ^[A-Za-z0-9][A-Za-z0-9._-]*$ ]] || die "invalid $1 '$2': letters, digits, '.', '_' and '-' only"
}

# ---- public entry points --------------------------------------------------

image_busybox() {
  local key tarball
  key=$(recipe_key recipe_busybox "$(dpkg-query -W -f='${Version}' busybox-static)")
  tarball=$(with_image_lock busybox image_build_cached busybox recipe_busybox "$key" '["sh"]' /)
  image_import busybox "$tarball"
}

image_pause() {
  local key tarball
  key=$(recipe_key recipe_pause "$(dpkg-query -W -f='${Version}' busybox-static)")
  tarball=$(with_image_lock pause image_build_cached pause recipe_pause "$key" '["/bin/busybox","sleep","infinity"]' /)
  image_import pause "$tarball"
}

image_terminal() {
  local key tarball
  if package_sources_on; then
    local packages IMAGE_EXTRA_ENV=("${PACKAGE_ENV[@]}")
    packages=$(with_image_lock packages packages_ensure)
    key=$(recipe_key recipe_terminal_packages recipe_terminal recipe_debian recipe_package_sources TERMINAL_PACKAGES \
      CRAB_SUITE SANDBOX_PACKAGES IMAGE_EXTRA_ENV "packages $packages")
    tarball=$(with_image_lock terminal image_build_cached terminal recipe_terminal_packages "$key" '["sleep","infinity"]' /app)
  else
    key=$(recipe_key recipe_terminal recipe_debian TERMINAL_PACKAGES CRAB_SUITE)
    tarball=$(with_image_lock terminal image_build_cached terminal recipe_terminal "$key" '["sleep","infinity"]' /app)
  fi
  image_import terminal "$tarball"
}

# The code-repair base rootfs is cached as a layer tar so every project
# shares one debootstrap.
code_repair_base_tar() {
  local key out recipe=recipe_code_repair_base file
  file=$(image_cache_name code-repair-base)
  if package_sources_on; then
    local packages
    packages=$(with_image_lock packages packages_ensure)
    recipe=recipe_code_repair_base_packages
    key=$(recipe_key recipe_code_repair_base_packages recipe_code_repair_base recipe_debian recipe_package_sources \
      CODE_REPAIR_PACKAGES CRAB_SUITE SANDBOX_PACKAGES "packages $packages")
  else
    key=$(recipe_key recipe_code_repair_base recipe_debian CODE_REPAIR_PACKAGES CRAB_SUITE)
  fi
  out="$CRAB_IMAGE_CACHE/$file-$key.layer.tar"
  if [ ! -f "$out" ]; then
    local started=$SECONDS
    log "building the code-repair base rootfs (recipe key $key)"
    build_layer "$out" "$recipe"
    prune_superseded "$out" "$file-*.layer.tar"
    log "built the code-repair base in $((SECONDS - started))s"
  fi
  echo "$out"
}

recipe_code_repair_from_base() {
  local root=$1 base=$2 project=$3 version=$4 dl=$5
  tar -xf "$base" -C "$root" --numeric-owner --same-permissions --xattrs --xattrs-include=security.capability
  recipe_code_repair "$root" "$project" "$version" "$dl"
}

# The same, then the project's CODE_REPAIR_ENV_PACKAGES from the wheels in $6. A recipe of its
# own, so that the images of projects without any keep their keys.
recipe_code_repair_with_env_packages() {
  local root=$1 project=$3 env_dl=$6
  recipe_code_repair_from_base "${@:1:5}"
  mkdir -p "$root/tmp/wheels"
  cp "$env_dl"/*.whl "$root/tmp/wheels/"
  # shellcheck disable=SC2086 # one word per requirement
  in_rootfs "$root" python3 -m pip install --quiet --break-system-packages --no-index --no-deps \
    --find-links /tmp/wheels ${CODE_REPAIR_ENV_PACKAGES[$project]}
  rm -rf "$root/tmp/wheels" "$root/root/.cache"
}

# Downloads (host side) the wheels of REQUIREMENT... into $1.
code_repair_download_env_packages() {
  local dir=$1
  shift
  mkdir -p "$dir"
  host_pip download --quiet --no-deps --only-binary :all: --python-version "$CODE_REPAIR_PYTHON" \
    -d "$dir" "$@" >"$dir/pip.log" 2>&1 || { cat "$dir/pip.log" >&2; die "could not download $*"; }
}

# The image name of PROJECT VERSION: lowercased (an image reference's repository must be),
# exactly as crab-replay derives it from a trace header (code_repair_image_name in
# crates/crab-replay/src/trace.rs); the header keeps the project's own spelling, which pip needs.
code_repair_image_name() {
  printf 'code-repair-%s-%s\n' "${1,,}" "${2,,}"
}

image_code_repair() {
  local project=$1 version=$2
  validate_name_part project "$project"
  validate_name_part version "$version"
  local name base key tarball dl sdist_tool IMAGE_EXTRA_ENV=()
  ! package_sources_on || IMAGE_EXTRA_ENV=("${PACKAGE_ENV[@]}")
  name=$(code_repair_image_name "$project" "$version")
  base=$(with_image_lock code-repair-base code_repair_base_tar)
  sdist_tool="sdist.py $(sha256sum <"$SDIST_TOOL" | cut -c1-16)"
  local recipe=recipe_code_repair_from_base env_packages=${CODE_REPAIR_ENV_PACKAGES[$project]:-} env_key=() env_dl=
  if [ -n "$env_packages" ]; then
    recipe=recipe_code_repair_with_env_packages
    env_key=(recipe_code_repair_with_env_packages code_repair_download_env_packages "env packages $env_packages")
  fi
  key=$(recipe_key recipe_code_repair_from_base recipe_code_repair code_repair_download \
    code_repair_test_extra in_rootfs CODE_REPAIR_PYTHON "${IMAGE_EXTRA_ENV[@]}" "$sdist_tool" "$(basename "$base")" "$project" "$version" \
    "${env_key[@]}")
  if [ -f "$CRAB_IMAGE_CACHE/$(image_cache_name "$name")-$key.tar" ]; then
    tarball="$CRAB_IMAGE_CACHE/$(image_cache_name "$name")-$key.tar"
  else
    dl="$CRAB_CACHE/pypi/$project-$version-$(recipe_key code_repair_download code_repair_test_extra CODE_REPAIR_PYTHON "$sdist_tool")"
    if [ ! -f "$dl/.complete" ]; then
      rm -rf "$dl"
      code_repair_download "$project" "$version" "$dl"
      touch "$dl/.complete"
      find "$CRAB_CACHE/pypi" -mindepth 1 -maxdepth 1 -name "$project-$version-*" ! -path "$dl" -exec rm -rf {} +
    fi
    if [ -n "$env_packages" ]; then
      env_dl="$CRAB_CACHE/pypi/env-$project-$(recipe_key code_repair_download_env_packages CODE_REPAIR_PYTHON "$env_packages")"
      if [ ! -f "$env_dl/.complete" ]; then
        rm -rf "$env_dl"
        # shellcheck disable=SC2086 # one word per requirement
        code_repair_download_env_packages "$env_dl" $env_packages
        touch "$env_dl/.complete"
      fi
    fi
    tarball=$(with_image_lock "$name" image_build_cached "$name" "$recipe" "$key" '["sleep","infinity"]' /testbed \
      "$base" "$project" "$version" "$dl" "$env_dl")
  fi
  image_import "$name" "$tarball"
}

# "project version" lines for every code-repair trace header.
code_repair_pairs_from_traces() {
  local traces=${CRAB_TRACES:-/work/shared/traces} f
  for f in "$traces"/*/*.jsonl; do
    [ -f "$f" ] && head -n1 "$f"
  done | jq -r 'select(.image == "code-repair") | "\(.project) \(.version)"' | sort -u
}

source "$CRAB_ROOT/scripts/lib/packages.sh"
