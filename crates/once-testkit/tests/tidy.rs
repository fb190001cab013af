//! What must stay true of the source tree as it grows: every file says what it is, protobuf
//! messages stay at the wire, shipped code never unwraps, and every test ARCHITECTURE.md names
//! exists.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Every `.rs` file under `dir`, as a path relative to the workspace root.
fn rust_files(dir: &Path, found: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.expect("a directory entry").path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            rust_files(&path, found);
        } else if path.extension().is_some_and(|ext| ext == "rs") {
            found.push(
                path.strip_prefix(root())
                    .expect("under the root")
                    .to_owned(),
            );
        }
    }
}

fn workspace_sources() -> Vec<PathBuf> {
    let mut found = Vec::new();
    rust_files(&root().join("crates"), &mut found);
    assert!(
        found.len() > 100,
        "the walk found only {} files",
        found.len()
    );
    found
}

fn read(path: &Path) -> String {
    fs::read_to_string(root().join(path)).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The crate a path belongs to: `crates/<name>/…`.
fn crate_of(path: &Path) -> String {
    path.components()
        .nth(1)
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// The modules declared `#[cfg(test)] mod name;` anywhere: their files are test code.
fn test_modules(sources: &[PathBuf]) -> BTreeSet<PathBuf> {
    let mut modules = BTreeSet::new();
    for path in sources {
        let text = read(path);
        let lines: Vec<&str> = text.lines().collect();
        for pair in lines.windows(2) {
            let declared = pair[1]
                .trim()
                .strip_prefix("mod ")
                .and_then(|rest| rest.strip_suffix(';'));
            if let (true, Some(name)) = (pair[0].trim() == "#[cfg(test)]", declared) {
                let dir = path.parent().expect("a file has a directory");
                modules.insert(dir.join(format!("{name}.rs")));
                modules.insert(dir.join(name).join("mod.rs"));
            }
        }
    }
    modules
}

/// The code of a shipped source file that is not test code: `None` for a test file, else its
/// text without its `#[cfg(test)] mod … { … }` blocks (a block ends at the first `}` at the
/// start of a line, as rustfmt leaves a module's end).
fn shipped_code(path: &Path, tests: &BTreeSet<PathBuf>) -> Option<String> {
    let name = path.to_string_lossy();
    let in_src = path
        .components()
        .nth(2)
        .is_some_and(|c| c.as_os_str() == "src");
    let harness = ["once-testkit", "once-testdb", "fakepay"].contains(&crate_of(path).as_str());
    if !in_src || harness || name.ends_with("_tests.rs") || name.contains("/src/tests/") {
        return None;
    }
    if tests.contains(path) {
        return None;
    }
    let text = read(path);
    let lines: Vec<&str> = text.lines().collect();
    let mut shipped = Vec::new();
    let mut in_tests = false;
    for (n, line) in lines.iter().enumerate() {
        let opens_tests = line.starts_with("#[cfg(test)]")
            && lines
                .get(n + 1)
                .is_some_and(|next| next.starts_with("mod ") && next.ends_with('{'));
        if opens_tests {
            in_tests = true;
        } else if in_tests && *line == "}" {
            in_tests = false;
        } else if !in_tests {
            shipped.push(*line);
        }
    }
    Some(shipped.join("\n"))
}

#[test]
fn every_source_file_opens_with_its_documentation() {
    let undocumented: Vec<_> = workspace_sources()
        .into_iter()
        .filter(|path| {
            let text = read(path);
            let first = text.lines().find(|line| !line.trim().is_empty());
            !first.is_some_and(|line| line.starts_with("//!"))
        })
        .collect();
    assert!(
        undocumented.is_empty(),
        "these files do not open with a `//!` saying what they are: {undocumented:#?}"
    );
}

/// Where a protobuf message may be named outside `once-api`: the gRPC adapters that implement
/// the generated services, the client's wire, and the grpc reconciler's own plugin protocol.
const AT_THE_WIRE: &[&str] = &[
    "crates/onced/src/service.rs",
    "crates/onced/src/admin.rs",
    "crates/onced/src/watch.rs",
    "crates/onced/src/replica.rs",
    "crates/onced/src/sweeper.rs",
    "crates/once-client/src/wire.rs",
    "crates/once-client/src/transport.rs",
    "crates/once-reconcile/src/grpc.rs",
];

#[test]
fn protobuf_messages_stay_at_the_wire() {
    let sources = workspace_sources();
    let tests = test_modules(&sources);
    let named = ["pb::", "prost::", "prost_types::", "tonic_prost::"];
    let outside: Vec<_> = sources
        .iter()
        .filter(|path| crate_of(path) != "once-api")
        .filter(|path| !AT_THE_WIRE.contains(&path.to_string_lossy().as_ref()))
        .filter(|path| {
            shipped_code(path, &tests).is_some_and(|code| named.iter().any(|n| code.contains(n)))
        })
        .collect();
    assert!(
        outside.is_empty(),
        "protobuf types named outside once-api and the files at the wire: {outside:#?}"
    );
}

#[test]
fn shipped_code_never_unwraps() {
    let sources = workspace_sources();
    let tests = test_modules(&sources);
    let unwrapping: Vec<_> = sources
        .iter()
        .filter(|path| shipped_code(path, &tests).is_some_and(|code| code.contains(".unwrap()")))
        .collect();
    assert!(
        unwrapping.is_empty(),
        "`.unwrap()` outside test code (say why it cannot fail with `expect`, or handle it): \
         {unwrapping:#?}"
    );
}

/// The names in backticks that look like a test's: lowercase words joined by underscores, at
/// least four of them, optionally behind a module path.
fn test_names(text: &str) -> BTreeSet<String> {
    text.split('`')
        .skip(1)
        .step_by(2)
        .filter(|name| {
            let last = name.rsplit("::").next().unwrap_or(name);
            last.split('_').count() >= 4
                && name
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == ':')
        })
        .map(str::to_owned)
        .collect()
}

#[test]
fn every_test_the_architecture_names_exists() {
    let architecture = read(Path::new("ARCHITECTURE.md"));
    let names = test_names(&architecture);
    assert!(names.len() > 30, "only {} test names found", names.len());
    let mut files = workspace_sources();
    let mut python = Vec::new();
    for entry in fs::read_dir(root().join("tests/mcp")).expect("tests/mcp") {
        let path = entry.expect("an entry").path();
        if path.extension().is_some_and(|ext| ext == "py") {
            python.push(
                path.strip_prefix(root())
                    .expect("under the root")
                    .to_owned(),
            );
        }
    }
    files.extend(python);
    let texts: Vec<(PathBuf, String)> = files.into_iter().map(|p| (p.clone(), read(&p))).collect();
    let missing: Vec<_> = names
        .iter()
        .filter(|name| {
            let mut path: Vec<&str> = name.split("::").collect();
            let function = path.pop().expect("a name");
            // `module::name`: a file of that module defines it (a `tests` segment is the
            // module's own test module, in the same file or beside it).
            let module = path.iter().rev().find(|segment| **segment != "tests");
            !texts.iter().any(|(file, text)| {
                let defines = ["fn {}(", "fn {}<", "def {}("]
                    .iter()
                    .any(|form| text.contains(&form.replace("{}", function)));
                let in_module = module.is_none_or(|module| {
                    let file = file.to_string_lossy();
                    file.contains(&format!("/{module}.rs"))
                        || file.contains(&format!("/{module}/"))
                        || file.contains(&format!("/{module}_tests.rs"))
                });
                defines && in_module
            })
        })
        .collect();
    assert!(
        missing.is_empty(),
        "ARCHITECTURE.md names tests that do not exist: {missing:#?}"
    );
}
