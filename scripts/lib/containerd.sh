# Private containerd for crab's scripts and tests. Sourced after common.sh.
#
# One instance per CRAB_CTRD_DIR: state, socket, log and pid file live there
# (tmpfs, gone after a reboot), the content store and snapshots live in
# CRAB_CTRD_ROOT on disk so imported images survive restarts.

CRAB_CTRD_DIR="${CRAB_CTRD_DIR:-/run/crab-dev}"
CRAB_CTRD_ROOT="${CRAB_CTRD_ROOT:-/var/lib/crab-dev/containerd}"
CRAB_CTRD_SOCK="$CRAB_CTRD_DIR/containerd.sock"
CRAB_CTRD_STATE="$CRAB_CTRD_DIR/state"
CRAB_CTRD_CONFIG="$CRAB_CTRD_DIR/config.toml"
CRAB_CTRD_LOG="$CRAB_CTRD_DIR/containerd.log"
CRAB_CTRD_PIDFILE="$CRAB_CTRD_DIR/containerd.pid"
CRAB_NS="${CRAB_NS:-crab}"
# containerd resolves `io.containerd.crab.v2` to `containerd-shim-crab-v2` on
# its own PATH when a task starts, so the shim may be built after containerd.
# stage_crab_bins (common.sh) fills this directory.
CRAB_SHIM_DIR="${CRAB_SHIM_DIR:-${CARGO_TARGET_DIR:-$CRAB_ROOT/target}/crab-bin}"
CRAB_CTRD_START_TIMEOUT="${CRAB_CTRD_START_TIMEOUT:-30}"

ctrd_ctr() {
  ctr --address "$CRAB_CTRD_SOCK" --namespace "$CRAB_NS" "$@"
}

ctrd_answers() {
  [ -S "$CRAB_CTRD_SOCK" ] || return 1
  timeout 5 ctr --address "$CRAB_CTRD_SOCK" version >/dev/null 2>&1
}

# Pid of the containerd that serves our config, empty when there is none.
ctrd_pid() {
  local pid
  [ -f "$CRAB_CTRD_PIDFILE" ] || return 0
  pid=$(cat "$CRAB_CTRD_PIDFILE" 2>/dev/null || true)
  [ -n "$pid" ] && [ -r "/proc/$pid/cmdline" ] || return 0
  # A recycled pid must not be mistaken for ours: check it runs our config.
  tr '\0' ' ' <"/proc/$pid/cmdline" | grep -qF -- "--config $CRAB_CTRD_CONFIG" && echo "$pid"
  return 0
}

# The part of a private containerd's config every instance shares: its own
# root, state, sockets and opt directory, the snapshotters it cannot use here
# disabled. $1 = cri-off also disables the CRI plugin, which would start its
# own networking and streaming server (the plain instance); the CRI
# instance (cri.sh) appends its plugin's section after this.
ctrd_config_base() {
  local cri_line=""
  [ "${1:-}" = cri-off ] && cri_line='  "io.containerd.grpc.v1.cri",'
  cat <<EOF
version = 2
root = "$CRAB_CTRD_ROOT"
state = "$CRAB_CTRD_STATE"
disabled_plugins = [
${cri_line:+$cri_line
}  "io.containerd.snapshotter.v1.aufs",
  "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.snapshotter.v1.zfs",
]

[grpc]
  address = "$CRAB_CTRD_SOCK"

[ttrpc]
  address = "$CRAB_CTRD_SOCK.ttrpc"

[debug]
  address = "$CRAB_CTRD_DIR/debug.sock"
  level = "${CRAB_CTRD_LOG_LEVEL:-info}"

[metrics]
  address = ""

[plugins]
  [plugins."io.containerd.internal.v1.opt"]
    path = "$CRAB_CTRD_ROOT/opt"
EOF
}

ctrd_write_config() {
  local tmp="$CRAB_CTRD_CONFIG.tmp"
  # The v1 runtime stays (1.6's tasks service needs it) but never runs a task.
  ctrd_config_base cri-off >"$tmp"
  mv -f "$tmp" "$CRAB_CTRD_CONFIG"
}

# Removes what a dead instance left behind so a new one can bind its sockets.
ctrd_clear_stale() {
  rm -f "$CRAB_CTRD_PIDFILE" "$CRAB_CTRD_DIR/shim-dir" "$CRAB_CTRD_SOCK" "$CRAB_CTRD_SOCK.ttrpc" "$CRAB_CTRD_DIR/debug.sock"
}

ctrd_start() {
  need_root
  command -v containerd >/dev/null || die "containerd is not installed (run scripts/install-deps)"
  if ctrd_answers; then
    ctrd_warn_shim_dir
    return 0
  fi
  local pid
  pid=$(ctrd_pid)
  if [ -n "$pid" ]; then
    # Ours but not answering: give a just-started instance a moment, then replace it.
    for _ in 1 2 3 4 5 6 7 8 9 10; do
      ctrd_answers && return 0
      sleep 0.5
    done
    log "containerd pid $pid does not answer on $CRAB_CTRD_SOCK; restarting it"
    ctrd_kill_pid "$pid"
  elif [ -S "$CRAB_CTRD_SOCK" ] && fuser "$CRAB_CTRD_SOCK" >/dev/null 2>&1; then
    die "$CRAB_CTRD_SOCK is held by a process that is not this script's containerd (see: fuser -v $CRAB_CTRD_SOCK)"
  fi
  ctrd_clear_stale
  mkdir -p "$CRAB_CTRD_DIR" "$CRAB_CTRD_STATE" "$CRAB_CTRD_ROOT"
  ctrd_write_config
  # containerd 1.6 unpacks each checkpoint image it restores from into a new
  # directory under $XDG_RUNTIME_DIR (else /tmp) and never removes it: up to
  # tens of MB per restore. Here they go to a directory of this instance that
  # each start empties (a restore's directory is only read while it restores).
  local restore_tmp="$CRAB_CTRD_ROOT/restore-tmp"
  rm -rf "$restore_tmp"
  mkdir -m 0700 -p "$restore_tmp"
  log "starting containerd (socket $CRAB_CTRD_SOCK, root $CRAB_CTRD_ROOT, log $CRAB_CTRD_LOG)"
  # setsid + nohup: the daemon must outlive the shell (and terminal) that started it.
  XDG_RUNTIME_DIR="$restore_tmp" PATH="$CRAB_SHIM_DIR:$PATH" setsid nohup containerd --config "$CRAB_CTRD_CONFIG" \
    </dev/null >>"$CRAB_CTRD_LOG" 2>&1 &
  local launched=$!
  echo "$launched" >"$CRAB_CTRD_PIDFILE"
  echo "$CRAB_SHIM_DIR" >"$CRAB_CTRD_DIR/shim-dir"
  local deadline=$((SECONDS + CRAB_CTRD_START_TIMEOUT))
  until ctrd_answers; do
    # Until setsid and nohup have exec'd containerd, the launched pid still
    # runs another command line, so ctrd_pid cannot tell it from a dead one
    # (under load that window is long): what counts is whether the launched
    # process or a containerd of our config is alive.
    if ! pid_alive "$launched" && [ -z "$(ctrd_find_pid)" ]; then
      tail -20 "$CRAB_CTRD_LOG" >&2
      die "containerd exited during start-up (log: $CRAB_CTRD_LOG)"
    fi
    [ "$SECONDS" -lt "$deadline" ] || die "containerd did not answer within ${CRAB_CTRD_START_TIMEOUT}s (log: $CRAB_CTRD_LOG)"
    sleep 0.2
  done
  # setsid forks when it is started as a process-group leader, so the
  # launched pid need not be containerd's: record the one that answers.
  pid=$(ctrd_find_pid)
  [ -n "$pid" ] && echo "$pid" >"$CRAB_CTRD_PIDFILE"
  return 0
}

# True while the process runs; a zombie (exited, not yet reaped) is not alive.
pid_alive() {
  local state
  state=$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) || return 1
  [ -n "$state" ] && [ "$state" != Z ]
}

# Pid of a running containerd started with our config, whatever the pid file says.
ctrd_find_pid() {
  local p cmd
  for p in /proc/[0-9]*; do
    cmd=$(tr '\0' ' ' 2>/dev/null <"$p/cmdline") || continue
    case "$cmd" in
      "containerd --config $CRAB_CTRD_CONFIG "*) echo "${p#/proc/}"; return 0 ;;
    esac
  done
  return 0
}

