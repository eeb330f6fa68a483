# shellcheck shell=bash
# What the node benches (scripts/bench-node, scripts/bench-density) share: a private
# containerd whose shims use a crab config of the bench's own (its crabd socket and
# store, which the bench restarts and empties between runs), the binaries staged in
# CRAB_SHIM_DIR, the cut dev traces. Source after common.sh and containerd.sh; call
# bench_crabd_setup first. Sets: bin, socket, state_dir; exports CRAB_STATE_DIR and
# the private containerd's environment.

bench_crabd_setup() {
  [ -n "${CRAB_CONFIG:-}" ] || die "CRAB_CONFIG is not set: start the private containerd with CRAB_CONFIG=<a crab config with its own [node] socket and [checkpoint] state_dir> so that this bench does not restart the crabd of other users"
  [ -f "$CRAB_CONFIG" ] || die "CRAB_CONFIG=$CRAB_CONFIG does not exist"
  ctrd_answers || die "private containerd is not running on $CRAB_CTRD_SOCK: scripts/containerd start"
  local ctrd_env_of
  ctrd_env_of=$(tr '\0' '\n' <"/proc/$(ctrd_pid)/environ" | sed -n 's/^CRAB_CONFIG=//p')
  [ "$ctrd_env_of" = "$CRAB_CONFIG" ] ||
    die "containerd on $CRAB_CTRD_SOCK runs with CRAB_CONFIG='$ctrd_env_of', not '$CRAB_CONFIG': its shims would use another crabd (restart it: scripts/containerd stop; CRAB_CONFIG=... scripts/containerd start)"
  bin="$CRAB_SHIM_DIR"
  local b
  for b in crabd crabctl crab-replay containerd-shim-crab-v2; do
    [ -x "$bin/$b" ] || die "$bin/$b missing: stage_crab_bins in scripts/lib/common.sh fills CRAB_SHIM_DIR=$bin"
  done
  ctrd_image_digest crab.local/terminal:latest | grep -q . || die "image crab.local/terminal:latest missing: scripts/build-images terminal"
  # The config as the shims read it, defaults filled in (crabctl config), not parsed here.
  local config_json
  config_json=$("$bin/crabctl" config --json) || die "crabctl config could not read $CRAB_CONFIG"
  socket=$(jq -r .node.socket <<<"$config_json")
  state_dir=$(jq -r .checkpoint.state_dir <<<"$config_json")
  [ "$socket" != /run/crab/crabd.sock ] || die "$CRAB_CONFIG uses the node's default crabd socket; give it a [node] socket of its own"
  [ "$state_dir" != /var/lib/crab ] || die "$CRAB_CONFIG uses the node's default store /var/lib/crab; give it a [checkpoint] state_dir of its own (the bench empties it)"
  export CRAB_STATE_DIR="$state_dir"
  eval "$(ctrd_env)"
  log "config $CRAB_CONFIG: crabd socket $socket, store $state_dir"
}

crabd_pid() { { "$bin/crabctl" node --json 2>/dev/null || true; } | jq -r '.pid // empty'; }

stop_crabd() {
  local pid
  pid=$(crabd_pid)
  [ -n "$pid" ] || return 0
  kill -TERM "$pid"
  for _ in $(seq 100); do [ -d "/proc/$pid" ] || return 0; sleep 0.1; done
  die "crabd $pid did not stop on SIGTERM"
}

start_crabd() { # LOG [crabd options...]
  local log_file=$1
  shift
  setsid "$bin/crabd" --config "$CRAB_CONFIG" "$@" </dev/null >>"$log_file" 2>&1 &
  for _ in $(seq 200); do [ -n "$(crabd_pid)" ] && return 0; sleep 0.1; done
  die "crabd did not answer on $socket (log: $log_file)"
}

# Each run starts from an empty store: otherwise a later run's commits deduplicate
# against the blobs of the earlier ones and write (and wait) less. The packs go with
# the blobs' names (they would only fill the disk), and the kept image copies too:
# they count against the node's bound on kept copies, which every publish adds up.
# Turn logs stay: the reports read them, and every replay names its own sandboxes.
empty_store() {
  local entry kept
  # assembled is a link to this store's directory under [checkpoint] kept_images_dir
  # (a tmpfs): the copies are there.
  kept=$(readlink -f "${state_dir:?}/assembled" || true)
  case "$kept" in
    */kept-images/?*) rm -rf "$kept" ;;
  esac
  for entry in blobs packs assembled manifests snapshots containers sandboxes tmp full; do
    rm -rf "${state_dir:?}/$entry"
  done
}

# COUNT Terminal-Bench dev traces, cut to their first TURNS turns, written into DIR;
# prints their paths (the header's turn count follows the cut).
select_traces() { # COUNT DIR TURNS
  python3 scripts/lib/select_traces.py "${CRAB_TRACES:-/work/shared/traces}/tb" "$1" "$2" "$3"
}
