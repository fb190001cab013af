# Each target is one command a person could type.
.PHONY: run test build bench bench-proxy profile fmt lint demo demo-up model-long fuzz fuzz-proxy

VENV := .venv
# The TypeScript MCP server once-proxy is tested in front of, and its packages (npm, Node 20).
TS_UPSTREAM := tests/mcp/upstreams/ts
# axe-core, the accessibility engine the console's browser tests run in each page (npm).
A11Y := tests/mcp/a11y
# Prometheus and promtool, for the telemetry tests: Debian's package (through sudo unless root).
PROMTOOL := /usr/bin/promtool
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# Headless Chromium and its WebDriver, for the console's browser tests: Debian's packages.
CHROMEDRIVER := /usr/bin/chromedriver
# Clippy's lints are checked as the workspace compiles: cargo hands the workspace's own crates
# to clippy-driver (rustc with Clippy's lints; dependencies are compiled by rustc as ever), with
# warnings denied. `make lint` and `make test` share that one compile of every target, so what
# the tests run is what was linted.
LINTED := RUSTC_WORKSPACE_WRAPPER=clippy-driver CLIPPY_ARGS=-Dwarnings__CLIPPY_HACKERY__

# Start the ledger on its embedded default: a SQLite file (once.db) in this directory.
run:
	cargo run --release -p onced

# Unit tests, the Rust integration suite (SQLite and the PostgreSQL on 127.0.0.1:5432), then
# the MCP tests with the official Python MCP SDK against the built binaries (and, for
# once-proxy, Python and TypeScript upstream servers), with the console's tests in headless
# Chromium, two at a time (pytest-xdist): each waits on its processes far more than it computes.
# The console's tests save a screenshot of each page under target/console/.
# Every log the suite keeps is then scanned for secrets (keys, bearer tokens, credentials),
# and the benchmarks run once in their smoke modes (one-second phases, a few proxied calls) so
# they cannot rot.
# Every target (binaries, tests, benches) is built in one invocation, so one feature set serves
# the binaries the MCP tests start, the tests and the bench: nothing is compiled twice.
test: $(VENV)/installed $(PROMTOOL) $(CHROMEDRIVER) $(TS_UPSTREAM)/node_modules/.installed $(A11Y)/node_modules/.installed
	$(LINTED) cargo build --workspace --all-targets
	rm -rf target/test-logs
	ONCE_TEST_LOG_DIR=$(CURDIR)/target/test-logs $(LINTED) cargo test --workspace
	ONCE_TEST_LOG_DIR=$(CURDIR)/target/test-logs $(VENV)/bin/python -m pytest -q -n 2 tests/mcp
	tests/scan-logs target/test-logs
	$(LINTED) cargo bench --workspace --bench ledger --profile dev -- --smoke
	$(VENV)/bin/python bench/proxy_latency.py --calls 5 --bin-dir target/debug

build:
	cargo build --workspace --release

# onced beside pgbench on the PostgreSQL at 127.0.0.1:5432, and on SQLite: cycles/s, latency,
# the ratios to the performance goals, and memory. See README, Performance.
bench:
	cargo bench -p onced --bench ledger

# Where onced spends its CPU: flame graphs of onced under the benchmark's 16 callers, on
# PostgreSQL and on SQLite (docs/flame-onced-postgres.svg, docs/flame-onced-sqlite.svg). The
# benchmark is built with frame pointers in target/profiling, the flame graph tools (inferno)
# into target/tools; perf comes from Debian's linux-perf.
PERF := /usr/bin/perf
profile: $(PERF)
	CARGO_TARGET_DIR=target/profiling RUSTFLAGS="-C force-frame-pointers=yes" CARGO_PROFILE_BENCH_DEBUG=line-tables-only cargo bench -p onced --bench ledger --no-run
	cargo install --quiet --locked --root target/tools inferno
	PATH="$(CURDIR)/target/tools/bin:$$PATH" bench/profile.sh "$$(ls -t target/profiling/release/deps/ledger-* | grep -v '\.d$$' | head -n 1)" docs

$(PERF):
	$(SUDO) apt-get update -qq
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends linux-perf

# Tool-call latency through once-proxy against direct calls, over stdio (see README, once-proxy).
bench-proxy: $(VENV)/installed
	cargo build --release -p onced -p once-proxy
	$(VENV)/bin/python bench/proxy_latency.py

# The model-based test of the core for a long run: a million random call sequences.
model-long:
	PROPTEST_CASES=1000000 cargo test --release -p once-core simulation

# Every decoder that faces the network under the fuzz harness for a long run (make test runs 256
# cases of each): the gRPC request conversions from arbitrary bytes and from odd fields,
# canonical JSON and tool arguments, operation ids and once-id intent parts, the proxy's policy
# and the reconciler configuration, and the proxy's reading of client messages. A failing case
# is kept under proptest-regressions/ and runs first ever after.
fuzz:
	PROPTEST_CASES=200000 cargo test --release -p once-core -p once-api -p once-reconcile -p once-proxy fuzz

# The proxy's message inspection under the fuzz harness for a long run (make test runs 2,000
# cases): no input both reaches the upstream as a guarded call and skips the ledger.
fuzz-proxy:
	PROPTEST_CASES=200000 cargo test --release -p once-proxy fuzz

# The README walkthrough's three processes (onced, fakepay, refund-mcp), built once, in one
# terminal; Ctrl-C stops them.
demo-up:
	examples/demo-up.sh

# The README walkthrough's client: calls the refund tool through the Python MCP SDK.
demo: $(VENV)/installed
	$(VENV)/bin/python examples/refund_demo.py

fmt:
	cargo fmt --all

# Formatting, then Clippy over every target with every feature (the workspace's dev-dependencies
# turn on each crate's features).
lint:
	cargo fmt --all -- --check
	$(LINTED) cargo build --workspace --all-targets

# A project-local virtual environment with the Python MCP SDK (nothing installed globally).
$(VENV)/installed: tests/mcp/requirements.txt
	python3 -m venv $(VENV) && $(VENV)/bin/pip install -q -r tests/mcp/requirements.txt && touch $@

# The TypeScript SDK and tsx for the TypeScript upstream, exactly as its lock file pins them.
$(TS_UPSTREAM)/node_modules/.installed: $(TS_UPSTREAM)/package.json $(TS_UPSTREAM)/package-lock.json
	cd $(TS_UPSTREAM) && npm ci --no-audit --no-fund && touch node_modules/.installed

# The browser the console's tests drive (Selenium, from the venv), and its WebDriver.
$(CHROMEDRIVER):
	$(SUDO) apt-get update -qq
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium chromium-driver

# axe-core, exactly as its lock file pins it.
$(A11Y)/node_modules/.installed: $(A11Y)/package.json $(A11Y)/package-lock.json
	cd $(A11Y) && npm ci --no-audit --no-fund && touch node_modules/.installed

# The real Prometheus the telemetry tests scrape with, and promtool for the shipped alerts.
$(PROMTOOL):
	$(SUDO) apt-get update -qq
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus
