//! Sets the shared library's SONAME to `libvsan.so.<major>`, so programs linked against
//! one major version never load another.

fn main() {
    let major = std::env::var("CARGO_PKG_VERSION_MAJOR").unwrap_or_else(|_| "0".into());
    let target_os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    if target_os == "linux" || target_os == "android" {
        println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libvsan.so.{major}");
    }
    println!("cargo:rerun-if-changed=build.rs");
}
