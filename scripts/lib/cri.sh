# The CRI containerd: a second private containerd with the CRI plugin on, for
# the CRI test suite (integration/tests/cri.rs). Sourced after common.sh; it
# sources containerd.sh itself, pointed at the CRI instance's own paths, so the
# start/stop/status logic (pid checks, timeouts, leftover clean-up) is the same
# as the plain instance's and only the config differs.
#
# Paths derive from the plain instance's (CRAB_CTRD_DIR, CRAB_CTRD_ROOT) with a
# `-cri` suffix, so workers isolated by those variables never share a socket,
# root, state, CNI bridge or subnet. CRAB_CRI_DIR / CRAB_CRI_ROOT override.

CRAB_CRI_DIR="${CRAB_CRI_DIR:-${CRAB_CTRD_DIR:-/run/crab-dev}-cri}"
CRAB_CRI_ROOT="${CRAB_CRI_ROOT:-${CRAB_CTRD_ROOT:-/var/lib/crab-dev/containerd}-cri}"
# The plain instance's variables, as containerd.sh derives everything from them.
CRAB_CTRD_DIR="$CRAB_CRI_DIR"
CRAB_CTRD_ROOT="$CRAB_CRI_ROOT"
# CRI keeps every pod, container and image in this namespace.
CRAB_NS=k8s.io
# shellcheck source=containerd.sh
source "$(dirname "${BASH_SOURCE[0]}")/containerd.sh"

CRAB_CRI_CNI_DIR="$CRAB_CRI_DIR/cni"
CRAB_CRI_PAUSE_IMAGE="crab.local/pause:latest"
# A bridge name (at most 15 bytes) and a /24 of 10.200.0.0/13 per instance, from
# a hash of its directory: two workers' pods never share a bridge or addresses.
cri_hash=$(printf '%s' "$CRAB_CRI_DIR" | cksum | cut -d' ' -f1)
CRAB_CRI_BRIDGE="crcri$(printf '%05x' $((cri_hash % 1048576)))"
CRAB_CRI_SUBNET="10.$((200 + cri_hash % 8)).$(((cri_hash / 8) % 256)).0/24"
CRAB_CRI_NETWORK="crab-cri-$(printf '%05x' $((cri_hash % 1048576)))"

# The crab config the crab handler's shims read: $CRAB_CONFIG, else the
# shim's default path when it exists; empty (no ConfigPath, the shim's
# built-in defaults) otherwise, since a ConfigPath naming a missing file fails
# every pod.
cri_crab_config() {
  if [ -n "${CRAB_CONFIG:-}" ]; then
    [ -f "$CRAB_CONFIG" ] || die "CRAB_CONFIG=$CRAB_CONFIG does not exist"
    echo "$CRAB_CONFIG"
  elif [ -f /etc/crab/crab.toml ]; then
    echo /etc/crab/crab.toml
  fi
}

cri_write_cni_config() {
  mkdir -p "$CRAB_CRI_CNI_DIR/net.d" "$CRAB_CRI_CNI_DIR/ipam"
  # No gateway, no default route, no masquerade: pods get addresses on a bridge
  # of their own and reach nothing beyond it, and nothing host-wide (iptables,
  # ip_forward) is changed.
  cat >"$CRAB_CRI_CNI_DIR/net.d/10-crab-cri.conflist.tmp" <<EOF
{
  "cniVersion": "0.4.0",
  "name": "$CRAB_CRI_NETWORK",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "$CRAB_CRI_BRIDGE",
      "isGateway": false,
      "ipMasq": false,
      "ipam": {
        "type": "host-local",
        "ranges": [[{"subnet": "$CRAB_CRI_SUBNET"}]],
        "dataDir": "$CRAB_CRI_CNI_DIR/ipam"
      }
    }
  ]
}
EOF
  mv -f "$CRAB_CRI_CNI_DIR/net.d/10-crab-cri.conflist.tmp" "$CRAB_CRI_CNI_DIR/net.d/10-crab-cri.conflist"
}

# Replaces containerd.sh's config writer (ctrd_start calls it).
ctrd_write_config() {
  local tmp="$CRAB_CTRD_CONFIG.tmp" crab_config crab_options=""
  crab_config=$(cri_crab_config)
  if [ -n "$crab_config" ]; then
    crab_options="  [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.crab.options]
    ConfigPath = \"$crab_config\""
  fi
  cri_write_cni_config
  # restrict_oom_score_adj: root may lack CAP_SYS_RESOURCE (as on this
  # project's machines), and then writing the pause container's negative
  # oom_score_adj fails every sandbox. netns_mounts_under_state_dir keeps the
  # pods' network namespaces in this instance's state, so a test can tell
  # that none is left. The streaming server takes any free port on loopback,
  # so instances never collide on 10010.
  {
    ctrd_config_base
    cat <<EOF
  [plugins."io.containerd.grpc.v1.cri"]
    sandbox_image = "$CRAB_CRI_PAUSE_IMAGE"
    restrict_oom_score_adj = true
    netns_mounts_under_state_dir = true
    stream_server_address = "127.0.0.1"
    stream_server_port = "0"
    [plugins."io.containerd.grpc.v1.cri".cni]
      bin_dir = "/usr/lib/cni"
      conf_dir = "$CRAB_CRI_CNI_DIR/net.d"
      max_conf_num = 1
    [plugins."io.containerd.grpc.v1.cri".containerd]
      snapshotter = "overlayfs"
      default_runtime_name = "runc"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
        runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.crab]
        runtime_type = "io.containerd.crab.v2"
        pod_annotations = ["io.crab.*"]
        container_annotations = ["io.crab.*"]
      $crab_options
EOF
  } >"$tmp"
  mv -f "$tmp" "$CRAB_CTRD_CONFIG"
}

# What a killed instance's pods leave on the host beyond mounts (which
# ctrd_stop --all unmounts): the bridge and the address leases.
cri_clear_network() {
  if ip link show "$CRAB_CRI_BRIDGE" >/dev/null 2>&1; then
    ip link delete "$CRAB_CRI_BRIDGE" 2>/dev/null || log "could not delete bridge $CRAB_CRI_BRIDGE"
  fi
  rm -rf "$CRAB_CRI_CNI_DIR/ipam"
}

cri_env() {
  printf 'export CRAB_CRI_DIR=%q\n' "$CRAB_CRI_DIR"
  printf 'export CRAB_CRI_ROOT=%q\n' "$CRAB_CRI_ROOT"
  printf 'export CRAB_CRI_SOCK=%q\n' "$CRAB_CTRD_SOCK"
}
