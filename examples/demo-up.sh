#!/usr/bin/env bash
# The walkthrough's three processes in one terminal, built once (release): the ledger with the
# demo's reconciler (examples/onced.toml, its SQLite file once.db here), fakepay on
# 127.0.0.1:12111 and refund-mcp at http://127.0.0.1:8000/mcp. Each line says which process
# wrote it. Ctrl-C stops all three; so does any one of them ending.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -p onced -p fakepay -p refund-mcp -p oncectl
bin=target/release
pids=()
stop() {
  trap - INT TERM EXIT
  kill "${pids[@]}" 2>/dev/null || true
  wait 2>/dev/null || true
}
trap stop INT TERM EXIT
said_by() { sed -u "s/^/[$1] /"; }
"$bin/onced" --config examples/onced.toml > >(said_by onced) 2>&1 &
pids+=($!)
"$bin/fakepay" > >(said_by fakepay) 2>&1 &
pids+=($!)
"$bin/refund-mcp" --http 127.0.0.1:8000 > >(said_by refund-mcp) 2>&1 &
pids+=($!)
echo "demo up: make demo runs the client; $bin/oncectl list shows UNKNOWN operations; Ctrl-C stops"
wait -n "${pids[@]}"
