# Each target is one command a person could type.
.PHONY: run test build fmt lint

# Start the ledger on its embedded default: a SQLite file (once.db) in this directory.
run:
	cargo run --release -p onced

# Unit tests and the integration suite, against SQLite and the PostgreSQL on 127.0.0.1:5432.
test:
	cargo test --workspace

build:
	cargo build --workspace --release

fmt:
	cargo fmt --all

lint:
	cargo fmt --all -- --check && cargo clippy --workspace --all-targets --all-features -- -D warnings
