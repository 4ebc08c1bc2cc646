//! Sets the shared library's SONAME to `libvsan.so.<major>`, so programs linked against
//! one major version never load another, and writes for the built tree:
//! - `target/<profile>/deps/libvsan.so.<major>`, a link to `libvsan.so` (what programs
//!   linked against it ask the loader for);
//! - `target/<profile>/vsan.pc` and `vsan-static.pc`, pkg-config files: with
//!   `PKG_CONFIG_PATH=target/release`, `pkg-config --cflags --libs vsan` links the
//!   shared library and `pkg-config --cflags --libs vsan-static` the static one.
//!
//! The libraries they name are the ones in `target/<profile>/deps/`: cargo writes them
//! there whenever it builds vsan-ffi, also as a dependency (as `cargo test --workspace`
//! does), while it copies them up to `target/<profile>/` only for `cargo build -p
//! vsan-ffi`; so the `deps/` ones are always the newest build.

use std::path::{Path, PathBuf};

fn main() {
    let major = std::env::var("CARGO_PKG_VERSION_MAJOR").unwrap_or_else(|_| "0".into());
    let version = std::env::var("CARGO_PKG_VERSION").unwrap_or_else(|_| "0.0.0".into());
    let target_os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    if target_os == "linux" || target_os == "android" {
        println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libvsan.so.{major}");
    }
    println!("cargo:rerun-if-changed=build.rs");
    // OUT_DIR is <target>/<profile>/build/vsan-ffi-<hash>/out.
    let Some(profile_dir) = std::env::var_os("OUT_DIR")
        .map(PathBuf::from)
        .and_then(|o| o.ancestors().nth(3).map(Path::to_path_buf))
    else {
        return;
    };
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap_or_default());
    let include = manifest.join("include");
    let lib_dir = profile_dir.join("deps");
    if target_os == "linux" {
        let link = lib_dir.join(format!("libvsan.so.{major}"));
        if std::fs::symlink_metadata(&link).is_err() {
            #[cfg(unix)]
            let _ = std::os::unix::fs::symlink("libvsan.so", &link);
        }
    }
    // What a program linking the static library needs besides it (as
    // `rustc --print native-static-libs` gives them on Linux).
    let private = "-lgcc_s -lutil -lrt -lpthread -lm -ldl -lc";
    let common = format!(
        "includedir={}\nlibdir={}\n\nVersion: {version}\nCflags: -I${{includedir}}\n",
        include.display(),
        lib_dir.display()
    );
    let shared = format!(
        "{common}Name: vsan\nDescription: vsan, synchronously mirrored virtual disks (shared \
         library)\nLibs: -L${{libdir}} -Wl,-rpath,${{libdir}} -lvsan\nLibs.private: {private}\n"
    );
    let stat = format!(
        "{common}Name: vsan-static\nDescription: vsan, synchronously mirrored virtual disks \
         (static library)\nLibs: ${{libdir}}/libvsan.a {private}\n"
    );
    let _ = write_if_changed(&profile_dir.join("vsan.pc"), &shared);
    let _ = write_if_changed(&profile_dir.join("vsan-static.pc"), &stat);
}

fn write_if_changed(path: &Path, text: &str) -> std::io::Result<()> {
    if std::fs::read_to_string(path).is_ok_and(|t| t == text) {
        return Ok(());
    }
    std::fs::write(path, text)
}
