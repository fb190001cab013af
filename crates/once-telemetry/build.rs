//! The commit the project's binaries are built from, when built from a git checkout:
//! `ONCE_GIT_COMMIT`, empty otherwise (a source archive, no git).

use std::path::{Path, PathBuf};
use std::process::Command;

/// What `git` prints for `args` in the checkout, trimmed; `None` without git or a checkout.
fn git(root: &Path, args: &[&str]) -> Option<String> {
    Command::new("git")
        .args(args)
        .current_dir(root)
        .output()
        .ok()
        .filter(|out| out.status.success())
        .and_then(|out| String::from_utf8(out.stdout).ok())
        .map(|text| text.trim().to_owned())
}

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    // A new commit moves HEAD, the branch it names (a loose file under refs/heads, created anew
    // when the branch was packed) or packed-refs. git names the directories, so a linked
    // worktree is followed too. Only paths that exist are watched: cargo runs a script that
    // watches a missing path on every build, and everything above this crate would be compiled
    // again each time.
    let git_dir = git(&root, &["rev-parse", "--absolute-git-dir"]).map(PathBuf::from);
    let common_dir = git(&root, &["rev-parse", "--git-common-dir"]).map(|dir| root.join(dir));
    let mut watched = Vec::new();
    if let Some(git_dir) = &git_dir {
        watched.push(git_dir.join("HEAD"));
    }
    if let Some(common_dir) = &common_dir {
        watched.push(common_dir.join("packed-refs"));
        watched.push(common_dir.join("refs").join("heads"));
    }
    for path in watched.iter().filter(|path| path.exists()) {
        println!("cargo:rerun-if-changed={}", path.display());
    }
    let commit = git(&root, &["rev-parse", "--short=12", "HEAD"]).unwrap_or_default();
    println!("cargo:rustc-env=ONCE_GIT_COMMIT={commit}");
}
