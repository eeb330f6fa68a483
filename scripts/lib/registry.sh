# A local OCI registry (Debian's docker-registry, distribution 2.8) for crab's
# remote tier: scripts and tests start one on 127.0.0.1 with its storage in a
# directory of the run. Sourced after common.sh.
#
# One instance per directory (REG_DIR): config.yml, storage/, registry.log,
# pid and port live there. With TLS the directory also holds a CA made here
# (ca.crt, ca.key), the server's certificate for 127.0.0.1 and localhost
# signed by it (server.crt, server.key), an htpasswd file (bcrypt, as
# distribution requires) and docker-config.json, a Docker client config with
# the credentials for that registry (the format ~/.docker/config.json has).

REG_START_TIMEOUT="${CRAB_REGISTRY_START_TIMEOUT:-20}"
REG_USER="${CRAB_REGISTRY_USER:-crab}"

reg_paths() {
  REG_CONFIG="$REG_DIR/config.yml"
  REG_LOG="$REG_DIR/registry.log"
  REG_PIDFILE="$REG_DIR/pid"
  REG_PORTFILE="$REG_DIR/port"
  REG_STORAGE="$REG_DIR/storage"
}

# Pid of the registry serving REG_DIR's config, empty when there is none.
reg_pid() {
  local pid
  [ -f "$REG_PIDFILE" ] || return 0
  pid=$(cat "$REG_PIDFILE" 2>/dev/null || true)
  [ -n "$pid" ] && [ -r "/proc/$pid/cmdline" ] || return 0
  # A recycled pid must not be mistaken for ours: check it serves our config.
  tr '\0' ' ' <"/proc/$pid/cmdline" | grep -qF -- "serve $REG_CONFIG" && echo "$pid"
  return 0
}

reg_is_tls() { [ -f "$REG_DIR/server.crt" ]; }

reg_url() {
  local scheme=http
  reg_is_tls && scheme=https
  echo "$scheme://127.0.0.1:$(cat "$REG_PORTFILE")"
}

# The registry answers /v2/ (200 without auth, 401 with): it is up.
reg_answers() {
  [ -f "$REG_PORTFILE" ] || return 1
  local code
  code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 3 ${REG_CA:+--cacert "$REG_CA"} "$(reg_url)/v2/" || true)
  [ "$code" = 200 ] || [ "$code" = 401 ]
}

port_in_use() { ss -Hltn "sport = :$1" | grep -q .; }

# A free port on 127.0.0.1, from `from` upwards.
free_port() {
  local port=$1
  while port_in_use "$port"; do
    port=$((port + 1))
    [ "$port" -lt 65535 ] || die "no free port above $1"
  done
  echo "$port"
}

# CA and server certificate for 127.0.0.1/localhost, made once per directory.
reg_make_tls() {
  [ -f "$REG_DIR/server.crt" ] && [ -f "$REG_DIR/ca.crt" ] && return 0
  command -v openssl >/dev/null || die "openssl is not installed (run scripts/install-deps)"
  local ext="$REG_DIR/server.ext"
  (
    umask 077
    openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=crab test registry CA" \
      -keyout "$REG_DIR/ca.key" -out "$REG_DIR/ca.crt" 2>/dev/null
    openssl req -newkey rsa:2048 -nodes -subj "/CN=127.0.0.1" \
      -keyout "$REG_DIR/server.key" -out "$REG_DIR/server.csr" 2>/dev/null
    printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n' >"$ext"
    openssl x509 -req -in "$REG_DIR/server.csr" -CA "$REG_DIR/ca.crt" -CAkey "$REG_DIR/ca.key" \
      -CAcreateserial -days 3650 -extfile "$ext" -out "$REG_DIR/server.crt.tmp" 2>/dev/null
  ) || die "making the registry's TLS certificates in $REG_DIR failed"
  rm -f "$REG_DIR/server.csr" "$ext"
  chmod 0644 "$REG_DIR/ca.crt"
  mv -f "$REG_DIR/server.crt.tmp" "$REG_DIR/server.crt"
}

# htpasswd (bcrypt) and the matching Docker client config, made once per directory.
reg_make_auth() {
  [ -f "$REG_DIR/htpasswd" ] && [ -f "$REG_DIR/password" ] && return 0
  command -v htpasswd >/dev/null || die "htpasswd is not installed (run scripts/install-deps)"
  local password
  password="${CRAB_REGISTRY_PASSWORD:-$(openssl rand -hex 16)}"
  (umask 077 && printf '%s' "$password" >"$REG_DIR/password")
  htpasswd -Bbn "$REG_USER" "$password" >"$REG_DIR/htpasswd.tmp" 2>/dev/null || die "htpasswd failed"
  mv -f "$REG_DIR/htpasswd.tmp" "$REG_DIR/htpasswd"
}