# A running instance keeps the shim directory it was started with.
ctrd_warn_shim_dir() {
  local running
  running=$(cat "$CRAB_CTRD_DIR/shim-dir" 2>/dev/null || true)
  if [ -n "$running" ] && [ "$running" != "$CRAB_SHIM_DIR" ]; then
    log "note: the running containerd finds containerd-shim-crab-v2 in $running, not $CRAB_SHIM_DIR (restart it to change)"
  fi
  return 0
}

# SIGTERM, then SIGKILL after a grace period.
ctrd_kill_pid() {
  local pid=$1
  kill -TERM "$pid" 2>/dev/null || return 0
  for _ in $(seq 1 50); do
    kill -0 "$pid" 2>/dev/null || return 0
    sleep 0.2
  done
  log "pid $pid ignored SIGTERM for 10s; sending SIGKILL"
  kill -KILL "$pid" 2>/dev/null || true
  for _ in $(seq 1 25); do
    kill -0 "$pid" 2>/dev/null || return 0
    sleep 0.2
  done
}

# Shims started by this containerd: every shim gets `-address <our socket>`.
ctrd_shim_pids() {
  local p cmd
  for p in /proc/[0-9]*; do
    cmd=$(tr '\0' ' ' 2>/dev/null <"$p/cmdline") || continue
    case "$cmd" in
      *containerd-shim*"-address $CRAB_CTRD_SOCK "*) echo "${p#/proc/}" ;;
    esac
  done
}

# All descendants of the given pids (container processes are children of
# their shim, which is their subreaper).
descendants_of() {
  local parents=" $* " found=1 p ppid
  local -a tree=("$@")
  while [ "$found" = 1 ]; do
    found=0
    for p in /proc/[0-9]*; do
      p=${p#/proc/}
      case "$parents" in *" $p "*) continue ;; esac
      ppid=$(awk '{print $4}' "/proc/$p/stat" 2>/dev/null) || continue
      case "$parents" in
        *" $ppid "*) parents="$parents$p "; tree+=("$p"); found=1 ;;
      esac
    done
  done
  printf '%s\n' "${tree[@]}"
}

# Kills and deletes every task and container in every namespace, through the
# running containerd so its metadata stays consistent.
ctrd_remove_all_containers() {
  ctrd_answers || return 0
  local ns id
  for ns in $(ctr --address "$CRAB_CTRD_SOCK" namespaces ls -q 2>/dev/null); do
    for id in $(ctr --address "$CRAB_CTRD_SOCK" -n "$ns" tasks ls -q 2>/dev/null); do
      timeout 10 ctr --address "$CRAB_CTRD_SOCK" -n "$ns" tasks kill -a -s SIGKILL "$id" >/dev/null 2>&1 || true
      timeout 20 ctr --address "$CRAB_CTRD_SOCK" -n "$ns" tasks delete -f "$id" >/dev/null 2>&1 || true
    done
    for id in $(ctr --address "$CRAB_CTRD_SOCK" -n "$ns" containers ls -q 2>/dev/null); do
      timeout 20 ctr --address "$CRAB_CTRD_SOCK" -n "$ns" containers delete "$id" >/dev/null 2>&1 || true
    done
  done
}

# Unmounts container root filesystems and anything else left mounted below
# our state and root directories, deepest first.
ctrd_unmount_leftovers() {
  local m
  # grep finds nothing when nothing is left: not a failure (pipefail is on).
  awk '{print $5}' /proc/self/mountinfo |
    { grep -E "^($CRAB_CTRD_STATE|$CRAB_CTRD_ROOT)/" || true; } | sort -r |
    while read -r m; do
      umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || log "could not unmount $m"
    done
}

