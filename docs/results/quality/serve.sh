# Sourced by the docs/results/quality run scripts: `serve PORT [vllm-kvcomp serve args...]` starts a
# server in the background on 127.0.0.1:PORT, stops it when the script exits, and returns once
# /health answers (exits 1 if the server dies first).
serve() {
  local port=$1
  shift
  python3 -m vllm_kvcomp serve --host 127.0.0.1 --port "$port" "$@" &
  SERVER=$!
  trap 'kill "$SERVER" 2>/dev/null || true' EXIT
  for _ in $(seq 300); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && return 0
    kill -0 "$SERVER" 2>/dev/null || { echo "server exited during start" >&2; exit 1; }
    sleep 2
  done
  echo "server not healthy after 600 s" >&2
  exit 1
}