reg_write_docker_config() {
  local auth
  auth=$(printf '%s:%s' "$REG_USER" "$(cat "$REG_DIR/password")" | base64 -w0)
  (umask 077 && printf '{"auths":{"127.0.0.1:%s":{"auth":"%s"}}}\n' "$(cat "$REG_PORTFILE")" "$auth" \
    >"$REG_DIR/docker-config.json")
}

reg_write_config() {
  local port=$1 tls=$2 tmp="$REG_CONFIG.tmp"
  {
    cat <<EOF
version: 0.1
log:
  level: ${CRAB_REGISTRY_LOG_LEVEL:-warn}
  accesslog:
    disabled: true
storage:
  filesystem:
    rootdirectory: $REG_STORAGE
  delete:
    enabled: true
  maintenance:
    uploadpurging:
      enabled: false
http:
  addr: 127.0.0.1:$port
  secret: $(openssl rand -hex 16)
EOF
    if [ "$tls" = 1 ]; then
      cat <<EOF
  tls:
    certificate: $REG_DIR/server.crt
    key: $REG_DIR/server.key
auth:
  htpasswd:
    realm: crab-registry
    path: $REG_DIR/htpasswd
EOF
    fi
  } >"$tmp"
  mv -f "$tmp" "$REG_CONFIG"
}

# reg_start TLS(0|1) PORT(empty: the saved one, else a free one)
reg_start() {
  local tls=$1 port=$2
  command -v docker-registry >/dev/null || die "docker-registry is not installed (run scripts/install-deps)"
  mkdir -p "$REG_DIR" "$REG_STORAGE"
  chmod 0700 "$REG_DIR"
  if [ "$tls" = 1 ]; then
    reg_make_tls
    reg_make_auth
    REG_CA="$REG_DIR/ca.crt"
  elif reg_is_tls; then
    die "$REG_DIR holds a TLS registry; use --tls or another --dir"
  fi
  local pid
  pid=$(reg_pid)
  if [ -n "$pid" ]; then
    if [ -z "$port" ] || [ "$port" = "$(cat "$REG_PORTFILE")" ]; then
      local deadline=$((SECONDS + REG_START_TIMEOUT))
      until reg_answers; do
        [ $SECONDS -lt $deadline ] || die "registry pid $pid does not answer (log: $REG_LOG)"
        sleep 0.2
      done
      return 0
    fi
    log "registry in $REG_DIR runs on port $(cat "$REG_PORTFILE"); restarting it on $port"
    reg_stop
  fi
  [ -n "$port" ] || port=$(cat "$REG_PORTFILE" 2>/dev/null || true)
  if [ -z "$port" ] || port_in_use "$port"; then
    port=$(free_port "${CRAB_REGISTRY_PORT_BASE:-5000}")
  fi
  echo "$port" >"$REG_PORTFILE"
  reg_write_config "$port" "$tls"
  [ "$tls" = 1 ] && reg_write_docker_config
  # setsid + nohup: the registry must outlive the shell that started it.
  setsid nohup docker-registry serve "$REG_CONFIG" </dev/null >>"$REG_LOG" 2>&1 &
  echo $! >"$REG_PIDFILE"
  local launched=$! deadline=$((SECONDS + REG_START_TIMEOUT))
  until reg_answers; do
    if ! kill -0 "$launched" 2>/dev/null; then
      tail -20 "$REG_LOG" >&2
      die "docker-registry exited during start-up (log: $REG_LOG)"
    fi
    [ $SECONDS -lt $deadline ] || die "docker-registry did not answer within ${REG_START_TIMEOUT}s (log: $REG_LOG)"
    sleep 0.2
  done
  log "registry $(reg_url) (storage $REG_STORAGE$( [ "$tls" = 1 ] && echo ", TLS + htpasswd"))"
}

reg_stop() {
  local pid
  pid=$(reg_pid)
  if [ -n "$pid" ]; then
    kill -TERM "$pid" 2>/dev/null || true
    local i
    for i in $(seq 1 50); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null
  fi
  rm -f "$REG_PIDFILE"
}

# Shell exports describing the instance, for `eval "$(scripts/registry env)"`.
reg_env() {
  [ -f "$REG_PORTFILE" ] || die "no registry in $REG_DIR (scripts/registry start first)"
  echo "export CRAB_REGISTRY=127.0.0.1:$(cat "$REG_PORTFILE")"
  echo "export CRAB_REGISTRY_URL=$(reg_url)"
  if reg_is_tls; then
    echo "export CRAB_REGISTRY_CA=$REG_DIR/ca.crt"
    echo "export CRAB_REGISTRY_AUTH_FILE=$REG_DIR/docker-config.json"
  else
    echo "unset CRAB_REGISTRY_CA CRAB_REGISTRY_AUTH_FILE"
  fi
}
