//! Compiles `proto/replica.proto` into prost types with protox: pure Rust, so building
//! the crate needs no system `protoc`. With the `mgmt` feature, also
//! `proto/mgmt.proto` into prost types plus the tonic server trait and client.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    let fds = protox::compile(["proto/replica.proto"], ["proto"])?;
    prost_build::Config::new().compile_fds(fds)?;
    #[cfg(feature = "mgmt")]
    {
        let fds = protox::compile(["proto/mgmt.proto"], ["proto"])?;
        tonic_prost_build::configure()
            .codec_path("crate::mgmt::Codec")
            .build_server(true)
            .build_client(true)
            .compile_fds(fds)?;
    }
    Ok(())
}