# ctrd_stop [--all]: stops containerd; running shims (and their containers)
# keep running unless --all is given.
ctrd_stop() {
  need_root
  local all=0
  [ "${1:-}" = --all ] && all=1
  if [ "$all" = 1 ]; then
    # Containers are removed through containerd so its metadata forgets them
    # too; a stopped instance with existing metadata is started for that.
    if ! ctrd_answers && [ -f "$CRAB_CTRD_ROOT/io.containerd.metadata.v1.bolt/meta.db" ]; then
      ctrd_start
    fi
    ctrd_remove_all_containers
  fi
  local pid
  pid=$(ctrd_pid)
  if [ -n "$pid" ]; then
    ctrd_kill_pid "$pid"
    log "stopped containerd (pid $pid)"
  elif ctrd_answers; then
    die "something answers on $CRAB_CTRD_SOCK but it is not the containerd this script started (no pid file)"
  fi
  ctrd_clear_stale
  if [ "$all" = 1 ]; then
    local shims victims
    shims=$(ctrd_shim_pids)
    if [ -n "$shims" ]; then
      # shellcheck disable=SC2086
      victims=$(descendants_of $shims)
      log "killing leftover shims and their containers: $(echo "$victims" | tr '\n' ' ')"
      # shellcheck disable=SC2086
      kill -KILL $victims 2>/dev/null || true
      sleep 0.5
    fi
    ctrd_unmount_leftovers
  fi
}

ctrd_status() {
  local pid
  pid=$(ctrd_pid)
  if ctrd_answers; then
    echo "running: pid ${pid:-unknown}, socket $CRAB_CTRD_SOCK, root $CRAB_CTRD_ROOT, namespace $CRAB_NS"
    echo "shim dir: $(cat "$CRAB_CTRD_DIR/shim-dir" 2>/dev/null || echo unknown)"
    echo "shims: $(ctrd_shim_pids | wc -l)"
    return 0
  fi
  if [ -n "$pid" ]; then
    echo "not answering: pid $pid exists but $CRAB_CTRD_SOCK does not answer (log: $CRAB_CTRD_LOG)"
  else
    echo "stopped"
  fi
  return 3
}

# Drops the leases of this containerd, in every namespace, created more than $1
# seconds ago (0: all), or only those whose id starts with $2. `ctr` takes a
# lease of 24 hours for each command, and a `ctr` that was killed (a stopped
# evaluation or test run) leaves it behind with what it wrote: kept, the empty
# blob of a restored container's runtime options makes containerd 1.6 write
# every later checkpoint of such a container with an index entry that has no
# digest. A lease younger than $1 may be a command that is still running.
ctrd_drop_leases() {
  local older_than=${1:?ctrd_drop_leases needs an age in seconds} prefix=${2:-} now namespaces ns leases id created
  now=$(date +%s)
  namespaces=$(ctrd_ctr namespaces ls -q) || { log "could not list the namespaces of $CRAB_CTRD_SOCK: no lease dropped"; return 0; }
  for ns in $namespaces; do
    leases=$(ctr --address "$CRAB_CTRD_SOCK" --namespace "$ns" leases ls 2>/dev/null) ||
      { log "could not list the leases of namespace $ns"; continue; }
    while read -r id created _; do
      [ -n "$id" ] && [[ "$id" == "$prefix"* ]] || continue
      created=$(date -d "$created" +%s 2>/dev/null) || continue
      [ $((now - created)) -ge "$older_than" ] || continue
      log "dropping lease $id of namespace $ns (created $((now - created)) s ago, by a command that did not finish)"
      ctr --address "$CRAB_CTRD_SOCK" --namespace "$ns" leases rm --sync "$id" </dev/null >/dev/null ||
        log "could not drop lease $id of namespace $ns"
    done < <(tail -n +2 <<<"$leases")
  done
}

ctrd_env() {
  # CONTAINERD_ADDRESS/CONTAINERD_NAMESPACE are what ctr itself reads.
  printf 'export CRAB_CTRD_DIR=%q\n' "$CRAB_CTRD_DIR"
  printf 'export CRAB_CTRD_ROOT=%q\n' "$CRAB_CTRD_ROOT"
  printf 'export CRAB_CTRD_SOCK=%q\n' "$CRAB_CTRD_SOCK"
  printf 'export CRAB_NS=%q\n' "$CRAB_NS"
  printf 'export CONTAINERD_ADDRESS=%q\n' "$CRAB_CTRD_SOCK"
  printf 'export CONTAINERD_NAMESPACE=%q\n' "$CRAB_NS"
}

# Digest of the manifest an image name points to, empty when absent.
ctrd_image_digest() {
  ctrd_ctr images ls "name==$1" 2>/dev/null | awk -v ref="$1" '$1 == ref {print $3}'
}
