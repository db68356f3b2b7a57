# Sourced by tests/s3 and bench/s3_input.sh: a moto S3 server (PyPI's moto, a reference
# implementation of the S3 API that checks SigV4) in a venv outside the repository, made on first
# use: MOTO_VENV (default ~/.cache/bertrain/moto-venv). Without PyPI the caller skips (77).
#   moto_start DIR  -> MOTO_PORT, MOTO_URL, AWS_ACCESS_KEY_ID/SECRET of a new IAM user, bucket "data"
#   moto_stop
MOTO_VERSION=5.2.5
MOTO_VENV=${MOTO_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/bertrain/moto-venv}
S3_TESTS=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

moto_ensure() {
  if "$MOTO_VENV/bin/python" -c "import moto, boto3; assert moto.__version__ == '$MOTO_VERSION'" 2>/dev/null; then
    return 0
  fi
  echo "moto: installing moto[server]==$MOTO_VERSION into $MOTO_VENV (PyPI)"
  [ -n "$MOTO_VENV" ] && rm -rf "$MOTO_VENV"
  mkdir -p "$(dirname "$MOTO_VENV")"
  if ! /usr/bin/python3 -m venv "$MOTO_VENV" >/dev/null ||
    ! timeout 600 "$MOTO_VENV/bin/pip" install -q "moto[server]==$MOTO_VERSION" >/dev/null 2>&1; then
    [ -n "$MOTO_VENV" ] && rm -rf "$MOTO_VENV"
    echo "SKIP: cannot install moto from PyPI (no network?); the object storage tests need an S3 server"
    exit 77
  fi
}

free_port() {
  /usr/bin/python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

wait_port() {
  for _ in $(seq 100); do
    /usr/bin/python3 -c "import socket; socket.create_connection(('127.0.0.1', $1), 1)" 2>/dev/null && return 0
    sleep 0.1
  done
  echo "nothing listens on port $1 after 10 s" >&2
  return 1
}

moto_start() {
  local dir=$1
  moto_ensure
  MOTO_PORT=$(free_port)
  MOTO_URL=http://127.0.0.1:$MOTO_PORT
  INITIAL_NO_AUTH_ACTION_COUNT=3 "$MOTO_VENV/bin/moto_server" -H 127.0.0.1 -p "$MOTO_PORT" \
    >"$dir/moto.log" 2>&1 &
  MOTO_PID=$!
  wait_port "$MOTO_PORT"  # (a request would count as one of the three unauthenticated)
  local keys
  keys=$("$MOTO_VENV/bin/python" "$S3_TESTS/moto_store.py" setup "$MOTO_URL" data)
  export AWS_ACCESS_KEY_ID=${keys% *} AWS_SECRET_ACCESS_KEY=${keys#* } AWS_REGION=us-east-1
  unset AWS_SESSION_TOKEN AWS_ENDPOINT_URL AWS_ENDPOINT_URL_S3 AWS_DEFAULT_REGION
}

moto_stop() {
  [ -n "${MOTO_PID:-}" ] && { kill "$MOTO_PID" 2>/dev/null; wait "$MOTO_PID" 2>/dev/null; } || true
  MOTO_PID=
}

moto_put() {  # moto_put PREFIX FILE...
  "$MOTO_VENV/bin/python" "$S3_TESTS/moto_store.py" put "$MOTO_URL" data "$@"
}

proxy_start() {  # proxy_start [--rtt-ms MS] [--faults FILE] -> PROXY_PORT, PROXY_URL
  PROXY_PORT=$(free_port)
  PROXY_URL=http://127.0.0.1:$PROXY_PORT
  /usr/bin/python3 "$S3_TESTS/s3proxy.py" --listen "$PROXY_PORT" --upstream "127.0.0.1:$MOTO_PORT" "$@" &
  PROXY_PID=$!
  wait_port "$PROXY_PORT"
}

proxy_stop() {
  [ -n "${PROXY_PID:-}" ] && { kill "$PROXY_PID" 2>/dev/null; wait "$PROXY_PID" 2>/dev/null; } || true
  PROXY_PID=
}
