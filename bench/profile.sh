#!/usr/bin/env bash
# Where onced spends its CPU under load: a flame graph of onced on PostgreSQL and one of onced on
# SQLite, each from `perf record -g` over the middle of the benchmark's 16-caller phase.
#
#   bench/profile.sh BENCH_BINARY OUT_DIR [SECONDS]
#
# BENCH_BINARY is the ledger benchmark built with frame pointers (`make profile` builds it);
# the flame graphs go to OUT_DIR/flame-onced-postgres.svg and OUT_DIR/flame-onced-sqlite.svg.
# Frames under 0.2% of the samples are left out. Needs perf (Debian's linux-perf) and inferno's
# collapse-perf and flamegraph on PATH.
set -euo pipefail

bench=$1
out=$2
seconds=${3:-8}
work=$(mktemp -d)
runner=
# The benchmark is stopped before its end, so what it would clean up is cleaned up here: its
# onced processes, then the benchmark, then the database it made (named after its pid).
stop() {
    if [ -n "$runner" ]; then
        pkill -TERM -P "$runner" 2>/dev/null || true
        kill "$runner" 2>/dev/null || true
        wait 2>/dev/null || true
        psql -q "${ONCE_BENCH_POSTGRES:-postgres://postgres@127.0.0.1:5432/postgres}" \
            -c "DROP DATABASE IF EXISTS once_bench_$runner WITH (FORCE)" >/dev/null 2>&1 || true
    fi
    rm -rf "$work"
}
trap stop EXIT

"$bench" --callers 16 --seconds $((seconds * 2 + 4)) --memory-callers 16 >"$work/bench.log" 2>&1 &
runner=$!

# The benchmark's two onced processes, once both serve.
pid_of() {
    for _ in $(seq 1 100); do
        local pid
        pid=$(pgrep -P "$runner" -f "onced --database-url $1" | head -n 1 || true)
        if [ -n "$pid" ]; then
            echo "$pid"
            return
        fi
        sleep 0.1
    done
    echo "no onced on $1 under the benchmark" >&2
    exit 1
}

# CPU ticks of a process so far.
ticks() { awk '{ print $14 + $15 }' "/proc/$1/stat"; }

# Waits until `pid` is busy (a third of a core over a second), then records it.
profile() {
    local pid=$1 name=$2
    for _ in $(seq 1 300); do
        local before after
        before=$(ticks "$pid")
        sleep 1
        after=$(ticks "$pid")
        if [ $((after - before)) -ge 33 ]; then
            if ! perf record -q -g -p "$pid" -o "$work/$name.data" -- sleep "$seconds" >/dev/null; then
                echo "perf could not record onced (as another user than root, the kernel must allow it: sysctl kernel.perf_event_paranoid=1)" >&2
                exit 1
            fi
            perf script -i "$work/$name.data" 2>/dev/null | inferno-collapse-perf >"$work/$name.folded"
            inferno-flamegraph --minwidth 0.2 --title "$name, 16 callers" <"$work/$name.folded" >"$out/flame-$name.svg"
            echo "$out/flame-$name.svg: $(wc -l <"$work/$name.folded") stacks"
            return
        fi
    done
    echo "$name never got busy" >&2
    exit 1
}

mkdir -p "$out"
postgres=$(pid_of postgres)
sqlite=$(pid_of sqlite)
profile "$postgres" onced-postgres
profile "$sqlite" onced-sqlite
