//! The commit the project's binaries are built from, when built from a git checkout:
//! `ONCE_GIT_COMMIT`, empty otherwise (a source archive, no git).

use std::path::Path;
use std::process::Command;

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let git = root.join(".git");
    // A new commit moves HEAD or the branch it names. Only files that exist are watched: cargo
    // runs a script watching a missing file on every build, and everything above this crate
    // would be compiled again each time.
    let mut watched = vec![git.join("HEAD"), git.join("packed-refs")];
    if let Ok(head) = std::fs::read_to_string(git.join("HEAD")) {
        if let Some(branch) = head.trim().strip_prefix("ref: ") {
            watched.push(git.join(branch));
        }
    }
    for file in watched.iter().filter(|file| file.exists()) {
        println!("cargo:rerun-if-changed={}", file.display());
    }
    let commit = Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(&root)
        .output()
        .ok()
        .filter(|out| out.status.success())
        .and_then(|out| String::from_utf8(out.stdout).ok())
        .map(|commit| commit.trim().to_owned())
        .unwrap_or_default();
    println!("cargo:rustc-env=ONCE_GIT_COMMIT={commit}");
}
