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

# The bridge's own address, the pods' gateway: the first of the subnet.
CRAB_CRI_GATEWAY="${CRAB_CRI_SUBNET%.0/24}.1"

# Host-wide changes, and why (the CRI suite's port mapping scenario needs the
# host to reach a pod's hostPort, as a node and its kubelet do):
# - the bridge has an address, $CRAB_CRI_GATEWAY/24 (so a connected route to
#   the subnet): the host reaches the pods, and a hostPort DNATed to a pod's
#   address gets there. The script makes the bridge with that address itself
#   (cri_ensure_bridge) rather than asking the bridge plugin for it with
#   "isGateway": true, which would also turn on net.ipv4.ip_forward host-wide;
#   the pods still have no default route and reach nothing beyond the bridge,
#   and nothing is masqueraded out of them.
# - the portmap plugin's iptables rules in the nat table: the chains shared by
#   every CNI network on the host (CNI-HOSTPORT-DNAT, -SETMARK, -MASQ, and the
#   jumps to them from PREROUTING, OUTPUT and POSTROUTING, which it creates on
#   its first use and never removes), and per pod with a hostPort a CNI-DN-*
#   chain plus a rule in CNI-HOSTPORT-DNAT, which CNI DEL (StopPodSandbox)
#   removes; `stop --all` removes those of this instance's network that are
#   left (cri_clear_portmap). The shared chains stay: another instance's pods
#   may be using them, and they are empty without a pod's rules. portmap also
#   sets route_localnet on the bridge (gone with it).
cri_write_cni_config() {
  mkdir -p "$CRAB_CRI_CNI_DIR/net.d" "$CRAB_CRI_CNI_DIR/ipam"
  # No default route, no masquerade: pods get addresses on a bridge of their
  # own (which the host reaches, see above) and reach nothing beyond it.
  # portmap maps a pod's hostPorts (CRI passes them as the portMappings
  # capability).
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
        "ranges": [[{"subnet": "$CRAB_CRI_SUBNET", "gateway": "$CRAB_CRI_GATEWAY"}]],
        "dataDir": "$CRAB_CRI_CNI_DIR/ipam"
      }
    },
    {
      "type": "portmap",
      "capabilities": {"portMappings": true}
    }
  ]
}
EOF
  # containerd's CRI plugin watches the directory and reloads a changed file:
  # an instance started by an older script takes the current chain from the
  # next `start`, and an unchanged file is left alone (no reload).
  if cmp -s "$CRAB_CRI_CNI_DIR/net.d/10-crab-cri.conflist.tmp" "$CRAB_CRI_CNI_DIR/net.d/10-crab-cri.conflist"; then
    rm -f "$CRAB_CRI_CNI_DIR/net.d/10-crab-cri.conflist.tmp"
  else
    mv -f "$CRAB_CRI_CNI_DIR/net.d/10-crab-cri.conflist.tmp" "$CRAB_CRI_CNI_DIR/net.d/10-crab-cri.conflist"
  fi
}

# The pods' bridge with its address (see above), before any pod joins it; the
# bridge plugin then uses it as it is.
cri_ensure_bridge() {
  if ! ip link show "$CRAB_CRI_BRIDGE" >/dev/null 2>&1; then
    ip link add name "$CRAB_CRI_BRIDGE" type bridge || die "could not create bridge $CRAB_CRI_BRIDGE"
  fi
  if ! ip -4 addr show dev "$CRAB_CRI_BRIDGE" | grep -qF " $CRAB_CRI_GATEWAY/24 "; then
    ip addr add "$CRAB_CRI_GATEWAY/24" dev "$CRAB_CRI_BRIDGE" ||
      die "could not give bridge $CRAB_CRI_BRIDGE the address $CRAB_CRI_GATEWAY/24"
  fi
  ip link set "$CRAB_CRI_BRIDGE" up || die "could not bring bridge $CRAB_CRI_BRIDGE up"
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
# ctrd_stop --all unmounts): portmap's rules for them, the bridge and the
# address leases.
cri_clear_network() {
  cri_clear_portmap
  if ip link show "$CRAB_CRI_BRIDGE" >/dev/null 2>&1; then
    ip link delete "$CRAB_CRI_BRIDGE" 2>/dev/null || log "could not delete bridge $CRAB_CRI_BRIDGE"
  fi
  rm -rf "$CRAB_CRI_CNI_DIR/ipam"
}

# portmap's per-pod rules of this instance's network that CNI DEL did not
# remove (pods removed with their containerd, not through CRI): each is a rule
# in CNI-HOSTPORT-DNAT whose comment names the network and pod
# (`dnat name: "NET" id: "POD"`) jumping to the pod's CNI-DN-* chain. Other
# networks' rules and the shared chains are left alone.
cri_clear_portmap() {
  command -v iptables >/dev/null || return 0
  local rules rule chain
  rules=$(iptables -w 5 -t nat -S CNI-HOSTPORT-DNAT 2>/dev/null |
    grep -F -- "--comment \"dnat name: \\\"$CRAB_CRI_NETWORK\\\" " || true)
  [ -n "$rules" ] || return 0
  while read -r rule; do
    chain=${rule##*-j }
    # iptables -S quotes as the shell does: the words of the rule, -A first.
    eval "set -- $rule"
    shift 2
    iptables -w 5 -t nat -D CNI-HOSTPORT-DNAT "$@" || log "could not delete portmap rule: $rule"
    case "$chain" in
      CNI-DN-*)
        iptables -w 5 -t nat -F "$chain" && iptables -w 5 -t nat -X "$chain" ||
          log "could not delete portmap chain $chain"
        ;;
    esac
  done <<<"$rules"
  log "removed $(wc -l <<<"$rules") leftover portmap rule(s) of network $CRAB_CRI_NETWORK"
}

cri_env() {
  printf 'export CRAB_CRI_DIR=%q\n' "$CRAB_CRI_DIR"
  printf 'export CRAB_CRI_ROOT=%q\n' "$CRAB_CRI_ROOT"
  printf 'export CRAB_CRI_SOCK=%q\n' "$CRAB_CTRD_SOCK"
}
