//! Compiles `proto/` with a pure-Rust protobuf compiler, so no system `protoc` is needed, and
//! keeps the encoded descriptors for gRPC server reflection.

use std::path::PathBuf;

use prost::Message;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("../../proto");
    let files = [
        "once/ledger/v1/ledger.proto",
        "once/reconciler/v1/reconciler.proto",
        "once/admin/v1/admin.proto",
    ];
    for file in files {
        println!("cargo:rerun-if-changed={}", root.join(file).display());
    }
    let descriptors = protox::Compiler::new([&root])?
        .include_imports(true)
        .include_source_info(true)
        .open_files(files)?
        .file_descriptor_set();
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(out.join("descriptors.bin"), descriptors.encode_to_vec())?;
    // Undecodable requests are the caller's mistake, not an internal error: see `codec`.
    tonic_prost_build::configure()
        .codec_path("crate::codec::Codec")
        // Holds a key's secret: its Debug is written by hand, without it.
        .skip_debug(["once.admin.v1.CreateKeyResponse"])
        .compile_fds(descriptors)?;
    Ok(())
}
