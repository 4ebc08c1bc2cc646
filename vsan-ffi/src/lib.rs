//! # vsan-ffi (not yet implemented)
//!
//! This crate will hold the C ABI of vsan: opaque `vsan_node` / `vsan_disk` handles,
//! one `vsan_result` enum, blocking and callback-based I/O, and a cbindgen-generated
//! `include/vsan.h`. See `DESIGN.md` ("vsan-ffi") for the plan.
//!
//! **Status:** nothing here works yet; the crate builds as `cdylib` and `staticlib` with
//! no exported symbols, so no program can link against a half-made ABI by accident.
#![deny(missing_docs)]

#[cfg(test)]
mod tests {
    /// The C result codes will map one-to-one to `vsan_core::ErrorKind`, whose values are
    /// explicit; this guards that the values the ABI will copy are the ones documented.
    #[test]
    fn error_kinds_have_explicit_values() {
        assert_eq!(vsan_core::ErrorKind::InvalidArgument as u32, 1);
        assert_eq!(vsan_core::ErrorKind::OutOfRange as u32, 2);
    }
}
