//! Generates the `shop` service and client from `proto/shop.proto` with the
//! `protoc` that `protoc-bin-vendored` ships (no system `protoc` needed).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // SAFETY of intent: build scripts are single-threaded; prost-build reads PROTOC.
    std::env::set_var("PROTOC", protoc);
    tonic_build::configure().compile_protos(&["proto/shop.proto"], &["proto"])?;
    println!("cargo:rerun-if-changed=proto/shop.proto");
    Ok(())
}
